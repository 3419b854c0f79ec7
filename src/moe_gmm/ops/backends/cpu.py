"""Grouped matmul tuned for CPUs: one batched GEMM for small groups, a loop for large ones.

Legend: M rows, K in-features, N out-features, E experts, P padded rows per expert,
``dest_M`` the row of the padded ``[E * P, ...]`` buffer that holds each of the M rows.

Where the time goes on a CPU (see ``benchmarks/RESULTS.md`` for the profile): with many experts and
few rows each (decode, E >= 64 with short sequences) a per-expert loop spends its time on per-call
overhead, BLAS kernel dispatch for a new tiny shape, and fork/join of the BLAS threads for every
expert, while the work itself is bound by reading each expert's weight once. With few large
groups the loop is already near the BLAS peak.

So each call picks a strategy from the group sizes (read on the host: they live on the CPU):

- ``padded``: every group padded to the largest group's P rows and the whole problem run as ONE
  ``torch.bmm`` of ``[E, P, K] x [E, K, N]``: each expert's weight is read once, in place (any
  strides, including the transposed view of an ``[E, N, K]`` parameter), the BLAS threads split the
  batch, and there is no per-expert dispatch. Chosen when the groups are small (P <= ``max_rows``)
  and padding wastes at most ``max_pad_waste`` times the real rows.
- ``loop``: torch's grouped_mm (a C++ loop of GEMMs) when it accepts the inputs, else the eager
  loop. Chosen for large or very uneven groups (e.g. skewed routing with many empty experts),
  where padding would multiply the work.

Padding rows never reach the outputs: forward and grad_input gather only the real rows back, and
grad_weight zero-fills the padding of both operands (so NaN left in reused memory cannot leak in),
which also makes an empty expert's gradient exactly zero.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from moe_gmm.ops.backends import eager, torch_native
from moe_gmm.ops.backends.base import GmmBackend, host_bounds

__all__ = ["BACKEND", "GmmPlan", "plan", "release_workspace"]


@dataclass(frozen=True)
class GmmPlan:
    """How one call runs: ``strategy`` and, for ``padded``, the rows per expert ``P``."""

    strategy: str  # "padded" | "loop"
    padded_rows: int
    counts: tuple[int, ...]


# Thresholds of the strategy choice, measured on the benchmark set (benchmarks/RESULTS.md).
# With 2 threads, one padded bmm beat grouped_mm's loop 1.7-7x whenever groups were <= a few
# hundred rows and padding added <= ~1.4x rows: the loop forks and joins the BLAS threads once
# per expert, and on a busy machine every join waits for a descheduled thread, while bmm splits
# the batch between threads once. With one thread there is no join to save and the loop was
# 1.1-1.4x faster (bmm pays the padding and the gather back), so ``padded`` needs >= 2 threads.
# With few experts (E=8, 128 or 1024 rows each) the loop was 1.1-1.5x faster at any thread count:
# there are only E joins to save. So ``padded`` needs >= MIN_EXPERTS experts.
# float32 (MKL) has cheap small GEMMs: with 64-90 rows per expert the loop won 1.1-1.3x, so fp32
# pads only tiny groups; bf16/fp16 (oneDNN) pay a per-call setup that batching removes (1.1-1.2x there).
# Tiny groups (decode) read far more weight bytes than they compute, so padding them is cheap.
MIN_THREADS = 2
MIN_EXPERTS = 16
MAX_ROWS = 768
MAX_ROWS_FP32 = 64
MAX_PAD_WASTE = 1.5
SMALL_ROWS = 64
SMALL_PAD_WASTE = 3.0


def plan(
    bounds: list[int],
    dtype: torch.dtype = torch.bfloat16,
    *,
    max_rows: int | None = None,
    max_pad_waste: float | None = None,
) -> GmmPlan:
    """Choose the strategy for group bounds ``[0, end_0, ..., end_{E-1}]`` (defaults: the module's thresholds).

    ``padded`` when torch runs at least ``MIN_THREADS`` intra-op threads, there are at least
    ``MIN_EXPERTS`` experts, and the largest group P
    and the padding waste ``E * P / M`` are both small enough: P <= ``max_rows`` (``MAX_ROWS``, or
    ``MAX_ROWS_FP32`` for float32) with waste <=
    ``max_pad_waste``, or P <= ``SMALL_ROWS`` with waste <= ``SMALL_PAD_WASTE``; otherwise ``loop``.
    """
    if max_rows is None:
        max_rows = MAX_ROWS_FP32 if dtype == torch.float32 else MAX_ROWS
    max_pad_waste = MAX_PAD_WASTE if max_pad_waste is None else max_pad_waste
    counts = tuple(b - a for a, b in itertools.pairwise(bounds))
    num_rows = bounds[-1]
    largest = max(counts, default=0)
    if num_rows == 0 or torch.get_num_threads() < MIN_THREADS or len(counts) < MIN_EXPERTS:
        return GmmPlan("loop", 0, counts)
    waste = len(counts) * largest / num_rows
    small = largest <= min(SMALL_ROWS, max_rows) and waste <= max(SMALL_PAD_WASTE, max_pad_waste)
    if small or (largest <= max_rows and waste <= max_pad_waste):
        return GmmPlan("padded", largest, counts)
    return GmmPlan("loop", 0, counts)


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


def _dest_rows(counts_E: tuple[int, ...], padded_rows: int) -> torch.Tensor:
    """``dest_M``: row ``i`` of expert ``e``'s group goes to padded row ``e * P + i`` (ascending)."""
    counts = torch.tensor(counts_E, dtype=torch.int64)
    real_EP = torch.arange(padded_rows) < counts[:, None]
    return real_EP.flatten().nonzero().squeeze(1)


def _pad(t_MX: torch.Tensor, dest_M: torch.Tensor, p: GmmPlan, slot: str, *, zero: bool) -> torch.Tensor:
    """``[E, P, X]`` scratch holding ``t``'s rows at ``dest_M``; padding rows zeroed only when ``zero``."""
    num_experts, width = len(p.counts), t_MX.shape[1]
    padded = _workspace.get(slot, num_experts * p.padded_rows * width, t_MX.dtype).view(-1, width)
    if zero:
        padded.zero_()
    padded.index_copy_(0, dest_M, t_MX)
    return padded.view(num_experts, p.padded_rows, width)


def _padded_product(a_MK: torch.Tensor, b_EKN: torch.Tensor, p: GmmPlan) -> torch.Tensor:
    """``a[rows_e] @ b[e]`` for all experts as one bmm; padding rows are computed and dropped."""
    num_experts, n = len(p.counts), b_EKN.shape[2]
    dest_M = _dest_rows(p.counts, p.padded_rows)
    a_EPK = _pad(a_MK, dest_M, p, "a", zero=False)
    out_EPN = _workspace.get("out", num_experts * p.padded_rows * n, a_MK.dtype).view(num_experts, p.padded_rows, n)
    torch.bmm(a_EPK, b_EKN, out=out_EPN)
    return out_EPN.view(-1, n).index_select(0, dest_M)


def _loop_backend(dtype: torch.dtype, k: int, n: int) -> GmmBackend:
    """grouped_mm's loop when it takes a ``[*, k] x [E, k, n]`` problem of ``dtype``, else the eager loop.

    All three passes ask about the *forward* problem's K and N, so they agree on one backend.
    """
    probe_x, probe_w = torch.empty(0, k, dtype=dtype), torch.empty(0, k, n, dtype=dtype)  # shapes only
    if torch_native.BACKEND.refusal(probe_x, probe_w) is None:
        return torch_native.BACKEND
    return eager.BACKEND


def forward(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    p = plan(host_bounds(group_ends_E), x_MK.dtype)
    if p.strategy == "padded":
        return _padded_product(x_MK, w_EKN, p)
    return _loop_backend(x_MK.dtype, w_EKN.shape[1], w_EKN.shape[2]).forward(x_MK, w_EKN, group_ends_E)


def grad_input(dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    p = plan(host_bounds(group_ends_E), dy_MN.dtype)
    if p.strategy == "padded":
        return _padded_product(dy_MN, w_EKN.transpose(1, 2), p)
    return _loop_backend(dy_MN.dtype, w_EKN.shape[1], w_EKN.shape[2]).grad_input(dy_MN, w_EKN, group_ends_E)


def grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    p = plan(host_bounds(group_ends_E), x_MK.dtype)
    if p.strategy == "padded":
        dest_M = _dest_rows(p.counts, p.padded_rows)
        # Both paddings zero: 0 * (NaN or stale data in the scratch) could still be NaN.
        x_EPK = _pad(x_MK, dest_M, p, "a", zero=True)
        dy_EPN = _pad(dy_MN, dest_M, p, "b", zero=True)
        return torch.bmm(x_EPK.transpose(1, 2), dy_EPN)
    return _loop_backend(x_MK.dtype, x_MK.shape[1], dy_MN.shape[1]).grad_weight(x_MK, dy_MN, group_ends_E)


BACKEND = GmmBackend(
    name="cpu",
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    forward=forward,
    grad_input=grad_input,
    grad_weight=grad_weight,
    notes="small groups: one padded bmm over all experts; large or uneven groups: grouped_mm's C++ loop",
)
