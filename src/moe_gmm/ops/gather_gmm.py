"""The routed-experts MLP with permute and unpermute fused into the grouped matmuls (ScatterMoE-style).

Legend: T tokens, k top-k slots, H hidden, I expert intermediate, E experts, R = T*k rows grouped
by expert; K / N the reduction / output dims of one GEMM. ``slot_of_row_R[r]`` is the flat
(token, slot) index ``t*k + j`` whose copy is grouped row r (the inverse of ``permute``'s
``row_id_map``); ``token_of_row_R = slot_of_row_R // k``.

The unfused path materialises ``permute(hidden)`` (``[R, H]``) and hands ``[R, H]`` expert outputs
to ``unpermute``. Here:
- ``gather_grouped_matmul``: the first GEMM loads its rows straight from ``hidden[token_of_row[r]]``
  (the permuted copy of the activations never exists); its backward scatters ``dX`` rows to
  ``[T, k, K]`` slots and sums over k (a fixed-order reduction, no atomics).
- ``grouped_matmul_scatter``: the second GEMM's epilogue stores row r at slot ``slot_of_row[r]`` of a
  ``[T, k, N]`` buffer, which is weighted by the routing probabilities and summed over k in float32
  (the buffer is kept for the probabilities' gradient, as ScatterMoE keeps it); its backward
  gathers ``grad_out`` rows by token and scales them by their probability inside the kernels.

The kernels are the triton backend's (``launch_gmm`` / ``launch_gmm_wgrad`` with index operands), so
this op runs where the triton backend runs: CUDA, or CPU under ``TRITON_INTERPRET=1``. Both ops
are ``torch.library`` custom ops with fake and autograd registrations.
"""

from __future__ import annotations

import torch

from moe_gmm.ops.backends import get_backend
from moe_gmm.ops.backends.triton import launch_gmm, launch_gmm_wgrad
from moe_gmm.ops.swiglu import swiglu

__all__ = ["gather_grouped_matmul", "grouped_matmul_scatter", "moe_mlp_gather_scatter", "routing_rows"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# The index-driven kernels as custom ops, so backward formulas stay traceable (fake tensors never
# reach a kernel launch).
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_gmm::indexed_gmm", mutates_args=())
def _indexed_gmm(
    x: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor, x_rows: torch.Tensor | None,
    out_rows: torch.Tensor | None, row_scale: torch.Tensor | None, num_out_rows: int,
) -> torch.Tensor:  # fmt: skip
    """``out[out_rows[r]] = row_scale[r] * x[x_rows[r]] @ w[e(r)]``; every out row must be named."""
    out = x.new_empty(num_out_rows, w_EKN.shape[2])
    return launch_gmm(x, w_EKN, group_ends_E, out, x_rows=x_rows, out_rows=out_rows, row_scale=row_scale)


@_indexed_gmm.register_fake
def _(x, w_EKN, group_ends_E, x_rows, out_rows, row_scale, num_out_rows):
    return x.new_empty(num_out_rows, w_EKN.shape[2])


@torch.library.custom_op("moe_gmm::indexed_gmm_wgrad", mutates_args=())
def _indexed_wgrad(
    x: torch.Tensor, dy: torch.Tensor, group_ends_E: torch.Tensor, x_rows: torch.Tensor | None,
    dy_rows: torch.Tensor | None, dy_scale: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """``dw[e] = sum_{r in e} x[x_rows[r]]^T (dy_scale[r] * dy[dy_rows[r]])``, zeros for empty experts."""
    return launch_gmm_wgrad(x, dy, group_ends_E, x_rows=x_rows, dy_rows=dy_rows, dy_scale=dy_scale)


@_indexed_wgrad.register_fake
def _(x, dy, group_ends_E, x_rows, dy_rows, dy_scale):
    return x.new_empty(group_ends_E.shape[0], x.shape[1], dy.shape[1])


# --------------------------------------------------------------------------------------------
# gather: y[r] = x[token_of_row[r]] @ w[e(r)]
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_gmm::gather_grouped_matmul", mutates_args=())
def _gather_op(
    x_TK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor, token_of_row_R: torch.Tensor,
    slot_of_row_R: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    y_RN = x_TK.new_empty(token_of_row_R.shape[0], w_EKN.shape[2])
    return launch_gmm(x_TK, w_EKN, group_ends_E, y_RN, x_rows=token_of_row_R)


@_gather_op.register_fake
def _(x_TK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R):
    return x_TK.new_empty(token_of_row_R.shape[0], w_EKN.shape[2])


def _gather_setup(ctx, inputs, output) -> None:
    x_TK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R = inputs
    ctx.save_for_backward(x_TK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R)


def _gather_backward(ctx, dy_RN):
    x_TK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        num_tokens, k_dim = x_TK.shape
        num_rows = slot_of_row_R.shape[0]
        top_k = num_rows // num_tokens if num_tokens else 0
        # Each grouped row's dX goes to its own slot (unique): then a fixed-order sum over k.
        dx_slots = _indexed_gmm(dy_RN, w_EKN.transpose(1, 2), group_ends_E, None, slot_of_row_R, None, num_rows)
        dx = dx_slots.view(num_tokens, top_k, k_dim).to(_acc(x_TK.dtype)).sum(1).to(x_TK.dtype)
    if ctx.needs_input_grad[1]:
        dw = _indexed_wgrad(x_TK, dy_RN, group_ends_E, token_of_row_R, None, None)
    return dx, dw, None, None, None


torch.library.register_autograd("moe_gmm::gather_grouped_matmul", _gather_backward, setup_context=_gather_setup)


# --------------------------------------------------------------------------------------------
# scatter: out[t] = sum_j probs[t, j] * (a[row(t, j)] @ w[e])
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("moe_gmm::grouped_matmul_scatter", mutates_args=())
def _scatter_op(
    a_RK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor, token_of_row_R: torch.Tensor,
    slot_of_row_R: torch.Tensor, probs_Tk: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    num_tokens, top_k = probs_Tk.shape
    n = w_EKN.shape[2]
    z_slots = a_RK.new_empty(num_tokens * top_k, n)
    launch_gmm(a_RK, w_EKN, group_ends_E, z_slots, out_rows=slot_of_row_R)
    z_TkN = z_slots.view(num_tokens, top_k, n)
    acc = _acc(a_RK.dtype)
    out_TN = (z_TkN.to(acc) * probs_Tk.to(acc).unsqueeze(-1)).sum(1).to(a_RK.dtype)
    return out_TN, z_TkN


@_scatter_op.register_fake
def _(a_RK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R, probs_Tk):
    num_tokens, top_k = probs_Tk.shape
    n = w_EKN.shape[2]
    return a_RK.new_empty(num_tokens, n), a_RK.new_empty(num_tokens, top_k, n)


def _scatter_setup(ctx, inputs, output) -> None:
    a_RK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R, probs_Tk = inputs
    ctx.save_for_backward(a_RK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R, probs_Tk, output[1])
    ctx.set_materialize_grads(False)


def _scatter_backward(ctx, dout_TN, _dz):
    a_RK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R, probs_Tk, z_TkN = ctx.saved_tensors
    if dout_TN is None:
        return None, None, None, None, None, None
    # Row r's output gradient is probs[slot(r)] * dout[token(r)]: gathered and scaled in-kernel.
    prob_of_row_R = probs_Tk.reshape(-1).index_select(0, slot_of_row_R).to(torch.float32)
    da = dw = dprobs = None
    if ctx.needs_input_grad[0]:
        da = _indexed_gmm(
            dout_TN, w_EKN.transpose(1, 2), group_ends_E, token_of_row_R, None, prob_of_row_R, a_RK.shape[0]
        )
    if ctx.needs_input_grad[1]:
        dw = _indexed_wgrad(a_RK, dout_TN, group_ends_E, None, token_of_row_R, prob_of_row_R)
    if ctx.needs_input_grad[5]:
        acc = _acc(a_RK.dtype)
        dprobs = (z_TkN.to(acc) * dout_TN.to(acc).unsqueeze(1)).sum(-1).to(probs_Tk.dtype)
    return da, dw, None, None, None, dprobs


torch.library.register_autograd("moe_gmm::grouped_matmul_scatter", _scatter_backward, setup_context=_scatter_setup)


# --------------------------------------------------------------------------------------------
# The public boundary
# --------------------------------------------------------------------------------------------


def routing_rows(
    selected_experts_Tk: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(slot_of_row_R, token_of_row_R, group_ends_E)`` for ``selected_experts_Tk`` ``[T, k]``.

    Rows are grouped by expert ascending, stable in (token, slot) order: the same grouping as
    :func:`~moe_gmm.ops.permute` (``slot_of_row`` is the inverse of its ``row_id_map``). On the
    device, no host sync.
    """
    top_k = selected_experts_Tk.shape[1]
    flat_ids_R = selected_experts_Tk.reshape(-1).to(torch.int64)
    sorted_ids_R, slot_of_row_R = torch.sort(flat_ids_R, stable=True)
    token_of_row_R = torch.div(slot_of_row_R, max(top_k, 1), rounding_mode="floor")
    # Group ends by binary search in the sorted ids: a static [E] shape (torch.compile traces it,
    # unlike bincount's data-dependent length) and no atomics.
    experts_E = torch.arange(num_experts, device=flat_ids_R.device, dtype=torch.int64)
    group_ends_E = torch.searchsorted(sorted_ids_R, experts_E, right=True)
    return slot_of_row_R, token_of_row_R, group_ends_E


def _require_triton(x: torch.Tensor, w: torch.Tensor) -> None:
    if torch.compiler.is_compiling():  # checked when the eager call ran; not traceable (imports, env)
        return
    reason = get_backend("triton").refusal(x, w)
    if reason is not None:
        raise ValueError(
            f"the gather/scatter MoE kernels run on the triton backend, which refuses these inputs: {reason}"
        )


def gather_grouped_matmul(
    x_TK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor, token_of_row_R: torch.Tensor,
    slot_of_row_R: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``y[r] = x[token_of_row[r]] @ w[e(r)]`` as ``[R, N]``, rows grouped by ``group_ends_E``.

    Equivalent to ``grouped_matmul(x[token_of_row], w, ends)`` without the gathered copy. The index
    tensors come from :func:`routing_rows`; differentiable in ``x_TK`` and ``w_EKN``.
    """
    _require_triton(x_TK, w_EKN)
    return _gather_op(x_TK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R)


def grouped_matmul_scatter(
    a_RK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor, token_of_row_R: torch.Tensor,
    slot_of_row_R: torch.Tensor, probs_Tk: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``out[t] = sum_j probs[t, j] * (a[row(t, j)] @ w[e])`` as ``[T, N]`` (GMM + unpermute).

    Differentiable in ``a_RK``, ``w_EKN`` and ``probs_Tk``; the weighted sum is taken in float32.
    """
    _require_triton(a_RK, w_EKN)
    out_TN, _ = _scatter_op(a_RK, w_EKN, group_ends_E, token_of_row_R, slot_of_row_R, probs_Tk)
    return out_TN


def moe_mlp_gather_scatter(
    hidden_TH: torch.Tensor,
    selected_experts_Tk: torch.Tensor,
    probs_Tk: torch.Tensor,
    gate_up_EH2I: torch.Tensor,
    down_EIH: torch.Tensor,
    *,
    validate: bool = True,
) -> torch.Tensor:
    """The routed experts of one MoE layer: ``unpermute(expert_mlp(permute(hidden)), probs)`` fused.

    Args:
        hidden_TH: ``[T, H]`` tokens.
        selected_experts_Tk: ``[T, k]`` int32/int64 expert ids in ``[0, E)``.
        probs_Tk: ``[T, k]`` routing weights (any float dtype).
        gate_up_EH2I: ``[E, H, 2I]`` (gate = first half of the columns); any strides.
        down_EIH: ``[E, I, H]``; any strides.
        validate: check that every id lies in ``[0, E)``; reads the ids on the host (a sync on an
            accelerator), skipped under ``torch.compile``. ``False`` means "you promise": the
            range is then still checked on CPU, and on CUDA as an asynchronous device-side assert.

    Returns:
        ``[T, H]`` in ``hidden_TH``'s dtype. Runs on the triton backend (CUDA, or the interpreter).
    """
    operands = (
        ("hidden_TH", hidden_TH, 2),
        ("selected_experts_Tk", selected_experts_Tk, 2),
        ("probs_Tk", probs_Tk, 2),
        ("gate_up_EH2I", gate_up_EH2I, 3),
        ("down_EIH", down_EIH, 3),
    )
    for name, t, dims in operands:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if selected_experts_Tk.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"selected_experts_Tk must be int32 or int64, got {selected_experts_Tk.dtype}")
    if not hidden_TH.dtype == gate_up_EH2I.dtype == down_EIH.dtype:
        # The kernels load both operands in one dtype; a mix would fail inside Triton.
        raise TypeError(
            f"hidden_TH, gate_up_EH2I and down_EIH must share one dtype, got {hidden_TH.dtype}, "
            f"{gate_up_EH2I.dtype} and {down_EIH.dtype}"
        )
    num_experts, hidden, two_inter = gate_up_EH2I.shape
    num_tokens = hidden_TH.shape[0]
    if hidden_TH.shape[1] != hidden:
        raise ValueError(f"hidden_TH.shape[1] must equal gate_up_EH2I.shape[1] = {hidden}, got {hidden_TH.shape[1]}")
    if tuple(down_EIH.shape) != (num_experts, two_inter // 2, hidden) or two_inter % 2:
        expected = (num_experts, two_inter // 2, hidden)
        raise ValueError(f"down_EIH must be [E, I, H] = {expected}, got {tuple(down_EIH.shape)}")
    if selected_experts_Tk.shape[0] != num_tokens or tuple(probs_Tk.shape) != tuple(selected_experts_Tk.shape):
        raise ValueError(
            f"selected_experts_Tk and probs_Tk must both be [T, k] with T = {num_tokens}, "
            f"got {tuple(selected_experts_Tk.shape)} and {tuple(probs_Tk.shape)}"
        )
    if not isinstance(validate, bool):
        raise TypeError(f"validate must be a bool, got {type(validate).__name__} {validate!r}")
    if selected_experts_Tk.numel() and not torch.compiler.is_compiling():
        lo, hi = torch.aminmax(selected_experts_Tk)
        if validate or selected_experts_Tk.device.type == "cpu":  # a host sync only where asked for or free
            if int(lo) < 0 or int(hi) >= num_experts:
                raise ValueError(
                    f"selected_experts_Tk must lie in [0, {num_experts}), got values in [{int(lo)}, {int(hi)}]"
                )
        elif selected_experts_Tk.device.type == "cuda":  # an id out of range leaves rows unwritten; no sync
            torch._assert_async((lo >= 0) & (hi < num_experts), "selected_experts_Tk out of [0, num_experts)")
    slot_of_row_R, token_of_row_R, group_ends_E = routing_rows(selected_experts_Tk, num_experts)
    h_R2I = gather_grouped_matmul(hidden_TH, gate_up_EH2I, group_ends_E, token_of_row_R, slot_of_row_R)
    a_RI = swiglu(h_R2I)
    return grouped_matmul_scatter(a_RI, down_EIH, group_ends_E, token_of_row_R, slot_of_row_R, probs_Tk)
