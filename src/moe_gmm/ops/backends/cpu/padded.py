"""The ``padded`` strategy: groups padded to P rows and multiplied as a few ``torch.bmm`` calls.

Legend: M rows, E experts, P padded rows per expert, ``dest_M`` the row of the padded
``[E * P, ...]`` buffer that holds each of the M rows. Padding rows never reach the outputs:
forward and grad_input gather only the real rows back, and grad_weight zero-fills the padding of
both operands (NaN left in reused memory cannot leak in), which also makes an empty expert's
gradient exactly zero.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from moe_gmm.ops import host_cache
from moe_gmm.ops.backends.cpu.planning import GmmPlan
from moe_gmm.ops.backends.cpu.tuning import current_tuning
from moe_gmm.ops.row_copy import gather_rows, zero_rows_

__all__ = ["expert_chunks", "pad_reduction", "padded_grad_weight", "padded_product", "release_workspace"]

# 16-bit reductions are zero-padded to a multiple of this many values (pad_reduction).
_REDUCTION_ALIGN_16BIT = 32


class _Workspace(threading.local):
    """Scratch buffers reused across calls, one set per thread (autograd may run on another thread).

    Only padded intermediates live here, never a returned tensor. Reuse matters on CPU: a fresh
    buffer of tens of MiB is served by mmap, and every call would page-fault all of it in again.
    """

    def __init__(self) -> None:
        self.buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def get(self, slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self.buffers.get((slot, dtype))
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            self.buffers[(slot, dtype)] = buf
        return buf[:numel]


_workspace = _Workspace()


def release_workspace() -> None:
    """Free this thread's scratch buffers (they are otherwise kept for the next call)."""
    _workspace.buffers.clear()


@dataclass(frozen=True)
class _RowLayout:
    """Where the M rows sit in the padded ``[E * P, X]`` buffer.

    ``dest_M``: row ``i`` of expert ``e``'s group is padded row ``e * P + i`` (ascending);
    ``source_EP``: the row each padded row is copied from (row 0 for padding rows, zeroed after
    when needed); ``pad_rows``: the padded rows no real row lands on.
    """

    dest_M: torch.Tensor
    source_EP: torch.Tensor
    pad_rows: torch.Tensor


def _row_layout(counts_E: tuple[int, ...], padded_rows: int) -> _RowLayout:
    counts = torch.tensor(counts_E, dtype=torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    offset_P = torch.arange(padded_rows)
    real_EP = offset_P < counts[:, None]
    source_EP = torch.where(real_EP, starts[:, None] + offset_P, 0).flatten()
    real_EP = real_EP.flatten()
    return _RowLayout(real_EP.nonzero().squeeze(1), source_EP, (~real_EP).nonzero().squeeze(1))


def _pad(t_MX: torch.Tensor, counts_E: tuple[int, ...], padded_rows: int, slot: str, *, zero: bool) -> torch.Tensor:
    """``[E, P, X]`` scratch holding ``t``'s rows, expert by expert; padding rows zeroed only when ``zero``.

    Filled by a gather (each padded row reads its source row): torch's CPU ``index_copy_`` (a
    scatter) is the slower way to place the same rows.
    """
    num_experts, width = len(counts_E), t_MX.shape[1]
    padded = _workspace.get(slot, num_experts * padded_rows * width, t_MX.dtype).view(-1, width)
    layout = _row_layout(counts_E, padded_rows)
    if t_MX.shape[0] == 0:
        padded.zero_()
    else:
        gather_rows(t_MX, layout.source_EP, out=padded)
        if zero and layout.pad_rows.numel():
            zero_rows_(padded, layout.pad_rows)
    return padded.view(num_experts, padded_rows, width)


def expert_chunks(p: GmmPlan, rows: int, width: int, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
    """``(e0, e1, r0, r1)``: runs of experts whose padded ``[e1 - e0, rows, width]`` block is about
    ``padded_chunk_bytes``, with the real rows ``r0:r1`` they own (contiguous: groups are in order)."""
    per_expert = max(1, rows * width * dtype.itemsize)
    threads = max(1, torch.get_num_threads())
    # bmm splits its batch between the threads: a run of experts that is a multiple of the thread
    # count, and at least two per thread, keeps them evenly busy.
    step = max(current_tuning().padded_chunk_bytes // per_expert, 2 * threads)
    step -= step % threads
    # Runs of one size where E allows: oneDNN compiles and caches a kernel per bmm shape, so a
    # remainder run is a second shape to hold.
    even = [d for d in range(step, threads - 1, -threads) if len(p.counts) % d == 0]
    if even and even[0] * 2 > step:
        step = even[0]
    bounds = list(itertools.accumulate(p.counts, initial=0))
    return [
        (e0, min(e0 + step, len(p.counts)), bounds[e0], bounds[min(e0 + step, len(p.counts))])
        for e0 in range(0, len(p.counts), step)
    ]


def pad_reduction(a_MR: torch.Tensor, w_ERJ: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``a`` and ``w`` with the reduced width R zero-padded to a multiple of 32 for 16-bit dtypes
    (zero columns of ``a``, zero rows of ``w``: they add nothing to any sum); as they are otherwise.

    oneDNN's 16-bit GEMMs read a row of ``a`` up to R rounded up to 32 and multiply the excess by
    zeros of their own: past an unaligned R they read the next row, and an Inf or NaN there made
    this row's products NaN (0 * Inf). A copy of both operands, for unaligned 16-bit shapes only.
    """
    width = a_MR.shape[1]
    aligned = -(-width // _REDUCTION_ALIGN_16BIT) * _REDUCTION_ALIGN_16BIT
    if a_MR.dtype.itemsize != 2 or aligned == width:
        return a_MR, w_ERJ
    a_pad = a_MR.new_zeros(a_MR.shape[0], aligned)
    a_pad[:, :width] = a_MR
    w_pad = w_ERJ.new_zeros(w_ERJ.shape[0], aligned, w_ERJ.shape[2])
    w_pad[:, :width] = w_ERJ
    return a_pad, w_pad


def padded_product(a_MK: torch.Tensor, b_EKN: torch.Tensor, p: GmmPlan) -> torch.Tensor:
    """``a[rows_e] @ b[e]`` for all experts as a few bmm calls; padding rows are computed and dropped."""
    n = b_EKN.shape[2]
    out_MN = host_cache.empty((a_MK.shape[0], n), dtype=a_MK.dtype)
    width = max(a_MK.shape[1], n)
    for e0, e1, r0, r1 in expert_chunks(p, p.padded_rows, width, a_MK.dtype):
        counts = p.counts[e0:e1]
        a_EPK = _pad(a_MK[r0:r1], counts, p.padded_rows, "a", zero=False)
        # Slot "b" (grad_weight's second operand) is free here: two scratch buffers serve every call.
        out_EPN = _workspace.get("b", (e1 - e0) * p.padded_rows * n, a_MK.dtype).view(e1 - e0, p.padded_rows, n)
        torch.bmm(a_EPK, b_EKN[e0:e1], out=out_EPN)
        gather_rows(out_EPN.view(-1, n), _row_layout(counts, p.padded_rows).dest_M, out=out_MN[r0:r1])
    return out_MN


def padded_grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, p: GmmPlan) -> torch.Tensor:
    """``x[rows_e]^T @ dy[rows_e]`` for all experts as a few bmm calls over zero-padded operands."""
    # P is the reduction dimension here: a multiple of 32 keeps oneDNN's bf16 (AMX/VNNI) kernel on
    # its fast path. Both paddings zero: 0 * (NaN or stale data in the scratch) could still be NaN.
    multiple = current_tuning().grad_weight_row_multiple
    rows = -(-p.padded_rows // multiple) * multiple
    if x_MK.dtype == torch.float32:
        rows = p.padded_rows
    dw_EKN = host_cache.empty((len(p.counts), x_MK.shape[1], dy_MN.shape[1]), dtype=x_MK.dtype)
    width = max(x_MK.shape[1], dy_MN.shape[1])
    for e0, e1, r0, r1 in expert_chunks(p, rows, width, x_MK.dtype):
        x_EPK = _pad(x_MK[r0:r1], p.counts[e0:e1], rows, "a", zero=True)
        dy_EPN = _pad(dy_MN[r0:r1], p.counts[e0:e1], rows, "b", zero=True)
        torch.bmm(x_EPK.transpose(1, 2), dy_EPN, out=dw_EKN[e0:e1])
    return dw_EKN
