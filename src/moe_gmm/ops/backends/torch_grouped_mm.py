"""PyTorch's native grouped GEMM (``torch.nn.functional.grouped_mm``) on CPU and CUDA.

Quirks of torch 2.13's kernel handled here, not at call sites:
- offsets must be int32 (int64 raises "Offsets have to be int32");
- an operand whose last two strides are both non-unit (a zero-stride expanded gradient, a column
  slice ``x[:, ::2]``) raises "Invalid strides/sizes": such operands are made contiguous;
- rows past the last offset are left uninitialised: the contract guarantees the last offset is M,
  so no such rows exist here;
- every non-unit stride must be a multiple of 16 bytes ("strides should be multiple of 16 bytes"),
  on CPU too: K and N must be multiples of 16 bytes' worth of elements, else the backend refuses
  (``auto`` then falls back to eager), and a weight view with unaligned strides is copied;
- K or N of 0 fails the same stride check: the backend refuses them (``auto`` falls back);
- float64 is rejected by the kernel: the backend does not declare it, so ``auto`` picks eager;
- on CUDA, empty groups' weight gradients are not documented to be zero: they are zeroed here.
"""

from __future__ import annotations

import torch

from moe_gmm.ops.backends.base import GmmBackend, counts_from_ends

_grouped_mm = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _unavailable_reason() -> str | None:
    if _grouped_mm is None:
        return f"torch {torch.__version__} has neither torch.nn.functional.grouped_mm nor torch._grouped_mm"
    return None


_ALIGN_BYTES = 16


def _aligned(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    size = t.element_size()
    return all((s * size) % _ALIGN_BYTES == 0 for s in strides) and t.data_ptr() % _ALIGN_BYTES == 0


def _gemm_operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the kernel can read its layout (row- or column-major, 16-byte aligned)."""
    if t.numel() == 0:
        # An empty tensor counts as contiguous whatever its strides, so .contiguous() would keep
        # e.g. the zero strides of an expanded empty gradient, which the kernel rejects.
        return t.new_empty(t.shape)
    rows, cols = t.shape[-2], t.shape[-1]
    row_stride, col_stride = t.stride(-2), t.stride(-1)
    outer = tuple(t.stride()[:-2])
    if col_stride == 1 and row_stride >= max(cols, 1) and _aligned(t, (row_stride, *outer)):
        return t
    if row_stride == 1 and col_stride >= max(rows, 1) and _aligned(t, (col_stride, *outer)):
        return t
    return t.contiguous()


def _offsets(group_ends_E: torch.Tensor) -> torch.Tensor:
    return group_ends_E.to(torch.int32)


def forward(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    return _grouped_mm(_gemm_operand(x_MK), _gemm_operand(w_EKN), offs=_offsets(group_ends_E))


def grad_input(dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    w_ENK = w_EKN.transpose(-2, -1)
    return _grouped_mm(_gemm_operand(dy_MN), _gemm_operand(w_ENK), offs=_offsets(group_ends_E))


def grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    x_KM = _gemm_operand(x_MK).t()
    dw_EKN = _grouped_mm(x_KM, _gemm_operand(dy_MN), offs=_offsets(group_ends_E))
    if dw_EKN.device.type != "cpu":
        # CPU writes exact zeros for empty groups (tested); elsewhere it is not documented.
        empty_E = counts_from_ends(group_ends_E) == 0
        dw_EKN = dw_EKN.masked_fill(empty_E[:, None, None], 0)
    return dw_EKN


def _input_refusal(x_MK: torch.Tensor, w_EKN: torch.Tensor) -> str | None:
    k, n = x_MK.shape[1], w_EKN.shape[2]
    if k == 0 or n == 0:
        return f"grouped_mm rejects an operand of width 0 (its stride check fails), got K={k}, N={n}"
    multiple = _ALIGN_BYTES // x_MK.element_size()
    if k % multiple or n % multiple:
        dtype = str(x_MK.dtype).removeprefix("torch.")
        return f"grouped_mm needs K and N multiples of {multiple} for {dtype} (16-byte strides), got K={k}, N={n}"
    if x_MK.device.type != "cuda":
        return None
    if x_MK.dtype != torch.bfloat16:
        return f"CUDA grouped_mm takes bfloat16 only, got {str(x_MK.dtype).removeprefix('torch.')}"
    major, minor = torch.cuda.get_device_capability(x_MK.device)
    if major < 8:
        return f"CUDA grouped_mm needs compute capability 8.0+, device has {major}.{minor}"
    return None


BACKEND = GmmBackend(
    name="torch",
    devices=frozenset({"cpu", "cuda"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    forward=forward,
    grad_input=grad_input,
    grad_weight=grad_weight,
    unavailable_reason=_unavailable_reason,
    input_refusal=_input_refusal,
    notes="torch.nn.functional.grouped_mm; on CPU a C++ loop of mm per group",
)
