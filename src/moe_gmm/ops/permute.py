"""Token permute / unpermute around the grouped matmul.

Legend: T tokens, k top-k slots, H hidden, E experts, R = T * k permuted rows.

``permute`` copies every (token, slot) pair to one row of ``permuted_RH`` so that rows are grouped
by expert in ascending order (stable in (token, slot) order inside an expert); the per-expert row
counts are the grouped matmul's ``group_list``. ``unpermute`` combines the expert outputs back into
tokens, weighted by the routing probabilities.

``row_id_map_R`` (int64, flat in (token, slot) order) is the one piece of state between the two:
``row_id_map[t * k + j]`` is the row of ``permuted_RH`` that holds token t's copy for slot j (the
meaning of torch_npu's ``sorted_indices``). It is a permutation of ``range(R)``.

Both ops are ``torch.library`` custom ops (fake and autograd registered), so ``torch.compile``
traces a layer through them. Neither uses atomics: the forward of ``permute`` and the backward of
``unpermute`` are gathers / unique-index scatters, and every sum over the k slots is a gather into
``[n, k, H]`` for a chunk of n tokens reduced over k by one kernel (``sum`` or a
``[n, 1, k] @ [n, k, H]`` batched GEMM), accumulated in float32 for 16-bit inputs. Results are
therefore reproducible run to run. Large outputs come from :mod:`moe_gmm.ops.host_cache`.

On CPU (float32, bfloat16, float16) permute's forward (a counting sort of the ids and one row
copy), the k-way sums and both of unpermute's gradients run as one-pass native kernels
(:mod:`moe_gmm.ops.native`: slot order and float32 accumulation as above, each row read once);
the composed torch path below stays for other devices, float64 and machines without a C++
compiler. On an Ascend NPU with torch_npu the forward passes run the vendor's fused
kernels (``moe_gmm.ops.npu_fused``); the backward formulas are the same everywhere.
"""

from __future__ import annotations

import torch
from moe_gmm.ops import host_cache, native, npu_fused
from moe_gmm.ops.eager_path import direct, label
from moe_gmm.ops.permute_checks import (
    check_expert_ids,
    check_flag,
    check_float,
    check_index,
    check_row_id_map,
    check_row_id_map_in_op,
    dtype_name,
)
from moe_gmm.ops.row_copy import gather_rows

__all__ = ["permute", "unpermute"]

# tokens_per_expert holds one int64 per expert. Models have hundreds to a few thousand experts; a
# bound far above them refuses a mistyped count before the allocator fails on it.
MAX_NUM_EXPERTS = 2**20


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Rows are widened to float32 and reduced a chunk at a time, so the float32 copy stays in cache
# instead of streaming a [T*k, H] float32 temporary through memory.
_CHUNK_BYTES = 4 << 20


def _empty(shape: tuple[int, ...], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    return host_cache.empty(shape, dtype=dtype or like.dtype, device=like.device)


def _token_step(top_k: int, hidden: int, acc: torch.dtype) -> int:
    """Tokens per chunk: about ``_CHUNK_BYTES`` of ``[tokens, k, H]`` in the accumulation dtype."""
    row_bytes = max(1, top_k * hidden * acc.itemsize)
    return max(1, _CHUNK_BYTES // row_bytes)


def _weighted_slot_sum(src_RH: torch.Tensor, row_id_map_R: torch.Tensor, probs_Tk: torch.Tensor | None, top_k: int):
    """``out[t] = sum_j p[t, j] * src[row_id_map[t*k + j]]`` (p = 1 when ``probs_Tk`` is None).

    Gathers ``[T, k, H]`` a chunk of tokens at a time and reduces over k in a fixed order in
    float32 (float64 for float64); returns ``[T, H]`` in ``src_RH.dtype``.
    """
    num_rows, hidden = src_RH.shape
    num_tokens = num_rows // top_k if top_k > 0 else 0
    kernels = native.ops(src_RH)
    if kernels is not None and num_rows > 0:
        out_TH = _empty((num_tokens, hidden), src_RH)
        probs = None if probs_Tk is None else probs_Tk.to(torch.float32).contiguous()
        kernels.slot_sum(src_RH.contiguous(), row_id_map_R.contiguous(), probs, top_k, out_TH)
        return out_TH
    acc = _acc_dtype(src_RH.dtype)
    step = min(_token_step(top_k, hidden, acc), max(num_tokens, 1))
    out_TH = _empty((num_tokens, hidden), src_RH)
    gathered = torch.empty(step * top_k, hidden, dtype=src_RH.dtype, device=src_RH.device)
    widened = None if src_RH.dtype == acc else torch.empty(step, top_k, hidden, dtype=acc, device=src_RH.device)
    reduced = torch.empty(step, 1, hidden, dtype=acc, device=src_RH.device)
    probs_acc = None if probs_Tk is None else probs_Tk.to(acc)
    for t0 in range(0, num_tokens, step):
        t1 = min(num_tokens, t0 + step)
        n = t1 - t0
        rows = gather_rows(src_RH, row_id_map_R[t0 * top_k : t1 * top_k], gathered[: n * top_k])
        wide = rows.view(n, top_k, hidden) if widened is None else widened[:n].copy_(rows.view(n, top_k, hidden))
        if probs_acc is None:
            torch.sum(wide, dim=1, keepdim=True, out=reduced[:n])
        else:
            # [n, 1, k] @ [n, k, H]: the weighted k-way sum as one batched GEMM.
            torch.bmm(probs_acc[t0:t1].unsqueeze(1), wide, out=reduced[:n])
        out_TH[t0:t1].copy_(reduced[:n].squeeze(1))
    return out_TH


# --------------------------------------------------------------------------------------------
# permute
# --------------------------------------------------------------------------------------------


def _permute_body(
    hidden_TH: torch.Tensor, selected_experts_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    vendor = npu_fused.vendor_ops_for(hidden_TH)
    if vendor is not None and npu_fused.permute_fits(selected_experts_Tk, num_experts):
        return npu_fused.permute_forward(vendor, hidden_TH, selected_experts_Tk, num_experts)
    kernels = native.ops(hidden_TH)
    if kernels is not None and hidden_TH.shape[0] > 0:
        # One counting sort and one row copy in place of the sort, index arithmetic, gather and
        # bincount below: the same rows and map (the counting sort is stable too).
        num_rows = selected_experts_Tk.numel()
        permuted_RH = _empty((num_rows, hidden_TH.shape[1]), hidden_TH)
        row_id_map_R = torch.empty(num_rows, dtype=torch.int64)
        tokens_per_expert_E = torch.empty(num_experts, dtype=torch.int64)
        kernels.permute_rows(
            hidden_TH.contiguous(), selected_experts_Tk.reshape(-1).contiguous(), num_experts,
            permuted_RH, row_id_map_R, tokens_per_expert_E,
        )  # fmt: skip
        return permuted_RH, row_id_map_R, tokens_per_expert_E
    top_k = selected_experts_Tk.shape[1]
    flat_ids_R = selected_experts_Tk.reshape(-1).to(torch.int64)
    if flat_ids_R.device.type == "cpu" and flat_ids_R.numel() > 0:
        # Whatever validate said: free on the host (elsewhere bincount refuses a negative id below).
        check_expert_ids(flat_ids_R, num_experts)
    # order_R[r] = flat (token, slot) index that lands on row r; stable sort keeps (token, slot)
    # order inside each expert. O(R log R) on device, no per-token Python work.
    order_R = torch.sort(flat_ids_R, stable=True).indices
    row_id_map_R = torch.empty_like(order_R)
    row_id_map_R[order_R] = torch.arange(order_R.numel(), device=order_R.device)  # unique indices: no atomics
    permuted_RH = gather_rows(hidden_TH, torch.div(order_R, top_k, rounding_mode="floor"))
    tokens_per_expert_E = torch.bincount(flat_ids_R, minlength=num_experts)
    if tokens_per_expert_E.shape[0] != num_experts:  # an id >= E under validate=False
        raise ValueError(f"selected_experts_Tk ids must lie in [0, num_experts={num_experts})")
    return permuted_RH, row_id_map_R, tokens_per_expert_E


@torch.library.custom_op("moe_gmm::permute", mutates_args=())
def _permute_op(
    hidden_TH: torch.Tensor, selected_experts_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _permute_body(hidden_TH, selected_experts_Tk, num_experts)


@_permute_op.register_fake
def _(hidden_TH, selected_experts_Tk, num_experts):
    num_rows = selected_experts_Tk.shape[0] * selected_experts_Tk.shape[1]
    return (
        hidden_TH.new_empty(num_rows, hidden_TH.shape[1]),
        selected_experts_Tk.new_empty(num_rows, dtype=torch.int64),
        selected_experts_Tk.new_empty(num_experts, dtype=torch.int64),
    )


def _permute_setup_context(ctx, inputs, output) -> None:
    _, selected_experts_Tk, _ = inputs
    ctx.top_k = selected_experts_Tk.shape[1]
    ctx.save_for_backward(output[1])
    ctx.set_materialize_grads(False)


def _permute_backward(ctx, grad_permuted_RH, _grad_row_id_map, _grad_counts):
    if grad_permuted_RH is None:
        return None, None, None
    (row_id_map_R,) = ctx.saved_tensors
    with label("moe::permute_bwd"):
        # Each token's grad is the sum of its k copies' grads: a gather + one reduction.
        grad_hidden_TH = _weighted_slot_sum(grad_permuted_RH, row_id_map_R, None, ctx.top_k)
    return grad_hidden_TH, None, None


torch.library.register_autograd("moe_gmm::permute", _permute_backward, setup_context=_permute_setup_context)


class _Permute(torch.autograd.Function):
    """``moe_gmm::permute``'s direct path (:mod:`moe_gmm.ops.eager_path`): its body and backward."""

    @staticmethod
    def forward(ctx, hidden_TH: torch.Tensor, selected_experts_Tk: torch.Tensor, num_experts: int):
        out = _permute_body(hidden_TH, selected_experts_Tk, num_experts)
        ctx.mark_non_differentiable(out[1], out[2])
        _permute_setup_context(ctx, (hidden_TH, selected_experts_Tk, num_experts), out)
        return out

    backward = staticmethod(_permute_backward)


def _run_permute(hidden_TH: torch.Tensor, selected_experts_Tk: torch.Tensor, num_experts: int):
    if not direct(hidden_TH, selected_experts_Tk):
        return _permute_op(hidden_TH, selected_experts_Tk, num_experts)
    if torch.is_grad_enabled() and hidden_TH.requires_grad:
        return _Permute.apply(hidden_TH, selected_experts_Tk, num_experts)
    return _permute_body(hidden_TH, selected_experts_Tk, num_experts)


# --------------------------------------------------------------------------------------------
# unpermute
# --------------------------------------------------------------------------------------------


def _unpermute_body(
    expert_out_RH: torch.Tensor, row_id_map_R: torch.Tensor, probs_Tk: torch.Tensor, validate: bool = True
) -> torch.Tensor:
    if validate:  # here, not only at the boundary: under torch.compile only the op's body runs
        check_row_id_map_in_op(row_id_map_R, probs_Tk.shape[0] * probs_Tk.shape[1])
    vendor = npu_fused.vendor_ops_for(expert_out_RH)
    if vendor is not None:
        return npu_fused.unpermute_forward(vendor, expert_out_RH, row_id_map_R, probs_Tk)
    return _weighted_slot_sum(expert_out_RH, row_id_map_R, probs_Tk, probs_Tk.shape[1])


@torch.library.custom_op("moe_gmm::unpermute", mutates_args=())
def _unpermute_op(
    expert_out_RH: torch.Tensor, row_id_map_R: torch.Tensor, probs_Tk: torch.Tensor, validate: bool = True
) -> torch.Tensor:
    return _unpermute_body(expert_out_RH, row_id_map_R, probs_Tk, validate)


@_unpermute_op.register_fake
def _(expert_out_RH, row_id_map_R, probs_Tk, validate=True):
    return expert_out_RH.new_empty(probs_Tk.shape[0], expert_out_RH.shape[1])


def _unpermute_setup_context(ctx, inputs, output) -> None:
    expert_out_RH, row_id_map_R, probs_Tk, _ = inputs
    ctx.save_for_backward(expert_out_RH, row_id_map_R, probs_Tk)


def _unpermute_backward(ctx, grad_out_TH):
    with label("moe::unpermute_bwd"):
        return _unpermute_grads(ctx, grad_out_TH)


def _unpermute_grads(ctx, grad_out_TH):
    expert_out_RH, row_id_map_R, probs_Tk = ctx.saved_tensors
    kernels = native.ops(expert_out_RH, grad_out_TH)
    if kernels is not None and expert_out_RH.numel() > 0:
        return _unpermute_grads_native(
            kernels, ctx.needs_input_grad, grad_out_TH, expert_out_RH, row_id_map_R, probs_Tk
        )
    grad_expert_out = grad_probs = None
    if ctx.needs_input_grad[0]:
        grad_expert_out = _grad_expert_out(grad_out_TH, row_id_map_R, probs_Tk, expert_out_RH.dtype)
    if ctx.needs_input_grad[2]:
        grad_probs = _grad_probs(grad_out_TH, expert_out_RH, row_id_map_R, probs_Tk)
    return grad_expert_out, None, grad_probs, None


def _unpermute_grads_native(kernels, needs_input_grad, grad_out_TH, expert_out_RH, row_id_map_R, probs_Tk):
    """Both gradients in one pass over the tokens: each grad_out row is read and widened once."""
    num_tokens, top_k = probs_Tk.shape
    grad_out = grad_out_TH.to(expert_out_RH.dtype).contiguous()
    nothing = grad_out.new_empty(0)
    grad_expert_out = _empty(tuple(expert_out_RH.shape), expert_out_RH) if needs_input_grad[0] else None
    grad_probs = (
        torch.empty(num_tokens, top_k, dtype=torch.float32, device=probs_Tk.device) if needs_input_grad[2] else None
    )
    kernels.unpermute_backward(
        grad_out,
        expert_out_RH.contiguous() if grad_probs is not None else nothing,
        row_id_map_R.contiguous(),
        probs_Tk.to(torch.float32).contiguous(),
        nothing if grad_expert_out is None else grad_expert_out,
        nothing.float() if grad_probs is None else grad_probs,
    )
    return grad_expert_out, None, None if grad_probs is None else grad_probs.to(probs_Tk.dtype), None


def _grad_expert_out(
    grad_out_TH: torch.Tensor, row_id_map_R: torch.Tensor, probs_Tk: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``d expert_out[row_id_map[t*k+j]] = probs[t, j] * grad_out[t]``, multiplied in float32.

    Computed in row order: invert the permutation (a scatter of R ints, each written once), then
    gather whole rows of grad_out, a chunk at a time. Gathering rows is far faster on CPU than
    scattering ``[T*k, H]`` rows.
    """
    num_tokens, top_k = probs_Tk.shape
    hidden = grad_out_TH.shape[1]
    acc = _acc_dtype(dtype)
    # -1, not uninitialised memory, for a row no slot maps to: index_select then refuses it.
    order_R = torch.full_like(row_id_map_R, -1)
    order_R[row_id_map_R] = torch.arange(row_id_map_R.numel(), device=row_id_map_R.device)
    token_of_row_R = torch.div(order_R, top_k, rounding_mode="floor")
    prob_of_row_R1 = probs_Tk.reshape(-1).index_select(0, order_R).to(acc).unsqueeze(-1)
    grad_out = grad_out_TH.to(dtype)
    num_rows = num_tokens * top_k
    grad_RH = _empty((num_rows, hidden), grad_out)
    step = min(_token_step(top_k, hidden, acc) * top_k, max(num_rows, 1))
    gathered = torch.empty(step, hidden, dtype=dtype, device=grad_out.device)
    widened = None if dtype == acc else torch.empty(step, hidden, dtype=acc, device=grad_out.device)
    for r0 in range(0, num_rows, step):
        r1 = min(num_rows, r0 + step)
        if widened is None:
            gather_rows(grad_out, token_of_row_R[r0:r1], grad_RH[r0:r1]).mul_(prob_of_row_R1[r0:r1])
            continue
        rows = gather_rows(grad_out, token_of_row_R[r0:r1], gathered[: r1 - r0])
        wide = widened[: r1 - r0].copy_(rows).mul_(prob_of_row_R1[r0:r1])
        grad_RH[r0:r1].copy_(wide)
    return grad_RH


def _grad_probs(
    grad_out_TH: torch.Tensor, expert_out_RH: torch.Tensor, row_id_map_R: torch.Tensor, probs_Tk: torch.Tensor
) -> torch.Tensor:
    """``d probs[t, j] = <grad_out[t], expert_out[row_id_map[t*k+j]]>``, reduced over H in float32."""
    num_tokens, top_k = probs_Tk.shape
    hidden = expert_out_RH.shape[1]
    acc = _acc_dtype(expert_out_RH.dtype)
    grad_out_TH1 = grad_out_TH.to(acc).unsqueeze(-1)
    grad_probs_Tk1 = torch.empty(num_tokens, top_k, 1, dtype=acc, device=expert_out_RH.device)
    step = min(_token_step(top_k, hidden, acc), max(num_tokens, 1))
    gathered = torch.empty(step * top_k, hidden, dtype=expert_out_RH.dtype, device=expert_out_RH.device)
    widened = (
        None if expert_out_RH.dtype == acc else torch.empty(step, top_k, hidden, dtype=acc, device=gathered.device)
    )
    for t0 in range(0, num_tokens, step):
        t1 = min(num_tokens, t0 + step)
        n = t1 - t0
        rows = gather_rows(expert_out_RH, row_id_map_R[t0 * top_k : t1 * top_k], gathered[: n * top_k])
        wide = rows.view(n, top_k, hidden) if widened is None else widened[:n].copy_(rows.view(n, top_k, hidden))
        torch.bmm(wide, grad_out_TH1[t0:t1], out=grad_probs_Tk1[t0:t1])
    return grad_probs_Tk1.squeeze(-1).to(probs_Tk.dtype)


torch.library.register_autograd("moe_gmm::unpermute", _unpermute_backward, setup_context=_unpermute_setup_context)


class _Unpermute(torch.autograd.Function):
    """``moe_gmm::unpermute``'s direct path (:mod:`moe_gmm.ops.eager_path`): its body and backward."""

    @staticmethod
    def forward(ctx, expert_out_RH, row_id_map_R, probs_Tk, validate: bool):
        out = _unpermute_body(expert_out_RH, row_id_map_R, probs_Tk, validate)
        _unpermute_setup_context(ctx, (expert_out_RH, row_id_map_R, probs_Tk, validate), out)
        return out

    backward = staticmethod(_unpermute_backward)


def _run_unpermute(expert_out_RH, row_id_map_R, probs_Tk, validate: bool) -> torch.Tensor:
    if not direct(expert_out_RH, row_id_map_R, probs_Tk):
        return _unpermute_op(expert_out_RH, row_id_map_R, probs_Tk, validate)
    if torch.is_grad_enabled() and (expert_out_RH.requires_grad or probs_Tk.requires_grad):
        return _Unpermute.apply(expert_out_RH, row_id_map_R, probs_Tk, validate)
    return _unpermute_body(expert_out_RH, row_id_map_R, probs_Tk, validate)


# --------------------------------------------------------------------------------------------
# The public boundary.
# --------------------------------------------------------------------------------------------


def permute(
    hidden_TH: torch.Tensor,
    selected_experts_Tk: torch.Tensor,
    num_experts: int,
    *,
    validate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy each token once per selected expert, grouping the copies by expert.

    Args:
        hidden_TH: ``[T, H]`` floating tensor.
        selected_experts_Tk: ``[T, k]`` int32/int64 expert ids in ``[0, num_experts)``; duplicates
            within one token's top-k are legal (the token then gets two rows in that expert).
        num_experts: E, the number of experts (the length of ``tokens_per_expert``).
        validate: check that every id lies in ``[0, E)`` (``ValueError``). This reads the ids on
            the host (a sync on an accelerator); skipped under ``torch.compile``. ``False`` means
            "you promise every id is in range": callers whose ids come from a top-k over E experts
            may pass it. On CPU an id out of range is still refused (``ValueError``).

    Returns:
        ``permuted_RH`` ``[T*k, H]`` (rows grouped by expert ascending, stable in (token, slot)
        order), ``row_id_map_R`` ``[T*k]`` int64 (``row_id_map[t*k + j]`` = row of token t's
        slot-j copy) and ``tokens_per_expert_E`` ``[E]`` int64 on hidden's device (the
        ``group_list`` for :func:`~moe_gmm.grouped_matmul`). Differentiable in ``hidden_TH``.
    """
    check_float("hidden_TH", hidden_TH, 2, "[T, H]")
    check_index("selected_experts_Tk", selected_experts_Tk, 2, "[T, k]")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int):
        raise TypeError(f"num_experts must be a positive int, got {type(num_experts).__name__} {num_experts!r}")
    if not 1 <= num_experts <= MAX_NUM_EXPERTS:
        raise ValueError(f"num_experts must be an int in [1, {MAX_NUM_EXPERTS}], got {num_experts!r}")
    check_flag("validate", validate)
    if selected_experts_Tk.shape[0] != hidden_TH.shape[0]:
        raise ValueError(
            f"selected_experts_Tk.shape[0] must equal hidden_TH.shape[0] (T): got {tuple(selected_experts_Tk.shape)} "
            f"and {tuple(hidden_TH.shape)}"
        )
    if selected_experts_Tk.shape[1] < 1:
        raise ValueError(f"selected_experts_Tk must have k >= 1 columns, got shape {tuple(selected_experts_Tk.shape)}")
    if selected_experts_Tk.device != hidden_TH.device:
        raise ValueError(
            f"selected_experts_Tk must be on hidden_TH's device {hidden_TH.device}, got {selected_experts_Tk.device}"
        )
    if validate and not torch.compiler.is_compiling() and selected_experts_Tk.numel() > 0:
        check_expert_ids(selected_experts_Tk, num_experts)
    return _run_permute(hidden_TH, selected_experts_Tk, num_experts)


def unpermute(
    expert_out_RH: torch.Tensor,
    row_id_map_R: torch.Tensor,
    probs_Tk: torch.Tensor,
    *,
    top_k: int | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Combine expert outputs back into tokens: ``out[t] = sum_j probs[t, j] * expert_out[row_id_map[t*k + j]]``.

    Args:
        expert_out_RH: ``[T*k, H]`` floating tensor, rows in :func:`permute` order.
        row_id_map_R: ``[T*k]`` int64 map returned by :func:`permute`.
        probs_Tk: ``[T, k]`` floating routing weights (any float dtype; float32 is typical).
        top_k: k, when known: ``probs_Tk`` must then have exactly k columns. Without it a
            transposed ``[k, T]`` ``probs_Tk`` (same number of elements) cannot be told apart.
        validate: check that ``row_id_map_R`` is a permutation of ``range(T*k)`` (``ValueError``).
            On an accelerator this reads the map on the host (a sync), except under
            ``torch.compile``; the custom op checks again when it runs, compiled or not: a
            ``ValueError`` on CPU, an asynchronous device-side assert on CUDA (no host sync).
            ``False`` means "you promise the map is permute's": callers that
            pass permute's own map may use it. A value outside ``[0, T*k)`` is then still
            refused, by the CPU kernels (``ValueError``) or by ``index_select`` on the torch path
            (``IndexError``); a repeated value is not detected (rows of the result are then wrong).

    Returns:
        ``[T, H]`` in ``expert_out_RH.dtype``; the k-way sum accumulates in float32 (float64 for
        float64) in a fixed order, so it is deterministic. Differentiable in ``expert_out_RH``
        and ``probs_Tk``.
    """
    check_float("expert_out_RH", expert_out_RH, 2, "[T*k, H]")
    check_float("probs_Tk", probs_Tk, 2, "[T, k]")
    check_index("row_id_map_R", row_id_map_R, 1, "[T*k]")
    check_flag("validate", validate)
    if row_id_map_R.dtype != torch.int64:
        raise TypeError(f"row_id_map_R must be int64 (as returned by permute), got {dtype_name(row_id_map_R.dtype)}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int):
            raise TypeError(f"top_k must be an int or None, got {type(top_k).__name__} {top_k!r}")
        if probs_Tk.shape[1] != top_k:
            raise ValueError(f"probs_Tk must be [T, k] with k = top_k = {top_k}, got shape {tuple(probs_Tk.shape)}")
    num_rows = probs_Tk.shape[0] * probs_Tk.shape[1]
    if row_id_map_R.shape[0] != num_rows or expert_out_RH.shape[0] != num_rows:
        raise ValueError(
            f"expert_out_RH.shape[0] and row_id_map_R.shape[0] must equal probs_Tk T*k = {num_rows}: "
            f"got expert_out_RH {tuple(expert_out_RH.shape)}, row_id_map_R {tuple(row_id_map_R.shape)}, "
            f"probs_Tk {tuple(probs_Tk.shape)}"
        )
    if probs_Tk.shape[1] < 1:
        raise ValueError(f"probs_Tk must have k >= 1 columns, got shape {tuple(probs_Tk.shape)}")
    for name, t in (("row_id_map_R", row_id_map_R), ("probs_Tk", probs_Tk)):
        if t.device != expert_out_RH.device:
            raise ValueError(f"{name} must be on expert_out_RH's device {expert_out_RH.device}, got {t.device}")
    if validate and row_id_map_R.device.type != "cpu" and not torch.compiler.is_compiling() and num_rows > 0:
        check_row_id_map(row_id_map_R, num_rows)  # a ValueError in eager; on CPU the op makes this check
    return _run_unpermute(expert_out_RH, row_id_map_R, probs_Tk, validate)
