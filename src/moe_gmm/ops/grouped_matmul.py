"""``grouped_matmul``: the operator contract.

Legend: M rows (tokens after permute, grouped by expert), K input features, N output features,
E experts. ``group_ends_E`` holds inclusive cumulative row ends: expert e owns rows
``[group_ends_E[e-1], group_ends_E[e])`` (with ``group_ends_E[-1] == 0``), so an expert with zero
rows owns an empty range and does not shift later ones.

This module checks arguments, normalises ``group_list`` into ``group_ends_E`` on the input's device,
picks a backend from the registry and runs three ``torch.library`` custom ops (forward,
grad_input, grad_weight) whose autograd is registered here, so ``torch.compile(fullgraph=True)``
traces callers without looking inside a backend.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from moe_gmm.ops.backends import get_backend, select_backend
from moe_gmm.ops.backends.base import cached_bounds, remember_bounds
from moe_gmm.ops.eager_path import direct

__all__ = ["GroupListType", "GroupRows", "group_rows", "grouped_matmul", "grouped_matmul_rows", "normalize_group_list"]

GroupListType = Literal["count", "cumsum"]
_GROUP_LIST_TYPES = ("count", "cumsum")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_INDEX_DTYPES = (torch.int32, torch.int64)


# --------------------------------------------------------------------------------------------
# Custom ops: what the compiler sees. Each takes the backend name so one op serves every backend.
# --------------------------------------------------------------------------------------------


def _forward_body(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    # Checked here, not only at the boundary: under torch.compile only the op's body runs.
    _check_row_ends(group_ends, num_rows=x.shape[0])
    return get_backend(backend).run_forward(x, weight, group_ends)


def _grad_input_body(grad_out: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    _check_row_ends(group_ends, num_rows=grad_out.shape[0])
    return get_backend(backend).run_grad_input(grad_out, weight, group_ends)


def _grad_weight_body(x: torch.Tensor, grad_out: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    _check_row_ends(group_ends, num_rows=x.shape[0])
    return get_backend(backend).run_grad_weight(x, grad_out, group_ends)


@torch.library.custom_op("moe_gmm::grouped_matmul", mutates_args=())
def _grouped_matmul_op(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    return _forward_body(x, weight, group_ends, backend)


@_grouped_matmul_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[2])


@torch.library.custom_op("moe_gmm::grouped_matmul_grad_input", mutates_args=())
def _grad_input_op(grad_out: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    return _grad_input_body(grad_out, weight, group_ends, backend)


@_grad_input_op.register_fake
def _(grad_out: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    return grad_out.new_empty(grad_out.shape[0], weight.shape[1])


@torch.library.custom_op("moe_gmm::grouped_matmul_grad_weight", mutates_args=())
def _grad_weight_op(x: torch.Tensor, grad_out: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    return _grad_weight_body(x, grad_out, group_ends, backend)


@_grad_weight_op.register_fake
def _(x: torch.Tensor, grad_out: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    return x.new_empty(group_ends.shape[0], x.shape[1], grad_out.shape[1])


def _grad_weight_transposed(weight: torch.Tensor) -> bool:
    """Whether the weight gradient should be laid out ``[E, N, K]``-contiguous (returned as its
    ``[E, K, N]`` transpose) rather than ``[E, K, N]``-contiguous.

    Autograd keeps a gradient as it comes only when it is laid out like the parameter: dense with
    the parameter's strides, or contiguous for a parameter that is not dense (padded rows).
    Anything else is copied at accumulation and slows the optimizer's element-wise passes. So a
    dense weight gets its own strides (what ``torch.mm``'s backward does for a transposed
    ``mat2``); a weight with padded rows gets the contiguous order of the parameter behind it:
    itself, or the parameter it is a transposed view of.
    """
    if not _is_dense(weight):
        base = weight._base
        return (
            base is not None
            and base.dim() == 3
            and weight.shape == base.mT.shape
            and weight.stride() == base.mT.stride()
        )
    return weight.shape[1] > 1 and weight.stride(1) == 1  # column-major within each expert


def _is_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once (any dimension order)."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _setup_context(ctx, inputs, output) -> None:
    x, weight, group_ends, backend = inputs
    ctx.backend = backend
    ctx.grad_weight_transposed = weight.requires_grad and _grad_weight_transposed(weight)
    ctx.save_for_backward(
        x if weight.requires_grad else None,
        weight if x.requires_grad else None,
        group_ends,
    )


def _backward(ctx, grad_out: torch.Tensor):
    x, weight, group_ends = ctx.saved_tensors
    # A graph-building backward (create_graph=True) or an observed one goes through the ops.
    body = not torch.is_grad_enabled() and direct(grad_out)
    grad_input = _grad_input_body if body else _grad_input_op
    grad_weight = _grad_weight_body if body else _grad_weight_op
    grad_x = grad_w = None
    if ctx.needs_input_grad[0]:
        grad_x = grad_input(grad_out, weight, group_ends, ctx.backend)
    if ctx.needs_input_grad[1]:
        if ctx.grad_weight_transposed:
            # dY_e^T X_e is (X_e^T dY_e)^T: the same kernel with the operands swapped writes the
            # [E, N, K] gradient directly, no transpose copy anywhere.
            grad_w = grad_weight(grad_out.contiguous(), x, group_ends, ctx.backend).mT
        else:
            grad_w = grad_weight(x, grad_out, group_ends, ctx.backend)
    return grad_x, grad_w, None, None


torch.library.register_autograd("moe_gmm::grouped_matmul", _backward, setup_context=_setup_context)


class _GroupedMatmul(torch.autograd.Function):
    """The op's direct path (:mod:`moe_gmm.ops.eager_path`): its body with its own backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
        out = _forward_body(x, weight, group_ends, backend)
        _setup_context(ctx, (x, weight, group_ends, backend), out)
        return out

    backward = staticmethod(_backward)


def run_grouped_matmul(x: torch.Tensor, weight: torch.Tensor, group_ends: torch.Tensor, backend: str) -> torch.Tensor:
    """``moe_gmm::grouped_matmul`` on checked operands, or its body directly where nothing observes the
    dispatcher (:func:`~moe_gmm.ops.eager_path.direct`): the same kernels and checks either way."""
    if not direct(x, weight):
        return _grouped_matmul_op(x, weight, group_ends, backend)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _GroupedMatmul.apply(x, weight, group_ends, backend)
    return _forward_body(x, weight, group_ends, backend)


# --------------------------------------------------------------------------------------------
# The public boundary.
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def normalize_group_list(
    group_list: torch.Tensor | Sequence[int],
    *,
    num_experts: int,
    num_rows: int,
    group_list_type: GroupListType = "count",
    device: torch.device | str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """``group_list`` (counts or inclusive cumsum) as int64 inclusive row ends on ``device``.

    Raises ``TypeError`` for a non-integer group list and ``ValueError`` for a wrong length,
    a count outside ``[0, num_rows]``, a cumsum value outside ``[0, num_rows]`` or decreasing, or a
    total other than ``num_rows``. Each value is checked before anything is summed, so int64
    overflow cannot make a wrong list pass.

    ``validate=False`` means "you promise the values are right": the detailed check (a host sync
    for an accelerator tensor) is skipped. The row ends are still checked (first >= 0,
    non-decreasing, last == num_rows) so that no backend reads or leaves rows outside
    ``[0, num_rows)``: on CPU as a ``ValueError``, on CUDA as an asynchronous device-side assert
    (no host sync); not on other devices (whose support of that assert is unknown) and not under
    ``torch.compile`` (the grouped-matmul custom ops check them again when they run).
    """
    group_ends = _group_ends(
        group_list, num_experts=num_experts, num_rows=num_rows, group_list_type=group_list_type,
        device=device, validate=validate,
    )  # fmt: skip
    if not validate and not torch.compiler.is_compiling():
        _check_row_ends(group_ends, num_rows=num_rows)
    return group_ends


def _group_ends(
    group_list: torch.Tensor | Sequence[int],
    *,
    num_experts: int,
    num_rows: int,
    group_list_type: GroupListType,
    device: torch.device | str | None,
    validate: bool,
) -> torch.Tensor:
    """:func:`normalize_group_list` without the final row-ends check (the custom ops make it)."""
    if group_list_type not in _GROUP_LIST_TYPES:
        raise ValueError(f"group_list_type must be one of {_GROUP_LIST_TYPES}, got {group_list_type!r}")
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__} {validate!r}")
    if isinstance(group_list, torch.Tensor):
        if group_list.dtype not in _INDEX_DTYPES:
            raise TypeError(f"group_list must be an int32 or int64 tensor, got dtype {_dtype_name(group_list.dtype)}")
        if group_list.dim() != 1:
            raise ValueError(f"group_list must be 1-D, got shape {tuple(group_list.shape)}")
        if group_list.device.type not in ("cpu", torch.device(device or "cpu").type):
            raise ValueError(f"group_list must be on the CPU or on x's device {device}, got {group_list.device}")
        values = group_list
    elif isinstance(group_list, Sequence) and not isinstance(group_list, (str, bytes)):
        for i, v in enumerate(group_list):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"group_list[{i}] must be an int, got {type(v).__name__} {v!r}")
            if not _INT64_MIN <= v <= _INT64_MAX:
                raise ValueError(f"group_list[{i}] must lie in [0, x.shape[0] = {num_rows}], got {v}")
        values = torch.tensor(list(group_list), dtype=torch.int64)
    else:
        raise TypeError(f"group_list must be a 1-D integer tensor or a sequence of ints, got {type(group_list).__name__}")
    if values.shape[0] != num_experts:
        raise ValueError(
            f"group_list must have one entry per expert: expected length {num_experts} "
            f"(weight.shape[0]), got {values.shape[0]}"
        )
    if validate and not torch.compiler.is_compiling():
        _check_group_values(values, num_rows=num_rows, group_list_type=group_list_type)
    values = values.to(device=device, dtype=torch.int64, non_blocking=True)
    return torch.cumsum(values, 0) if group_list_type == "count" else values


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _check_group_values(values: torch.Tensor, *, num_rows: int, group_list_type: str) -> None:
    # Host sync when group_list lives on an accelerator: the values are needed to validate them.
    host = values.detach().to("cpu", torch.int64)
    if host.numel() == 0:
        total = 0
    elif group_list_type == "count":
        # Each count in [0, M] before summing: counts near 2**62 would wrap the int64 sum to M.
        outside = (host < 0) | (host > num_rows)
        if bool(outside.any()):
            bad = int(torch.nonzero(outside)[0, 0])
            raise ValueError(
                f"group_list counts must lie in [0, x.shape[0] = {num_rows}], got group_list[{bad}] = {int(host[bad])}"
            )
        total = sum(host.tolist())  # Python ints: exact whatever E * M is
    else:
        if int(host[0]) < 0:
            raise ValueError(f"group_list cumsum must start >= 0, got group_list[0] = {int(host[0])}")
        steps_down = host[1:] < host[:-1]
        if bool(steps_down.any()):
            bad = int(torch.nonzero(steps_down)[0, 0]) + 1
            raise ValueError(
                f"group_list cumsum must be non-decreasing, got group_list[{bad - 1}] = {int(host[bad - 1])} "
                f"> group_list[{bad}] = {int(host[bad])}"
            )
        total = int(host[-1])
    if total != num_rows:
        what = "sum(group_list)" if group_list_type == "count" else "group_list[-1]"
        raise ValueError(f"{what} must equal x.shape[0] = {num_rows}, got {total}")


def _is_dtensor(t: torch.Tensor) -> bool:
    # A DTensor exists only once torch.distributed.tensor is loaded; no import on the hot path.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _check_row_ends(group_ends: torch.Tensor, *, num_rows: int) -> None:
    """Refuse row ends that do not tile ``[0, num_rows)``, without a host sync on an accelerator.

    Every backend relies on them: ends that stop short leave rows unwritten (uninitialised, often
    NaN), ends past ``num_rows`` cut the last expert short or read past ``x``. Non-decreasing ends
    from >= 0 to ``num_rows`` are exactly counts in ``[0, num_rows]`` summing to ``num_rows``, and
    they also rule out counts that wrapped the int64 cumsum. CPU: a ``ValueError``; CUDA: an
    asynchronous device-side assert; other devices: unchecked (their support of that assert is
    unknown), the boundary's host check stands alone there.
    """
    if group_ends.device.type == "cpu":
        bounds = cached_bounds(group_ends)
        if bounds is not None and bounds[-1] == num_rows:
            return  # checked when first read: by the layer's normalisation or an earlier matmul
        ends = group_ends.tolist()  # a list of E ints: cheaper than tensor ops
        _raise_unless_tiled(ends, num_rows)
        remember_bounds(group_ends, [0, *ends])  # only tiled ends are remembered
    elif group_ends.device.type == "cuda" and group_ends.numel() > 0:
        ok = (group_ends[0] >= 0) & (group_ends[-1] == num_rows) & (group_ends[1:] >= group_ends[:-1]).all()
        torch._assert_async(ok, "group_list must be counts >= 0 summing to x.shape[0] (row ends rising to it)")


def _raise_unless_tiled(ends: list[int], num_rows: int) -> None:
    """The CPU check: one C-speed comparison when the ends are right, a walk to name the problem when not."""
    if (ends[0] >= 0 and ends[-1] == num_rows and ends == sorted(ends)) if ends else num_rows == 0:
        return
    previous = 0
    for e, end in enumerate(ends):
        if end < previous:
            problem = f"group {e} ends at row {end}, before row {previous}"
            break
        previous = end
    else:
        if previous == num_rows:
            return
        problem = f"the last group ends at row {previous}"
    shown = f"{ends[:8]}{' ...' if len(ends) > 8 else ''}"
    raise ValueError(
        f"group_list must be counts >= 0 summing to x.shape[0] = {num_rows} (as inclusive row ends: "
        f"non-decreasing from 0 to {num_rows}); its row ends are {shown}: {problem}"
    )


def _check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    for name, t in (("x", x), ("weight", weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if _is_dtensor(t):
            raise TypeError(
                f"{name} must be a plain torch.Tensor (this rank's data), got a DTensor with placements "
                f"{tuple(t.placements)} and global shape {tuple(t.shape)}: call .to_local() on it first, or "
                "shard the experts with moe_gmm.parallel.parallelize_moe, whose forward does"
            )
        if t.dtype not in _FLOAT_DTYPES:
            supported = [_dtype_name(d) for d in _FLOAT_DTYPES]
            raise TypeError(f"{name} must have a floating dtype in {supported}, got {_dtype_name(t.dtype)}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if weight.dim() != 3:
        raise ValueError(f"weight must be 3-D [E, K, N], got shape {tuple(weight.shape)}")
    if x.dtype != weight.dtype:
        raise TypeError(f"x and weight must share a dtype, got x {_dtype_name(x.dtype)} and weight {_dtype_name(weight.dtype)}")
    if x.device != weight.device:
        raise ValueError(f"x and weight must be on one device, got x on {x.device} and weight on {weight.device}")
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x.shape[1] (K) must equal weight.shape[1]: got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError(f"weight must hold at least one expert, got shape {tuple(weight.shape)}")


@dataclass(frozen=True)
class GroupRows:
    """``group_list`` normalised once for a layer: every matmul of the layer reads this one value.

    ``ends`` are int64 inclusive row ends on the rows' device (what the ops and kernels take);
    ``bounds`` ``(0, end_0, ..., end_{E-1})`` are the same ends as host ints where reading them
    costs no sync (CPU), else None. The ends are checked to tile ``[0, num_rows)`` when made, and
    the ops find them checked (the bounds travel with the ends tensor).
    """

    ends: torch.Tensor
    bounds: tuple[int, ...] | None
    num_rows: int

    @property
    def num_experts(self) -> int:
        return self.ends.shape[0]


def group_rows(
    group_list: torch.Tensor | Sequence[int],
    *,
    num_experts: int,
    num_rows: int,
    device: torch.device,
    group_list_type: GroupListType = "count",
    validate: bool = True,
) -> GroupRows:
    """:func:`normalize_group_list` as a :class:`GroupRows`, for callers that run several matmuls on
    the same rows; raises the same errors."""
    ends = _group_ends(
        group_list, num_experts=num_experts, num_rows=num_rows, group_list_type=group_list_type,
        device=device, validate=validate,
    )  # fmt: skip
    bounds = None
    if not torch.compiler.is_compiling():
        _check_row_ends(ends, num_rows=num_rows)  # on CPU this reads and remembers the bounds
        cached = cached_bounds(ends) if ends.device.type == "cpu" else None
        bounds = None if cached is None else tuple(cached)
    return GroupRows(ends=ends, bounds=bounds, num_rows=num_rows)


def check_operands(x: torch.Tensor, weight: torch.Tensor) -> None:
    """The boundary's operand checks (types, ranks, dtype, device, K): what :func:`grouped_matmul` raises."""
    _check_operands(x, weight)


def grouped_matmul_rows(x: torch.Tensor, weight: torch.Tensor, rows: GroupRows, backend: str) -> torch.Tensor:
    """One matmul of a layer whose rows were normalised (:func:`group_rows`) and whose backend was chosen
    (``select_backend``) once: only the shapes that differ between the layer's matmuls are checked."""
    if x.shape[0] != rows.num_rows or weight.shape[0] != rows.num_experts:
        raise ValueError(
            f"x {tuple(x.shape)} and weight {tuple(weight.shape)} must have {rows.num_rows} rows and "
            f"{rows.num_experts} experts (the layer's group_list)"
        )
    if x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"x.shape[1] (K) must equal weight.shape[1]: got x {tuple(x.shape)} and weight {tuple(weight.shape)}"
        )
    return run_grouped_matmul(x, weight, rows.ends, backend)


def grouped_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_list: torch.Tensor | Sequence[int],
    fused: bool = True,
    *,
    group_list_type: GroupListType = "count",
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Multiply each expert's block of rows by that expert's weight: ``y[rows_e] = x[rows_e] @ weight[e]``.

    Args:
        x: ``[M, K]``, rows grouped contiguously by expert.
        weight: ``[E, K, N]`` with any strides; a transposed view of an ``[E, N, K]`` parameter
            is read in place, never copied per call.
        group_list: length-E int32/int64 tensor (any device) or sequence of ints.
        fused: ``False`` runs the eager per-expert loop (the reference); ``True`` the best backend
            for the device and dtype.
        group_list_type: ``"count"`` (rows per expert) or ``"cumsum"`` (inclusive row ends).
        backend: force ``"eager"``, ``"torch"``, ``"triton"``, ``"npu"`` or a registered name;
            ``"auto"`` or None picks (``$MOE_GMM_BACKEND`` is consulted when None).
        validate: check group_list values (each count or cumsum value in ``[0, M]``, monotone,
            total == M), naming the offending entry. This reads the values on the host, a sync
            when group_list lives on an accelerator. ``False`` means "you promise the values are
            right". Either way, compiled or not, the custom ops refuse row ends that do not tile
            ``[0, M)`` when they run: a ``ValueError`` on CPU, a device-side assert on CUDA (no
            host sync).

    Returns:
        ``[M, N]`` in the input dtype; products accumulate in float32 (float64 for float64).
    """
    _check_operands(x, weight)
    backend = requested_backend(fused, backend)
    group_ends = _group_ends(  # the row ends are checked inside the custom ops, compiled or not
        group_list,
        num_experts=weight.shape[0],
        num_rows=x.shape[0],
        group_list_type=group_list_type,
        device=x.device,
        validate=validate,
    )
    chosen = select_backend(x, weight, backend)
    return run_grouped_matmul(x, weight, group_ends, chosen.name)


def requested_backend(fused: bool, backend: str | None) -> str | None:
    """The backend a call asks for: ``"eager"`` when ``fused`` is False (which ``backend`` may not
    contradict), else ``backend`` (None: auto)."""
    if not isinstance(fused, bool):
        raise TypeError(f"fused must be a bool, got {type(fused).__name__}")
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__} {backend!r}")
    if fused:
        return backend
    if backend not in (None, "eager"):
        raise ValueError(f"fused=False runs the eager reference; it conflicts with backend={backend!r}")
    return "eager"
