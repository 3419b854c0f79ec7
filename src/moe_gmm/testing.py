"""Shared numerical references, input factories and error checks.

Used by the tests, the benchmarks and ``moe-gmm validate`` alike, so there is exactly one
float64 reference for every op in the project.

Legend: M rows, K in-features, N out-features, E experts, T tokens, k top-k slots, H hidden.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

__all__ = [
    "FLOAT32_UNIT_ROUNDOFF",
    "ROUTINGS",
    "Float32RoundingNoise",
    "Float64Everywhere",
    "Tolerance",
    "assert_rel_close",
    "beyond_rounding_noise",
    "gmm_inputs",
    "group_counts",
    "reference_grouped_matmul",
    "reference_grouped_matmul_grads",
    "reference_expert_mlp",
    "reference_moe_block",
    "reference_permute",
    "reference_permute_grad",
    "reference_router",
    "reference_swiglu",
    "reference_unpermute",
    "reference_unpermute_grads",
    "relative_error",
    "rounding_noise",
    "routing_ids",
    "tolerance_for",
]


@dataclass(frozen=True)
class Tolerance:
    """Per-dtype limits: ``rel`` for relative-norm error vs float64, ``rtol``/``atol`` for fused vs eager."""

    rel: float
    rtol: float
    atol: float


# bf16 fused vs eager uses the reference test's rtol = atol = 1e-2.
_TOLERANCES = {
    torch.float64: Tolerance(rel=1e-12, rtol=1e-10, atol=1e-10),
    torch.float32: Tolerance(rel=1e-5, rtol=1e-5, atol=1e-5),
    torch.float16: Tolerance(rel=5e-3, rtol=1e-2, atol=1e-2),
    torch.bfloat16: Tolerance(rel=1e-2, rtol=1e-2, atol=1e-2),
}


def tolerance_for(dtype: torch.dtype) -> Tolerance:
    return _TOLERANCES[dtype]


def relative_error(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """``||actual - reference|| / ||reference||`` in float64 (0 when both are exactly zero)."""
    diff = (actual.detach().double() - reference.detach().double()).norm().item()
    scale = reference.detach().double().norm().item()
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / scale


def assert_rel_close(actual: torch.Tensor, reference: torch.Tensor, limit: float, what: str = "tensor") -> None:
    """Relative-norm check that also rejects any NaN/Inf the reference does not have."""
    if actual.shape != reference.shape:
        raise AssertionError(f"{what}: shape {tuple(actual.shape)} != reference {tuple(reference.shape)}")
    bad = ~torch.isfinite(actual.detach()) & torch.isfinite(reference.detach())
    if bool(bad.any()):
        raise AssertionError(f"{what}: {int(bad.sum())} non-finite elements where the reference is finite")
    err = relative_error(actual, reference)
    if not err <= limit:
        max_abs = (actual.detach().double() - reference.detach().double()).abs().max().item()
        raise AssertionError(f"{what}: relative error {err:.3e} > {limit:.1e} (max abs diff {max_abs:.3e})")


# ----------------------------------------------------------------------------------------------
# Grouped matmul reference
# ----------------------------------------------------------------------------------------------


def _bounds(group_counts_E: torch.Tensor | list[int]) -> list[int]:
    counts = group_counts_E.tolist() if isinstance(group_counts_E, torch.Tensor) else list(group_counts_E)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + int(c))
    return bounds


def reference_grouped_matmul(x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E) -> torch.Tensor:
    """float64 ``y[rows_e] = x[rows_e] @ w[e]``, written independently of every backend."""
    x64, w64 = x_MK.detach().double().cpu(), w_EKN.detach().double().cpu()
    bounds = _bounds(counts_E)
    y = torch.zeros(x64.shape[0], w64.shape[2], dtype=torch.float64)
    for e in range(w64.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        y[s:t] = x64[s:t] @ w64[e]
    return y


def reference_grouped_matmul_grads(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, counts_E, dy_MN: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(dx, dw)``: ``dx[rows_e] = dy[rows_e] @ w[e]^T``, ``dw[e] = x[rows_e]^T @ dy[rows_e]``."""
    x64, w64, dy64 = (t.detach().double().cpu() for t in (x_MK, w_EKN, dy_MN))
    bounds = _bounds(counts_E)
    dx = torch.zeros_like(x64)
    dw = torch.zeros_like(w64)
    for e in range(w64.shape[0]):
        s, t = bounds[e], bounds[e + 1]
        dx[s:t] = dy64[s:t] @ w64[e].T
        dw[e] = x64[s:t].T @ dy64[s:t]
    return dx, dw


# ----------------------------------------------------------------------------------------------
# Routing and input factories
# ----------------------------------------------------------------------------------------------

ROUTINGS = ("uniform", "uneven", "empty", "skewed", "one_expert", "duplicate_topk")


def routing_ids(
    num_tokens: int, top_k: int, num_experts: int, routing: str = "uniform", *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``[T, k]`` int64 expert ids for one of :data:`ROUTINGS`.

    - uniform: each token picks k distinct experts uniformly;
    - uneven: distinct experts, drawn with weights 1..E (later experts busier);
    - empty: distinct experts from the odd-numbered half only (every even expert gets nothing);
    - skewed: Zipf-like weights over a quarter of the experts, the rest get nothing;
    - one_expert: every slot goes to expert 0 (duplicates within a token's top-k);
    - duplicate_topk: slots drawn with replacement, so a token may pick one expert twice.
    """
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
    g = generator
    if routing == "one_expert":
        return torch.zeros(num_tokens, top_k, dtype=torch.int64)
    if routing == "duplicate_topk":
        return torch.randint(0, num_experts, (num_tokens, top_k), generator=g)
    weights = torch.ones(num_experts, dtype=torch.float64)
    if routing == "uneven":
        weights = torch.arange(1, num_experts + 1, dtype=torch.float64)
    elif routing == "empty":
        weights = torch.zeros(num_experts, dtype=torch.float64)
        weights[1::2] = 1.0
    elif routing == "skewed":
        hot = max(top_k, num_experts // 4)
        weights = torch.zeros(num_experts, dtype=torch.float64)
        weights[:hot] = 1.0 / torch.arange(1, hot + 1, dtype=torch.float64) ** 1.2
        weights = weights[torch.randperm(num_experts, generator=g)]
    if int((weights > 0).sum()) < top_k:
        raise ValueError(f"routing {routing!r} leaves fewer than top_k={top_k} experts of {num_experts}")
    if num_tokens == 0:
        return torch.zeros(0, top_k, dtype=torch.int64)
    return torch.multinomial(weights.expand(num_tokens, -1), top_k, replacement=False, generator=g)


def group_counts(
    num_rows: int, num_experts: int, routing: str = "uniform", *, generator: torch.Generator | None = None
) -> list[int]:
    """Rows per expert summing to ``num_rows`` with the shape of one of :data:`ROUTINGS` (top-1)."""
    if routing in ("duplicate_topk",):
        routing = "uniform"
    if routing == "empty" and num_experts == 1:
        routing = "uniform"
    ids = routing_ids(num_rows, 1, num_experts, routing, generator=generator).flatten()
    return torch.bincount(ids, minlength=num_experts).tolist()


def gmm_inputs(
    counts_E: list[int],
    k: int,
    n: int,
    dtype: torch.dtype = torch.float32,
    *,
    device: str | torch.device = "cpu",
    transposed_weight: bool = False,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [M, K], w [E, K, N], group_list [E] int64)``, scaled so outputs are O(1).

    With ``transposed_weight`` the weight is a ``.transpose(1, 2)`` view of an ``[E, N, K]`` tensor.
    """
    g = torch.Generator().manual_seed(seed)
    num_rows, num_experts = sum(counts_E), len(counts_E)
    x = torch.randn(num_rows, k, generator=g, dtype=torch.float64)
    if transposed_weight:
        w = (torch.randn(num_experts, n, k, generator=g, dtype=torch.float64) / k**0.5).transpose(1, 2)
    else:
        w = torch.randn(num_experts, k, n, generator=g, dtype=torch.float64) / k**0.5
    x = x.to(device=device, dtype=dtype)
    w = w.to(device=device, dtype=dtype)
    return x, w, torch.tensor(counts_E, dtype=torch.int64)


# ----------------------------------------------------------------------------------------------
# Permute / unpermute references
# ----------------------------------------------------------------------------------------------


def reference_permute(hidden_TH: torch.Tensor, ids_Tk: torch.Tensor, num_experts: int):
    """float64 ``(permuted [T*k, H], rows [T, k], counts [E])`` by a plain loop.

    ``rows[t, j]`` is the permuted row holding token t's copy for slot j; rows are grouped by
    expert, stable in (token, slot) order.
    """
    num_tokens, top_k = ids_Tk.shape
    h64 = hidden_TH.detach().double().cpu()
    ids = ids_Tk.cpu().tolist()
    counts = [0] * num_experts
    for row in ids:
        for e in row:
            counts[e] += 1
    next_row = _bounds(counts)[:-1]
    rows = torch.empty(num_tokens, top_k, dtype=torch.int64)
    permuted = torch.zeros(num_tokens * top_k, h64.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            e = ids[t][j]
            rows[t, j] = next_row[e]
            permuted[next_row[e]] = h64[t]
            next_row[e] += 1
    # Stable (token, slot) order within each expert requires a second pass only if ids were
    # visited out of order; the loop above visits tokens then slots, so it already is.
    return permuted, rows, torch.tensor(counts, dtype=torch.int64)


def reference_unpermute(expert_out_RH: torch.Tensor, rows_Tk: torch.Tensor, probs_Tk: torch.Tensor) -> torch.Tensor:
    """float64 ``out[t] = sum_j probs[t, j] * expert_out[rows[t, j]]``."""
    y64 = expert_out_RH.detach().double().cpu()
    p64 = probs_Tk.detach().double().cpu()
    num_tokens, top_k = rows_Tk.shape
    out = torch.zeros(num_tokens, y64.shape[1], dtype=torch.float64)
    for t in range(num_tokens):
        for j in range(top_k):
            out[t] += p64[t, j] * y64[int(rows_Tk[t, j])]
    return out


def reference_permute_grad(grad_permuted_RH: torch.Tensor, rows_Tk: torch.Tensor) -> torch.Tensor:
    """float64 ``d hidden[t] = sum_j grad_permuted[rows[t, j]]`` (the adjoint of permute)."""
    ones = torch.ones(rows_Tk.shape, dtype=torch.float64)
    return reference_unpermute(grad_permuted_RH, rows_Tk, ones)


def reference_unpermute_grads(
    expert_out_RH: torch.Tensor, rows_Tk: torch.Tensor, probs_Tk: torch.Tensor, grad_out_TH: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(d expert_out, d probs)`` of unpermute by a plain loop.

    ``d expert_out[rows[t, j]] = probs[t, j] * grad_out[t]``, ``d probs[t, j] = <grad_out[t], expert_out[rows[t, j]]>``.
    """
    y64, p64, g64 = (t.detach().double().cpu() for t in (expert_out_RH, probs_Tk, grad_out_TH))
    num_tokens, top_k = rows_Tk.shape
    d_y = torch.zeros_like(y64)
    d_p = torch.zeros_like(p64)
    for t in range(num_tokens):
        for j in range(top_k):
            r = int(rows_Tk[t, j])
            d_y[r] += p64[t, j] * g64[t]
            d_p[t, j] = torch.dot(g64[t], y64[r])
    return d_y, d_p


def reference_swiglu(x: torch.Tensor) -> torch.Tensor:
    """float64 ``silu(x[..., :I]) * x[..., I:]`` (gate = first half), differentiable for float64 leaves."""
    x64 = x.double()
    half = x64.shape[-1] // 2
    gate, up = x64[..., :half], x64[..., half:]
    return gate / (1.0 + torch.exp(-gate)) * up


def reference_expert_mlp(
    x_RH: torch.Tensor, gate_up_EH2I: torch.Tensor, down_EIH: torch.Tensor, counts_E
) -> torch.Tensor:
    """float64 per-expert loop ``swiglu(x[rows_e] @ gate_up[e]) @ down[e]``.

    Not detached: pass float64 leaves with ``requires_grad`` to get reference gradients by autograd.
    """
    x64, gu64, d64 = x_RH.double(), gate_up_EH2I.double(), down_EIH.double()
    bounds = _bounds(counts_E)
    outs = [
        reference_swiglu(x64[bounds[e] : bounds[e + 1]] @ gu64[e]) @ d64[e] for e in range(gu64.shape[0])
    ]
    return torch.cat(outs, dim=0) if outs else x64.new_zeros(0, d64.shape[2])


def reference_router(x_TH: torch.Tensor, gate_EH: torch.Tensor, top_k: int, norm_topk_prob: bool = True):
    """float64 ``(weights [T, k], ids [T, k])``: softmax(x @ gate^T) -> top-k -> renormalise. Differentiable."""
    probs_TE = torch.softmax(x_TH.double() @ gate_EH.double().T, dim=-1)
    weights_Tk, ids_Tk = torch.topk(probs_TE, top_k, dim=-1)
    if norm_topk_prob:
        weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
    return weights_Tk, ids_Tk


def reference_moe_block(params: dict[str, torch.Tensor], x_TH: torch.Tensor, top_k: int, norm_topk_prob: bool = True):
    """float64 sparse MoE block over a state dict in moe-gmm layout, by a loop over experts.

    ``params`` holds ``gate.weight [E, H]``, ``experts.gate_up_proj [E, H, 2I]``,
    ``experts.down_proj [E, I, H]`` and optionally ``shared_expert.{gate,up,down}_proj.weight`` and
    ``shared_expert_gate.weight``. Written without permute (a token mask per expert), and not
    detached: pass float64 leaves to get reference gradients by autograd.
    """
    x64 = x_TH.double()
    p = {name: t.double() for name, t in params.items()}
    weights_Tk, ids_Tk = reference_router(x64, p["gate.weight"], top_k, norm_topk_prob)
    out = torch.zeros_like(x64)
    for e in range(p["gate.weight"].shape[0]):
        # Weight of expert e per token (sums duplicate slots; zero where e was not picked).
        w_T = (weights_Tk * (ids_Tk == e)).sum(dim=-1)
        token_ids = torch.nonzero(w_T, as_tuple=True)[0]
        if token_ids.numel() == 0:
            continue
        y = reference_swiglu(x64[token_ids] @ p["experts.gate_up_proj"][e]) @ p["experts.down_proj"][e]
        out = out.index_add(0, token_ids, w_T[token_ids, None] * y)
    if "shared_expert.gate_proj.weight" in p:
        gate = x64 @ p["shared_expert.gate_proj.weight"].T
        up = x64 @ p["shared_expert.up_proj.weight"].T
        shared = (gate * torch.sigmoid(gate) * up) @ p["shared_expert.down_proj.weight"].T
        out = out + torch.sigmoid(x64 @ p["shared_expert_gate.weight"].T) * shared
    return out


# ----------------------------------------------------------------------------------------------
# Rounding noise: what "as accurate as float32 can be" means for a whole computation
# ----------------------------------------------------------------------------------------------

FLOAT32_UNIT_ROUNDOFF = 2.0**-24
_DISCARDED_BITS = 52 - 23  # float64 mantissa bits a float32 rounding drops


class Float64Everywhere(TorchFunctionMode):
    """Run a float64 model where its code asks for float32 too (``.float()``, ``dtype=torch.float32``).

    Models upcast their routers with ``.float()``; in a ``.double()`` copy that is a downcast, which
    leaves a float32 island in the reference or fails against a float64 weight.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        def widen(value: object) -> object:
            return torch.float64 if value is torch.float32 else value

        if func is torch.Tensor.float:
            func = torch.Tensor.double
        args = tuple(widen(a) for a in args)
        kwargs = {k: widen(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


class Float32RoundingNoise(TorchDispatchMode):
    """Float64 arithmetic in which every op's result carries a relative error of up to float32's unit
    roundoff (Monte Carlo arithmetic at op granularity).

    A float32 run of the same code differs from float64 by such errors, whatever its thread count
    or summation order; the spread of a few of these runs around the plain float64 run is therefore
    the rounding noise of that computation, large exactly where it is ill-conditioned (sums that
    cancel). The error is a function of the value's own discarded bits and ``seed``, as a rounding
    is: equal values stay equal, so exact ties (routing) and exact cancellations (``x - x``) stay
    exact, as they do in float32. Views, in-place and ``out=`` ops are left alone.
    """

    def __init__(self, seed: int) -> None:
        super().__init__()
        # An odd multiplier per seed scatters the discarded bits into a different error per seed.
        self._multiplier = 2 * (0x9E3779B1 + 7919 * seed) + 1

    def _perturb(self, value: object) -> object:
        if not isinstance(value, torch.Tensor) or value.dtype != torch.float64 or value.numel() == 0:
            return value
        discarded = value.view(torch.int64) & ((1 << _DISCARDED_BITS) - 1)
        mixed = (discarded * (self._multiplier & ((1 << 30) - 1))) & ((1 << _DISCARDED_BITS) - 1)
        error = mixed.double() / (1 << (_DISCARDED_BITS - 1)) - 1.0  # in [-1, 1)
        error = error.masked_fill(discarded == 0, 0.0)  # float32 holds it: copies, gathers, max stay exact
        return value * (1.0 + FLOAT32_UNIT_ROUNDOFF * error)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out
        return tree_map(self._perturb, out)


def rounding_noise(
    exact: Mapping[str, torch.Tensor], perturbed: Sequence[Mapping[str, torch.Tensor]]
) -> dict[str, float]:
    """Per tensor, the largest norm distance of a :class:`Float32RoundingNoise` run from the plain
    float64 run, and at least float32's rounding of the exact values themselves."""
    noise = {}
    for name, value in exact.items():
        ref = value.detach().double()
        spread = max((run[name].detach().double() - ref).norm().item() for run in perturbed)
        noise[name] = max(spread, FLOAT32_UNIT_ROUNDOFF * ref.norm().item())
    return noise


def beyond_rounding_noise(
    values: Mapping[str, torch.Tensor], exact: Mapping[str, torch.Tensor], noise: Mapping[str, float], factor: float
) -> list[str]:
    """One line per tensor farther than ``factor`` times its rounding noise from the float64 run."""
    failures = []
    for name, value in values.items():
        error = (value.detach().double() - exact[name].detach().double()).norm().item()
        if not error <= factor * noise[name]:
            failures.append(f"{name}: {error:.2e} from float64, {error / noise[name]:.1f}x its rounding noise")
    return failures
