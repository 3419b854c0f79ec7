"""Calls into the native grouped-GEMM kernels (:mod:`moe_gmm.ops.native`); None where they do not apply.

- bfloat16 with every width a multiple of 32: AMX tiles where the CPU and OS grant them
  (``grouped_gemm_amx.cpp``), else AVX-512 BF16 (``grouped_gemm_avx512_bf16.cpp``), the same three
  products (``nn``, ``nt``, ``tn``) with the same contracts.
- float32 on AVX-512 (``grouped_gemm_avx512.cpp``): grad_weight (``tn``), and forward and
  grad_input for experts of few rows (``nn`` where the multiplied matrix has contiguous rows,
  ``nt`` where it has contiguous columns).
- Every expert above a kernel's row limit, or of a pass no kernel takes, is one oneDNN / MKL GEMM
  on one thread, whole experts shared between the threads (``experts_mm.cpp``): a loop of GEMMs that
  each split between the threads forks and joins them once per expert.
Row limits and switches come from the tuning in force (:mod:`.tuning`), read at every call.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from moe_gmm.ops import host_cache, native
from moe_gmm.ops.backends.base import host_bounds
from moe_gmm.ops.backends.cpu.tuning import current_tuning

__all__ = [
    "BF16_ALIGN",
    "Bf16Kernels",
    "amx_available",
    "avx512_ops",
    "bf16_kernels",
    "bf16_product",
    "experts_product",
    "few_rows_product",
    "native_grad_weight",
    "weight_layout",
]

BF16_ALIGN = 32  # the native bfloat16 kernels take reduced and output widths of multiples of this

_cpu_support: dict[str, bool] = {}  # what the CPU and build support, asked once


def _supported(ops, family: str) -> bool:
    if family not in _cpu_support:
        _cpu_support[family] = bool(getattr(ops, f"{family}_gemm_supported")())
    return _cpu_support[family]


def amx_available() -> bool:
    """Whether bfloat16 calls can take the AMX path here (native kernels built, CPU with AMX, OS grant)."""
    ops = native.ops()
    return ops is not None and _supported(ops, "amx")


@dataclass(frozen=True)
class Bf16Kernels:
    """A family of native bfloat16 kernels (``amx`` or ``avx512_bf16``): its ops and row limits."""

    family: str
    ops: object

    def op(self, product: str):
        return getattr(self.ops, f"{self.family}_gemm_{product}")

    def max_rows(self, product: str) -> int:
        t = current_tuning()  # read at call time: tests and sweeps put other limits in force
        limits = {
            "amx": {"nn": t.amx_nn_max_rows, "nt": t.amx_nt_max_rows, "tn": t.amx_grad_weight_max_rows},
            "avx512_bf16": {
                "nn": t.avx512_bf16_nn_max_rows,
                "nt": t.avx512_bf16_nt_max_rows,
                "tn": t.avx512_bf16_grad_weight_max_rows,
            },
        }
        return limits[self.family][product]


def bf16_kernels(*tensors: torch.Tensor, widths: tuple[int, ...]) -> Bf16Kernels | None:
    """The native bfloat16 kernels that take these operands and ``widths`` (AMX where granted, else
    AVX-512 BF16), or None."""
    if any(t.dtype != torch.bfloat16 for t in tensors) or any(w % BF16_ALIGN for w in widths):
        return None
    ops = native.ops(*tensors)
    if ops is None:
        return None
    t = current_tuning()
    if t.use_amx and _supported(ops, "amx"):
        return Bf16Kernels("amx", ops)
    if t.use_avx512_bf16 and _supported(ops, "avx512_bf16"):
        return Bf16Kernels("avx512_bf16", ops)
    return None


def avx512_ops(*tensors: torch.Tensor):
    """The native ops when the AVX-512 float32 kernels take these operands, else None."""
    if not current_tuning().use_avx512 or any(t.dtype != torch.float32 for t in tensors):
        return None
    ops = native.ops(*tensors)
    return ops if ops is not None and _supported(ops, "avx512") else None


def weight_layout(w_EKN: torch.Tensor) -> str | None:
    """``"EKN"`` (N contiguous), ``"ENK"`` (K contiguous: the transposed view of an ``[E, N, K]``
    parameter), or None when neither holds (the AMX kernels need one unit stride, the other even)."""
    if w_EKN.stride(2) == 1 and w_EKN.stride(1) % 2 == 0:
        return "EKN"
    if w_EKN.stride(1) == 1 and w_EKN.stride(2) % 2 == 0:
        return "ENK"
    return None


def _unit_rows(t_MX: torch.Tensor) -> torch.Tensor:
    # .contiguous() keeps the zero strides of a [1, 1] expanded gradient; clone gives unit strides.
    return t_MX if t_MX.stride(1) == 1 else t_MX.clone(memory_format=torch.contiguous_format)


def _ends(group_ends_E: torch.Tensor) -> torch.Tensor:
    return group_ends_E.to(torch.int64).contiguous()


def _any_small(bounds: list[int], max_rows: int) -> bool:
    return any(0 < end - start <= max_rows for start, end in itertools.pairwise(bounds))


def _experts_ops(*tensors: torch.Tensor, num_experts: int):
    """The native ops when one library GEMM per expert, whole experts per thread
    (``experts_mm.cpp``), takes these operands; else None (the plan's path)."""
    t = current_tuning()
    if not t.use_experts_mm or tensors[0].shape[0] == 0:
        return None
    if tensors[0].dtype == torch.float32 and num_experts < t.experts_mm_min_experts_fp32:
        return None
    return native.ops(*tensors)


def bf16_product(a_MR: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor, *, transpose_w: bool):
    """``a[rows_e] @ w[e]`` (or ``@ w[e]^T``) by the native bfloat16 kernels, their large experts
    one GEMM each; None when they do not apply."""
    k, n = w_EKN.shape[1], w_EKN.shape[2]
    if a_MR.shape[0] == 0 or (n if transpose_w else k) == 0:
        return None  # an empty reduction: the library path writes its zeros
    layout = weight_layout(w_EKN)
    kernels = bf16_kernels(a_MR, w_EKN, widths=(k, n)) if layout is not None else None
    if kernels is None:
        return None
    # EKN forward and ENK grad_input multiply by rows of the weight as stored (nn); the other two
    # by the weight's transpose (nt). Either way the stored weight is read, never copied.
    product = "nn" if (layout == "EKN") != transpose_w else "nt"
    out = host_cache.empty((a_MR.shape[0], k if transpose_w else n), dtype=a_MR.dtype)
    b = w_EKN if layout == "EKN" else w_EKN.transpose(1, 2)
    ends = _ends(group_ends_E)
    max_rows = kernels.max_rows(product)
    a = _unit_rows(a_MR)
    if product == "nt" and kernels.family == "amx" and a.stride(0) % 2:
        a = a.contiguous()  # AMX's nt reads a's rows as bfloat16 pairs: an odd row stride is copied first
    kernels.op(product)(a, b, ends, max_rows, out)
    kernels.ops.experts_mm(a_MR, w_EKN.transpose(1, 2) if transpose_w else w_EKN, ends, max_rows, out)
    return out


def few_rows_product(a_MR: torch.Tensor, w_ERJ: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor | None:
    """float32 ``a[rows_e] @ w[e]`` by the AVX-512 streaming kernels for experts of few rows (``nn``
    where ``w``'s rows are contiguous, ``nt`` where its columns are), the others one GEMM each on a
    thread; None when it does not apply (no such expert, another layout, no AVX-512)."""
    if a_MR.shape[0] == 0:
        return None
    ops = avx512_ops(a_MR, w_ERJ)
    if ops is None:
        return None
    t = current_tuning()
    if w_ERJ.stride(2) == 1:
        kernel, b, max_rows = ops.avx512_gemm_nn_few_rows, w_ERJ, t.avx512_nn_max_rows
    elif w_ERJ.stride(1) == 1:
        kernel, b, max_rows = ops.avx512_gemm_nt_few_rows, w_ERJ.transpose(1, 2), t.avx512_nt_max_rows
    else:
        return None
    if not _any_small(host_bounds(group_ends_E), max_rows):
        return None
    out = host_cache.empty((a_MR.shape[0], w_ERJ.shape[2]), dtype=a_MR.dtype)
    ends = _ends(group_ends_E)
    kernel(_unit_rows(a_MR), b, ends, max_rows, out)
    ops.experts_mm(a_MR, w_ERJ, ends, max_rows, out)
    return out


def experts_product(a_MR: torch.Tensor, w_ERJ: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor | None:
    """``a[rows_e] @ w[e]`` as one library GEMM per expert, whole experts per thread; None when
    the native ops do not take these operands."""
    ops = _experts_ops(a_MR, w_ERJ, num_experts=w_ERJ.shape[0])
    if ops is None:
        return None
    out = host_cache.empty((a_MR.shape[0], w_ERJ.shape[2]), dtype=a_MR.dtype)
    ops.experts_mm(a_MR, w_ERJ, _ends(group_ends_E), 0, out)
    return out


def native_grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor | None:
    """grad_weight by the native bfloat16 (AMX, AVX-512 BF16) or float32 (AVX-512) kernel for
    experts up to its row limit and one GEMM per expert for the rest, or all by one GEMM per
    expert; None when the native ops do not take these operands."""
    k, n = x_MK.shape[1], dy_MN.shape[1]
    if x_MK.shape[0] == 0:  # no rows (strides of an empty tensor are arbitrary): the plan's path
        return None
    num_experts = group_ends_E.shape[0]
    ops, kernel, max_rows = None, None, -1
    if (kernels := bf16_kernels(x_MK, dy_MN, widths=(k, n))) is not None:
        ops, kernel, max_rows = kernels.ops, kernels.op("tn"), kernels.max_rows("tn")
    elif (ops := avx512_ops(x_MK, dy_MN)) is not None:
        kernel, max_rows = ops.avx512_gemm_tn, current_tuning().avx512_grad_weight_max_rows
    elif (ops := _experts_ops(x_MK, dy_MN, num_experts=num_experts)) is None:
        return None
    dw_EKN = host_cache.empty((num_experts, k, n), dtype=x_MK.dtype)
    ends = _ends(group_ends_E)
    if kernel is not None:
        kernel(_unit_rows(x_MK), _unit_rows(dy_MN), ends, max_rows, dw_EKN)
    ops.experts_mm_tn(x_MK, dy_MN, ends, max_rows, dw_EKN)
    return dw_EKN
