"""Whole-row gathers and scatters that move rows as raw bits.

torch's CPU ``index_select`` / ``index_copy_`` moved bfloat16 and float32 rows several times slower
than the same bytes viewed as int16 / int32 (``docs/cpu_kernels.md``): the floating kernels take a
slower generic path, and a row copy needs no arithmetic. Other devices use the plain ops.
"""

from __future__ import annotations

import torch

from moe_gmm.ops import host_cache

__all__ = ["gather_rows", "scatter_rows_", "zero_rows_"]

_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS_DTYPE[t.element_size()])


def gather_rows(src_RH: torch.Tensor, index_N: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``src[index]`` (whole rows) into ``out`` (``[N, H]``) when given, else a fresh contiguous tensor."""
    if out is None:
        out = host_cache.empty((index_N.shape[0], src_RH.shape[1]), dtype=src_RH.dtype, device=src_RH.device)
    if src_RH.device.type != "cpu":
        return torch.index_select(src_RH, 0, index_N, out=out)
    torch.index_select(_bits(src_RH), 0, index_N, out=_bits(out))
    return out


def scatter_rows_(dst_RH: torch.Tensor, index_N: torch.Tensor, src_NH: torch.Tensor) -> torch.Tensor:
    """``dst[index] = src`` (whole rows, unique indices) in place; returns ``dst``."""
    if dst_RH.device.type != "cpu":
        return dst_RH.index_copy_(0, index_N, src_NH)
    _bits(dst_RH).index_copy_(0, index_N, _bits(src_NH))
    return dst_RH


def zero_rows_(dst_RH: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """``dst[index] = 0`` (whole rows; all-zero bits are +0.0 in every float dtype) in place; returns ``dst``."""
    if dst_RH.device.type != "cpu":
        return dst_RH.index_fill_(0, index_N, 0)
    _bits(dst_RH).index_fill_(0, index_N, 0)
    return dst_RH
