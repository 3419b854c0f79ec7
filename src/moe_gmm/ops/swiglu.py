"""SwiGLU on a concatenated ``[gate | up]`` projection.

Convention (the only one in this package): the GATE is the FIRST half of the last dimension,
``swiglu(x[..., 2I]) = silu(x[..., :I]) * x[..., I:]``. It matches both weight layouts in use:
columns ``[:I]`` of our ``gate_up_proj [E, H, 2I]`` are the gate, and Hugging Face's
``gate, up = (x @ gate_up_proj[e].T).chunk(2, dim=-1)`` on ``[E, 2I, H]`` takes the gate from the
first I rows, so the transposed view ``gate_up_proj.transpose(1, 2)`` keeps the same meaning.

A ``torch.library`` custom op whose backward saves only the input (the activation is recomputed),
so autograd keeps one ``[.., 2I]`` tensor instead of three; math runs in float32 for 16-bit inputs,
into outputs from :mod:`moe_gmm.ops.host_cache`: on CPU in one pass per row by a native kernel
(:mod:`moe_gmm.ops.native`), elsewhere (and without a C++ compiler) a chunk of rows at a time.
On an Ascend NPU with torch_npu the forward runs ``npu_swiglu`` (``moe_gmm.ops.npu_fused``).
"""

from __future__ import annotations

import torch
from moe_gmm.ops import host_cache, native, npu_fused
from moe_gmm.ops.eager_path import direct, label

__all__ = ["swiglu"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# Rows are processed ~1 MiB of float32 at a time: widening a whole [R, 2I] 16-bit activation to
# float32 streams temporaries twice its size through memory several times per pass, while a chunk
# stays in cache.
_CHUNK_BYTES = 1 << 20


def _row_chunks(x: torch.Tensor):
    """``(start, end)`` row ranges of the 2-D view of ``x``, about ``_CHUNK_BYTES`` of float32 each."""
    rows, width = x.shape[0], x.shape[1]
    step = max(1, _CHUNK_BYTES // max(1, 4 * width))
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def _as_rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x


def _swiglu_body(x: torch.Tensor) -> torch.Tensor:
    vendor = npu_fused.vendor_ops_for(x)
    if vendor is not None:
        return npu_fused.swiglu_forward(vendor, x)
    acc = _acc_dtype(x.dtype)
    x_R2I = _as_rows(x)
    half = x_R2I.shape[1] // 2
    y_RI = host_cache.empty((x_R2I.shape[0], half), dtype=x.dtype, device=x.device)
    kernels = native.ops(x)
    if kernels is not None:
        kernels.swiglu(x_R2I.contiguous(), y_RI)
        return y_RI.view(*x.shape[:-1], half)
    for r0, r1 in _row_chunks(x_R2I):
        gate, up = x_R2I[r0:r1].to(acc).chunk(2, dim=-1)
        y_RI[r0:r1].copy_(torch.nn.functional.silu(gate).mul_(up))
    return y_RI.view(*x.shape[:-1], half)


@torch.library.custom_op("moe_gmm::swiglu", mutates_args=())
def _swiglu_op(x: torch.Tensor) -> torch.Tensor:
    return _swiglu_body(x)


@_swiglu_op.register_fake
def _(x):
    return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)


def _swiglu_grad(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # silu_backward computes dy * d silu(g)/dg in one fused pass (faster on CPU than spelling out
    # the sigmoid terms) but has no derivative itself: a graph-building backward takes the other path.
    acc = _acc_dtype(x.dtype)
    x_R2I, dy_RI = _as_rows(x), _as_rows(grad_out)
    half = x_R2I.shape[1] // 2
    dx_R2I = host_cache.empty(tuple(x_R2I.shape), dtype=x.dtype, device=x.device)
    kernels = native.ops(x, grad_out)
    if kernels is not None and grad_out.dtype == x.dtype:
        kernels.swiglu_backward(dy_RI.contiguous(), x_R2I.contiguous(), dx_R2I)
        return dx_R2I.view(x.shape)
    for r0, r1 in _row_chunks(x_R2I):
        gate, up = x_R2I[r0:r1].to(acc).chunk(2, dim=-1)
        dy = dy_RI[r0:r1].to(acc)
        dx_R2I[r0:r1, :half].copy_(torch.ops.aten.silu_backward(dy * up, gate))
        dx_R2I[r0:r1, half:].copy_(torch.nn.functional.silu(gate).mul_(dy))
    return dx_R2I.view(x.shape)


def _setup_context(ctx, inputs, output) -> None:
    (x,) = inputs
    ctx.save_for_backward(x)


def _swiglu_grad_differentiable(grad_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The same gradient spelled out in differentiable torch ops, for a backward that builds a graph
    (``create_graph=True``: double backward, gradient penalties); slower, so only then."""
    acc = _acc_dtype(x.dtype)
    gate, up = x.to(acc).chunk(2, dim=-1)
    dy = grad_out.to(acc)
    sig = torch.sigmoid(gate)
    d_gate = dy * up * sig * (1 + gate * (1 - sig))  # d silu(g) / dg = s + g s (1 - s)
    d_up = dy * gate * sig
    return torch.cat([d_gate, d_up], dim=-1).to(x.dtype)


def _backward(ctx, grad_out: torch.Tensor):
    (x,) = ctx.saved_tensors
    with label("moe::swiglu_bwd"):
        if torch.is_grad_enabled() and (x.requires_grad or grad_out.requires_grad):
            return _swiglu_grad_differentiable(grad_out, x)
        return _swiglu_grad(grad_out, x)


torch.library.register_autograd("moe_gmm::swiglu", _backward, setup_context=_setup_context)


class _Swiglu(torch.autograd.Function):
    """``moe_gmm::swiglu``'s direct path (:mod:`moe_gmm.ops.eager_path`): its body and backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = _swiglu_body(x)
        _setup_context(ctx, (x,), out)
        return out

    backward = staticmethod(_backward)


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for ``x`` of shape ``[..., 2I]``; returns ``[..., I]`` in x's dtype.

    Raises ``TypeError`` for a non-floating ``x`` and ``ValueError`` for a 0-D input or an odd last dimension.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"x must have a floating dtype, got {str(x.dtype).removeprefix('torch.')}")
    if x.dim() == 0 or x.shape[-1] % 2 != 0:
        raise ValueError(f"x must have an even last dimension [..., 2I], got shape {tuple(x.shape)}")
    if not direct(x):
        return _swiglu_op(x)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Swiglu.apply(x)
    return _swiglu_body(x)
