"""The CPU backend's thresholds as one value: which strategy and which kernel each call takes.

Each field says why it exists; the measurements behind the values are in ``docs/cpu_kernels.md``.
:func:`current_tuning` is the value in force (read at every call); :func:`use_tuning` puts another in
force for a block (tests, sweeps, a caller with its own measurements).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

from moe_gmm._validation import check_field_types
from moe_gmm.ops import native

__all__ = ["DEFAULT_TUNING", "MKL_GENERIC_CODE", "CpuTuning", "current_tuning", "use_tuning"]

# MKL runs its generic x86 code on AMD CPUs, so there the float32 kernels stay ahead of it at
# every expert size and take larger experts than on Intel.
MKL_GENERIC_CODE = native.cpuinfo_value("vendor_id") == "AuthenticAMD"


@dataclass(frozen=True)
class CpuTuning:
    """Thresholds of the ``cpu`` backend. Row limits: experts of up to that many rows take the
    kernel, larger ones one library GEMM each (a limit of 0 or below: every expert is large)."""

    # The torch-only strategies (plan(): padded bmm or a GEMM loop).
    min_threads: int = 2  # padding saves the BLAS threads' fork/join per expert: none with one thread
    min_experts: int = 16  # with few experts there are few joins to save and the loop is as fast
    max_rows: int = 1 << 30  # bf16/fp16 have no row limit of their own: the padding waste decides
    max_rows_fp32: int = 0  # float32 never pads: MKL's small GEMMs are cheap to call
    max_pad_waste: float = 1.5  # padding may add this share of rows before the loop is faster
    small_rows: int = 64  # groups this small may waste more padding (small_pad_waste) ...
    small_pad_waste: float = 3.0  # ... since each of their per-expert calls costs the most
    grad_weight_row_multiple: int = 32  # padded grad_weight's reduction rounded up: oneDNN's fast bf16 path
    grouped_mm_max_out_bytes: int = 4 << 20  # larger loop outputs come from host_cache, not a faulted-in fresh one
    padded_chunk_bytes: int = 4 << 20  # padded runs of experts about this size keep scratch small at little cost
    # One library GEMM per expert, whole experts per thread (experts_mm.cpp), for what no kernel takes.
    use_experts_mm: bool = True
    experts_mm_min_experts_fp32: int = 16  # with fewer float32 experts MKL's own split is as fast
    # bfloat16 on AMX tiles (grouped_gemm_amx.cpp); above the limits oneDNN's GEMMs are as fast.
    use_amx: bool = True
    amx_nn_max_rows: int = 256
    amx_nt_max_rows: int = 256
    amx_grad_weight_max_rows: int = 256
    # bfloat16 on AVX-512 BF16 where AMX is missing (grouped_gemm_avx512_bf16.cpp).
    use_avx512_bf16: bool = True
    avx512_bf16_nn_max_rows: int = 256
    avx512_bf16_nt_max_rows: int = 256
    avx512_bf16_grad_weight_max_rows: int = 256
    # float32 on AVX-512 (grouped_gemm_avx512.cpp): MKL's AVX-512 code is ahead on larger experts.
    use_avx512: bool = True
    avx512_grad_weight_max_rows: int = 128
    avx512_nn_max_rows: int = 256
    avx512_nt_max_rows: int = 32

    def __post_init__(self) -> None:
        check_field_types(self)
        for f in fields(self):
            if f.type == "float" and math.isnan(getattr(self, f.name)):
                raise ValueError(f"CpuTuning.{f.name}: expected a number, got nan")
        if self.grad_weight_row_multiple < 1:
            raise ValueError(f"CpuTuning.grad_weight_row_multiple: expected >= 1, got {self.grad_weight_row_multiple}")

    @classmethod
    def for_cpu(cls, mkl_generic_code: bool) -> CpuTuning:
        """The defaults for a CPU where MKL runs its generic code (AMD) or its AVX-512 code."""
        if not mkl_generic_code:
            return cls()
        return cls(avx512_grad_weight_max_rows=4096, avx512_nn_max_rows=4096, avx512_nt_max_rows=4096)


DEFAULT_TUNING = CpuTuning.for_cpu(MKL_GENERIC_CODE)
_current: CpuTuning = DEFAULT_TUNING


def current_tuning() -> CpuTuning:
    """The thresholds in force (process-wide, as autograd may run a pass on another thread)."""
    return _current


@contextlib.contextmanager
def use_tuning(base: CpuTuning | None = None, /, **changes: object) -> Iterator[CpuTuning]:
    """Put ``base`` (default: the tuning in force) with ``changes`` in force for the block.

    ``with use_tuning(min_threads=1): ...`` or ``with use_tuning(CpuTuning.for_cpu(True)): ...``.
    """
    global _current
    if base is not None and not isinstance(base, CpuTuning):
        raise TypeError(f"use_tuning: base must be a CpuTuning or None, got {type(base).__name__}")
    unknown = sorted(set(changes) - {f.name for f in fields(CpuTuning)})
    if unknown:
        raise TypeError(f"use_tuning: unknown CpuTuning fields {unknown}")
    chosen = replace(base if base is not None else _current, **changes)
    previous, _current = _current, chosen
    try:
        yield chosen
    finally:
        _current = previous
