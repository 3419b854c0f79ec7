"""Grouped matmul tuned for CPUs: native kernels for small experts where the CPU has AMX / AVX-512,
one library GEMM per expert with whole experts shared between the threads for the rest, and
torch-only strategies (one batched GEMM when groups are even, a per-expert loop otherwise) when
the native ops are not built.

Legend: M rows, K in-features, N out-features, E experts, P padded rows per expert,
``dest_M`` the row of the padded ``[E * P, ...]`` buffer that holds each of the M rows.

Where the time goes on a CPU (see ``benchmarks/RESULTS.md`` for the profiles):

- a per-expert loop pays per-call overhead, BLAS kernel setup for every new shape and a fork/join
  of the BLAS threads for every expert; with many small experts that dominates;
- a fresh output of tens of MiB is page-faulted in and zeroed by the kernel on first touch, which
  took longer than computing a bf16 weight gradient: every output here comes from
  :mod:`moe_gmm.ops.host_cache`, which reuses memory nothing refers to any more.

So each call picks a strategy (group sizes are read on the host: they live on the CPU):

- ``amx``: bfloat16 on a CPU with AMX, every width a multiple of 32: one native call per pass
  (:mod:`moe_gmm.ops.native`, ``grouped_gemm_amx.cpp``) splits (expert, panel) tasks between the
  threads and multiplies with AMX tiles, reading each expert's weight once. oneDNN reached
  450-700 GFLOP/s on 64-row experts where AMX tiles do 2800+ on one large GEMM. The kernels take
  experts up to a row limit per kernel (``AMX_NN_MAX_ROWS`` for the forward of an ``[E, K, N]``
  weight and the grad_input of an ``[E, N, K]`` one, ``AMX_NT_MAX_ROWS`` for the other two,
  ``AMX_GRAD_WEIGHT_MAX_ROWS``), above which oneDNN was faster.

- bfloat16 on a CPU with AVX-512 BF16 but no AMX (AMD Zen 4/5, for one), same widths:
  ``grouped_gemm_avx512_bf16.cpp``, the same three products with the same contracts on
  ``vdpbf16ps``. oneDNN ran the few-row products of many-expert layers at a fraction of the memory
  bandwidth there (E256 with 4 rows each, K1024 N512: 20 ms against 7.2 for the kernel). Row limits
  ``AVX512_BF16_NN_MAX_ROWS``, ``AVX512_BF16_NT_MAX_ROWS``, ``AVX512_BF16_GRAD_WEIGHT_MAX_ROWS``.

- float32 on a CPU with AVX-512 (``grouped_gemm_avx512.cpp``): grad_weight for experts of up to
  ``AVX512_GRAD_WEIGHT_MAX_ROWS`` rows (MKL ran 160-170 GFLOP/s on 64-row experts, the kernel
  1.3-1.6x faster), and forward and grad_input for experts of up to ``AVX512_NN_MAX_ROWS`` /
  ``AVX512_NT_MAX_ROWS`` rows (``nn`` where the multiplied matrix has contiguous rows: the forward
  of an ``[E, K, N]`` weight; ``nt`` where it has contiguous columns). Few rows stream each weight
  once; ``nn`` gives every expert 6 x 64 register blocks, ``nt`` those of 24 rows and more
  the same blocks over the weight transposed 64 x 64 (under 128 rows) or 64 x 256 at a time in a
  thread's buffer, each block of the weight prefetched while the one before it computes: 1.8x and
  2.0x faster than MKL's generic code on AMD at 1024 rows.

- ``experts`` (``experts_mm.cpp``): every expert no kernel above takes is one oneDNN / MKL GEMM on
  one thread, whole experts shared between the threads, all in one native call. A loop of
  GEMMs that each split between the threads forks and joins them once per expert, and oneDNN's
  split left one of two threads idle at some row counts (bf16 K = N = 1024: 1024-1408 rows ran
  as slowly as on one thread). grad_weight hands oneDNN the expert's input transposed into a
  contiguous buffer: with the transposed view its GEMM ran 1.9x slower.

Without the native ops (no compiler, ``MOE_GMM_NATIVE=0``), or float32 with fewer than
``EXPERTS_MM_MIN_EXPERTS_FP32`` experts, from the group sizes:

- ``padded``: every group padded to the largest group's P rows and the problem run as a few
  ``torch.bmm`` calls of ``[e, P, K] x [e, K, N]``, each over a run of experts whose padded block
  is about ``PADDED_CHUNK_BYTES``: each expert's weight is read once, in place (any strides,
  including the transposed view of an ``[E, N, K]`` parameter), the BLAS threads split the batch,
  and there is no per-expert dispatch. Chosen when padding wastes little (see :func:`plan`).
- ``loop``: one GEMM per non-empty expert: grouped_mm's C++ loop for small forward/grad_input
  outputs, else the eager backend's loop writing straight into a cached output (always for
  grad_weight). Chosen for few experts, for very uneven groups (skewed routing with many empty
  experts), where padding would multiply the work, and for float32 (MKL's fp32 GEMMs are cheap to
  call).

Padding rows never reach the outputs: forward and grad_input gather only the real rows back, and
grad_weight zero-fills the padding of both operands (so NaN left in reused memory cannot leak in),
which also makes an empty expert's gradient exactly zero.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch

from moe_gmm.ops import host_cache, native
from moe_gmm.ops.backends import eager, torch_grouped_mm
from moe_gmm.ops.backends.base import GmmBackend, host_bounds
from moe_gmm.ops.row_copy import gather_rows, zero_rows_

__all__ = ["BACKEND", "GmmPlan", "amx_available", "plan", "release_workspace"]


@dataclass(frozen=True)
class GmmPlan:
    """How one call runs: ``strategy`` and, for ``padded``, the rows per expert ``P``."""

    strategy: str  # "padded" | "loop"
    padded_rows: int
    counts: tuple[int, ...]


# Thresholds of the strategy choice, measured on the benchmark set (benchmarks/RESULTS.md).
# With 2 threads, one padded bmm beat the loop 1.7-7x whenever padding added <= ~1.4x rows: the
# loop forks and joins the BLAS threads once per expert (on a busy machine every join waits for a
# descheduled thread), while bmm splits the batch between threads once. With one thread there is
# no join to save and the loop was 1.1-1.4x faster (bmm pays the padding and the gather back), so
# ``padded`` needs >= 2 threads.
# With few experts (E=8/16, 128-2048 rows each) the loop was as fast or up to 1.3x faster at any
# thread count: there are only E joins to save, and padding plus the gather back cost more. So
# ``padded`` needs >= MIN_EXPERTS experts. float32 (MKL) never pads: its small GEMMs are cheap to
# call, and with outputs written into reused memory the loop was as fast or faster at every group
# size measured (E256 with 4 rows per expert: 41.7 ms for grouped_mm's loop, 50.4 ms padded);
# bf16/fp16 (oneDNN) pay a per-call setup that batching removes (E256, 4 rows: 1.36x faster padded).
MIN_THREADS = 2
MIN_EXPERTS = 16
MAX_ROWS = 1 << 30  # bf16/fp16: no row limit of their own; the padding waste decides
MAX_ROWS_FP32 = 0
MAX_PAD_WASTE = 1.5
SMALL_ROWS = 64
SMALL_PAD_WASTE = 3.0
GRAD_WEIGHT_ROW_MULTIPLE = 32
# Larger loop outputs come from host_cache: E8 with 2048 rows each (a 32 MiB bf16 output) took
# 45.6 ms in the eager loop against 56.6 ms in grouped_mm, whose fresh output is faulted in.
GROUPED_MM_MAX_OUT_BYTES = 4 << 20
# The padded path runs a few experts at a time, so its two scratch buffers stay this size instead
# of the whole padded problem (E64, 1024-wide bf16: 12 MiB each, held between steps).
# Measured against one bmm over all experts (bf16 fwd+bwd): 2-5% slower at 4 MiB, 6-15% at 2 MiB;
# at E64 T512 H1024 the layer's peak memory went from 1.26x to 1.21x its budget. A run holds at
# least two experts per thread, a multiple of the thread count (see _expert_chunks).
PADDED_CHUNK_BYTES = 4 << 20
# One library GEMM per expert with whole experts shared between the threads (experts_mm.cpp), for
# the experts the native kernels below leave: against a loop whose every GEMM splits between the
# threads, 2.0x faster at E8 with 1024 rows each (bf16 K = N = 1024, 5.8 against 11.9 ms; oneDNN
# ran 1024-1408-row products on one of the two threads), and in float32 1.05-1.13x on the results
# set with E >= 64 (E64 k8 T512 gate_up grad_input 68.6 against 77.3 ms). With few large float32
# experts MKL's own split was as fast or up to 7% faster (E8, 1024 rows each, K = N = 1024: 44.5
# against 46.5 ms), so float32 takes it from EXPERTS_MM_MIN_EXPERTS_FP32 experts.
# Set False to give the experts no tile or vector kernel takes to the strategies of plan().
USE_EXPERTS_MM = True
EXPERTS_MM_MIN_EXPERTS_FP32 = 16
# The AMX path (bf16). Set False to use the strategies below for bf16 too.
USE_AMX = True
BF16_ALIGN = 32  # the native bfloat16 kernels take reduced and output widths of multiples of this
# Row limits of the AMX kernels; a larger expert is one GEMM of its own (USE_EXPERTS_MM). Chosen
# by timing the results set with each limit in one process, taking turns (benchmarks/RESULTS.md),
# after a sweep of uniform experts (2 threads, M = 4096; ms AMX/GEMMs, K x N = 1024 x 1024,
# 1024 x 512, 256 x 1024):
# nn (forward of [E, K, N], grad_input of [E, N, K]): even at 16-64 rows (16: 42.4/38.1,
# 16.8/18.7, 10.7/9.5), the GEMMs ahead from 96 (8.7/6.9, 3.8/3.4, 1.65/1.64). On the results set
# 32 ran up to 1.16x faster than 64 (E64 k8 T512 gate_up forward 24.3 against 28.3 ms), and 64
# than 160 by 1.05-1.1x. On a second, slower Intel VM (its bf16 GEMM peak 700-1400 GFLOP/s), with
# all three AMX limits at 256 against 32/192/128, taking turns in alternating order (median of 7
# paired rounds): forward E128 k2 T4096 1.16-1.21x, E64 k8 T512 H2048 1.12-1.24x, skewed
# 1.06-1.18x faster, grad_input and grad_weight even (0.98-1.04x); and an E8 layer (about 128 rows
# per expert, which then no longer reach oneDNN) 1.39x -> 1.46x faster than transformers' block in
# bf16 fwd+bwd, its resident peak 1.80x -> 1.57x the budget (oneDNN's kernels for its shapes gone).
AMX_NN_MAX_ROWS = 256
# nt (the other two): the kernel ahead to 192 rows (4.3/4.9 and 1.26/1.37 at K = N = 1024 and
# K256), even at 256; the GEMMs 1.5x faster at 1024 rows (E8 k2 T4096 grad_input 6.1 against 8.9).
# 256 with the other two (above).
AMX_NT_MAX_ROWS = 256
# tn (grad_weight): oneDNN ran 48-64-row products slowly (K = N = 1024, 48 rows: 23.5 against 10.3
# ms); 128 was the fastest limit on 3 of the 4 results cases with 64-row experts (E128 k2 T4096
# gate_up 21.5 ms, against 24.0 at 96 and 28.8 at 64). 256 with the other two (above).
AMX_GRAD_WEIGHT_MAX_ROWS = 256
# The bfloat16 kernels on AVX-512 BF16 where AMX is missing (or USE_AMX is False). Against one
# oneDNN GEMM per expert on a thread (AMD EPYC Zen 5, 2 threads, uniform experts; ms oneDNN/kernel):
# nn: K1024 N512 4 rows 21.2/7.2, 16 rows 21.4/7.8; K = N = 1024 32 rows 21.3/13.3, 64 rows
# 29.1/21.2; 128 rows (E32) 11.6/9.7. nt: 4 rows 17.7/7.4, 16 rows 18.3/9.8; 32 rows 17.6/14.8.
# tn: 4 rows 13.7/6.2, 16 rows 14.2/7.0; 32 rows 13.2/12.2.
# The limits: timing the results set with each candidate in one process, taking turns (ms at
# E128 k2 T4096 gate_up, about 64 rows per expert, some more): nn 64/128/256 29.2/21.6/21.7;
# nt 32/64/128 29.8/29.3/25.9; tn 48/64/128/256 25.4/24.4/21.1/22.0, and all rows (E8, 1024
# rows each) 1.75x slower than 256. From 128 to 256 (experts of about 128 rows, as E8 top-2 with 512
# tokens, no longer reach oneDNN): the E8 layer's bf16 fwd+bwd 1.09-1.18x faster, its peak memory
# 1.69-1.74x -> 1.45-1.47x the budget (oneDNN's kernels and primitives for those shapes are gone);
# the results set's three passes even (skewed 0.96-1.04x).
USE_AVX512_BF16 = True
AVX512_BF16_NN_MAX_ROWS = 256
AVX512_BF16_NT_MAX_ROWS = 256
AVX512_BF16_GRAD_WEIGHT_MAX_ROWS = 256


# MKL runs its generic x86 code on AMD CPUs (its verbose log names "Intel(R) Architecture
# processors" where an Intel CPU gets its AVX-512 code): on 2 Zen 5 cores its float32 GEMM peaks at
# 227-240 GFLOP/s, where the AVX-512 grad_weight kernel runs 440. So there the float32 kernels
# below take larger experts than on Intel, where the limits were measured against MKL's AVX-512.
MKL_GENERIC_CODE = native.cpuinfo_value("vendor_id") == "AuthenticAMD"
# The float32 grad_weight kernel (AVX-512). Against MKL's loop (Intel Xeon, 2 threads, ms MKL/kernel):
# E256 4 rows K1024 N512 31.0/23.7; E128 64 rows K = N = 1024 115.5/82.1; E64 128 rows 77.9/71.2;
# E32 256 rows 58.3/77.1. Against one GEMM per expert on a thread each the results set ran the
# same at limits 64-128, except 64 1.15-1.25x slower at E64-E128 with 64-row experts.
USE_AVX512 = True
# On AMD (MKL_GENERIC_CODE), in one process taking turns: the kernel 1.12-1.35x faster than MKL
# at every expert size of the results set (E8 with 1024 rows each, gate_up 63.4 against 77.8 ms;
# skewed gate_up 59.1 against 79.9).
AVX512_GRAD_WEIGHT_MAX_ROWS = 4096 if MKL_GENERIC_CODE else 128
# The float32 forward of an [E, K, N] weight for experts of few rows (AVX-512, nn; also the
# grad_input of an [E, N, K] one): it streams each weight once. Against MKL's loop (Intel Xeon,
# 2 threads, ms MKL/kernel): E256 4 rows K1024 N512 45.4/33.5, 16 rows 69.9/59.8; K256 N1024 26.0/15.5 and
# 39.8/31.4; E128 32 rows K = N = 1024 76.1/113.0. Limits 8, 12 and 16 ran the same on the results
# set; with the kernel passing over each weight band once per 4 output rows, so did 16-48.
# The kernel reads bands of 16 weight rows held in registers where a band has 16 rows (E256, 4 rows
# each, K1024 N512: 1.08-1.11x faster than bands of 4 on AMD). On AMD, in one process taking
# turns, limits 16/64/128/256: E256 k8 T512 gate_up 29.9/21.0/21.5/21.0 ms, E128 k2 T4096 gate_up
# 97.2/89.3/82.7/83.2; all rows ran E8 (1024 rows each) 1.4-1.5x slower. Since experts of 32 rows
# and more take 6 x 64 register blocks instead of the bands, the kernel is ahead of MKL's generic
# code at every expert size (limits 128/4096, forward ms: E8 k2 T4096 gate_up 83.7/47.0, down
# 43.2/23.0; skewed gate_up 79.6/45.5, down 41.9/21.1; the rest even). The blocks now take every
# expert (since they read the weight's next chunk ahead, 1.05-1.9x faster than the bands at 1-7
# rows on AMD). On an Intel Xeon (Sapphire Rapids class, MKL's AVX-512 code), in one process taking
# turns, limits 16/64/256 (forward ms): E256 k8 T512 gate_up 76.4/50.1/50.4, down 53.6/33.9/33.1;
# E128 k2 T4096 (about 64 rows) gate_up 169.9/150.6/131.3, down 86.1/73.7/61.9; E64 k8 T512 H2048
# gate_up 162.6/151.3/120.1, down 86.3/76.8/69.1; E8 (1024 rows) and skewed even (0.95-1.02x).
AVX512_NN_MAX_ROWS = 4096 if MKL_GENERIC_CODE else 256
# The float32 grad_input of an [E, K, N] weight (and forward of an [E, N, K] one) for experts of few
# rows (AVX-512, nt). Against one MKL GEMM per expert on a thread (Intel Xeon, ms MKL/kernel, E256): 4 rows
# K1024 N512 32.5/26.5, 16 rows 52.6/42.9; K256 N1024 12.0/9.6 and 19.9/20.1; E128 8 rows
# K = N = 1024 43.9/21.9; E64 32 rows 25.5/34.5.
# On AMD, limits 16/64/128: E256 k8 T512 gate_up 33.2/27.6/27.5 ms, E128 k2 T4096 gate_up
# 97.1/99.5/103.6; all rows ran E8 1.6x slower. 32 takes the first experts (about 16 rows each).
# Since experts of 16 rows and more take the nn blocks over the weight transposed in blocks, the
# kernel is ahead of MKL's generic code at every expert size (limits 32/4096, grad_input ms: E8 k2
# T4096 gate_up 80.3/40.1, down 40.6/21.0; E128 k2 T4096 gate_up 98.1/51.9; skewed gate_up
# 84.7/41.5, down 43.5/21.4; E256 T512 gate_up 27.7/25.3). On the Intel Xeon above, limits
# 16/32/64 (grad_input ms): E256 k8 T512 gate_up 71.1/40.8/39.0, down 27.3/21.2/20.4; E128 k2 T4096
# gate_up 120.8/111.6/143.6, down 67.6/58.8/72.9; E64 k8 T512 H2048 gate_up 163.9/160.8/178.8,
# down 80.8/83.2/94.9; skewed even. MKL's AVX-512 code is ahead from about 64 rows there.
AVX512_NT_MAX_ROWS = 4096 if MKL_GENERIC_CODE else 32


def plan(
    bounds: list[int],
    dtype: torch.dtype = torch.bfloat16,
    *,
    max_rows: int | None = None,
    max_pad_waste: float | None = None,
) -> GmmPlan:
    """Choose the strategy for group bounds ``[0, end_0, ..., end_{E-1}]`` (defaults: the module's thresholds).

    ``padded`` when torch runs at least ``MIN_THREADS`` intra-op threads, there are at least
    ``MIN_EXPERTS`` experts, and the largest group P and the
    padding waste ``E * P / M`` are both small enough: P <= ``max_rows`` (``MAX_ROWS``, or
    ``MAX_ROWS_FP32`` for float32) with waste <= ``max_pad_waste``, or P <= ``SMALL_ROWS`` with
    waste <= ``SMALL_PAD_WASTE``; otherwise ``loop``.
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
    scatter) took 1.2 ms where the gather took a fraction of it on the same rows.
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


def _expert_chunks(p: GmmPlan, rows: int, width: int, dtype: torch.dtype) -> list[tuple[int, int, int, int]]:
    """``(e0, e1, r0, r1)``: runs of experts whose padded ``[e1 - e0, rows, width]`` block is about
    ``PADDED_CHUNK_BYTES``, with the real rows ``r0:r1`` they own (contiguous: groups are in order)."""
    per_expert = max(1, rows * width * dtype.itemsize)
    threads = max(1, torch.get_num_threads())
    # bmm splits its batch between the threads: a run of experts that is a multiple of the thread
    # count, and at least two per thread, keeps them evenly busy (3 experts on 2 threads left one
    # idle a third of the time: E64 T2048 H2048 forward 79.5 ms against 63.0 for one bmm).
    step = max(PADDED_CHUNK_BYTES // per_expert, 2 * threads)
    step -= step % threads
    # Runs of one size where E allows: oneDNN compiles and caches a kernel per bmm shape (about
    # 1 MiB each), so a remainder run is a second shape to hold.
    even = [d for d in range(step, threads - 1, -threads) if len(p.counts) % d == 0]
    if even and even[0] * 2 > step:
        step = even[0]
    bounds = list(itertools.accumulate(p.counts, initial=0))
    return [
        (e0, min(e0 + step, len(p.counts)), bounds[e0], bounds[min(e0 + step, len(p.counts))])
        for e0 in range(0, len(p.counts), step)
    ]


def _padded_product(a_MK: torch.Tensor, b_EKN: torch.Tensor, p: GmmPlan) -> torch.Tensor:
    """``a[rows_e] @ b[e]`` for all experts as a few bmm calls; padding rows are computed and dropped."""
    n = b_EKN.shape[2]
    out_MN = host_cache.empty((a_MK.shape[0], n), dtype=a_MK.dtype)
    width = max(a_MK.shape[1], n)
    for e0, e1, r0, r1 in _expert_chunks(p, p.padded_rows, width, a_MK.dtype):
        counts = p.counts[e0:e1]
        a_EPK = _pad(a_MK[r0:r1], counts, p.padded_rows, "a", zero=False)
        # Slot "b" (grad_weight's second operand) is free here: two scratch buffers serve every call.
        out_EPN = _workspace.get("b", (e1 - e0) * p.padded_rows * n, a_MK.dtype).view(e1 - e0, p.padded_rows, n)
        torch.bmm(a_EPK, b_EKN[e0:e1], out=out_EPN)
        gather_rows(out_EPN.view(-1, n), _row_layout(counts, p.padded_rows).dest_M, out=out_MN[r0:r1])
    return out_MN


def _loop_for(w_EKN: torch.Tensor, out_rows: int, out_width: int) -> GmmBackend:
    """The loop for a forward or grad_input pass with an ``[out_rows, out_width]`` output.

    grouped_mm's C++ loop for outputs up to ``GROUPED_MM_MAX_OUT_BYTES`` (it pays less per expert
    than a Python loop: 1.43 against 1.79 ms for 8 experts of 128 rows, 2.6 against 3.7 ms for 256
    experts of 2), else the eager loop writing into a cached output (grouped_mm allocates a fresh
    one, page-faulted in on every call). Asks grouped_mm about the weight's *forward* problem
    (K and N) in both passes, so an unaligned shape takes the eager loop in both.
    """
    if out_rows * out_width * w_EKN.element_size() > GROUPED_MM_MAX_OUT_BYTES:
        return eager.BACKEND
    k, n = w_EKN.shape[1], w_EKN.shape[2]
    probe_x, probe_w = torch.empty(0, k, dtype=w_EKN.dtype), torch.empty(0, k, n, dtype=w_EKN.dtype)  # shapes only
    if torch_grouped_mm.BACKEND.refusal(probe_x, probe_w) is None:
        return torch_grouped_mm.BACKEND
    return eager.BACKEND


def amx_available() -> bool:
    """Whether bfloat16 calls can take the AMX path here (native kernels built, CPU with AMX, OS grant)."""
    ops = native.ops()
    return ops is not None and _amx_granted(ops)


_cpu_support: dict[str, bool] = {}  # what the CPU and build support, asked once
_cpu_limits: dict[str, int] = {}  # the native kernels' own row limits, asked once


def _amx_granted(ops) -> bool:
    return _supported(ops, "amx")


@dataclass(frozen=True)
class _Bf16Kernels:
    """A family of native bfloat16 kernels (``amx`` or ``avx512_bf16``): its ops and row limits."""

    family: str
    ops: object

    def op(self, product: str):
        return getattr(self.ops, f"{self.family}_gemm_{product}")

    def max_rows(self, product: str) -> int:
        # read at call time: the limits are module settings (tests and sweeps change them)
        limits = {
            "amx": {"nn": AMX_NN_MAX_ROWS, "nt": AMX_NT_MAX_ROWS, "tn": AMX_GRAD_WEIGHT_MAX_ROWS},
            "avx512_bf16": {
                "nn": AVX512_BF16_NN_MAX_ROWS,
                "nt": AVX512_BF16_NT_MAX_ROWS,
                "tn": AVX512_BF16_GRAD_WEIGHT_MAX_ROWS,
            },
        }
        return limits[self.family][product]


def _bf16_kernels(*tensors: torch.Tensor, widths: tuple[int, ...]) -> _Bf16Kernels | None:
    """The native bfloat16 kernels that take these operands and ``widths`` (AMX where granted, else
    AVX-512 BF16), or None."""
    if any(t.dtype != torch.bfloat16 for t in tensors) or any(w % BF16_ALIGN for w in widths):
        return None
    ops = native.ops(*tensors)
    if ops is None:
        return None
    if USE_AMX and _amx_granted(ops):
        return _Bf16Kernels("amx", ops)
    if USE_AVX512_BF16 and _supported(ops, "avx512_bf16"):
        return _Bf16Kernels("avx512_bf16", ops)
    return None


def _supported(ops, family: str) -> bool:
    if family not in _cpu_support:
        _cpu_support[family] = bool(getattr(ops, f"{family}_gemm_supported")())
    return _cpu_support[family]


def _avx512(*tensors: torch.Tensor):
    """The native ops when the AVX-512 float32 kernels take these operands, else None."""
    if not USE_AVX512 or any(t.dtype != torch.float32 for t in tensors):
        return None
    ops = native.ops(*tensors)
    return ops if ops is not None and _supported(ops, "avx512") else None


def _weight_layout(w_EKN: torch.Tensor) -> str | None:
    """``"EKN"`` (N contiguous), ``"ENK"`` (K contiguous: the transposed view of an ``[E, N, K]``
    parameter), or None when neither holds (the AMX kernels need one unit stride, the other even)."""
    if w_EKN.stride(2) == 1 and w_EKN.stride(1) % 2 == 0:
        return "EKN"
    if w_EKN.stride(1) == 1 and w_EKN.stride(2) % 2 == 0:
        return "ENK"
    return None


def _unit_rows(t_MX: torch.Tensor) -> torch.Tensor:
    # Not .contiguous(): it keeps any stride of a size-1 dimension, e.g. the (0, 0) of a [1, 1] expanded grad.
    return t_MX if t_MX.stride(1) == 1 else t_MX.clone(memory_format=torch.contiguous_format)


def _ends(group_ends_E: torch.Tensor) -> torch.Tensor:
    return group_ends_E.to(torch.int64).contiguous()


def _any_small(bounds: list[int], max_rows: int) -> bool:
    return any(0 < end - start <= max_rows for start, end in itertools.pairwise(bounds))


def _experts_ops(*tensors: torch.Tensor, num_experts: int):
    """The native ops when one library GEMM per expert, whole experts per thread
    (``experts_mm.cpp``), takes these operands; else None (the plan's path)."""
    if not USE_EXPERTS_MM or tensors[0].shape[0] == 0:
        return None
    if tensors[0].dtype == torch.float32 and num_experts < EXPERTS_MM_MIN_EXPERTS_FP32:
        return None
    return native.ops(*tensors)


def _bf16_product(a_MR: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor, *, transpose_w: bool):
    """``a[rows_e] @ w[e]`` (or ``@ w[e]^T``) by the native bfloat16 kernels, their large experts
    one GEMM each; None when they do not apply."""
    k, n = w_EKN.shape[1], w_EKN.shape[2]
    if a_MR.shape[0] == 0 or (n if transpose_w else k) == 0:
        return None  # an empty reduction: the library path writes its zeros
    layout = _weight_layout(w_EKN)
    kernels = _bf16_kernels(a_MR, w_EKN, widths=(k, n)) if layout is not None else None
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


def _few_rows_product(a_MR: torch.Tensor, w_ERJ: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor | None:
    """float32 ``a[rows_e] @ w[e]`` by the AVX-512 streaming kernels for experts of few rows (``nn``
    where ``w``'s rows are contiguous, ``nt`` where its columns are), the others one GEMM each on a
    thread; None when it does not apply (no such expert, another layout, no AVX-512)."""
    if a_MR.shape[0] == 0:
        return None
    ops = _avx512(a_MR, w_ERJ)
    if ops is None:
        return None
    if w_ERJ.stride(2) == 1:
        kernel, b, max_rows = ops.avx512_gemm_nn_few_rows, w_ERJ, AVX512_NN_MAX_ROWS
    elif w_ERJ.stride(1) == 1:
        kernel, b, max_rows = ops.avx512_gemm_nt_few_rows, w_ERJ.transpose(1, 2), AVX512_NT_MAX_ROWS
    else:
        return None
    if not _any_small(host_bounds(group_ends_E), max_rows):
        return None
    out = host_cache.empty((a_MR.shape[0], w_ERJ.shape[2]), dtype=a_MR.dtype)
    ends = _ends(group_ends_E)
    kernel(_unit_rows(a_MR), b, ends, max_rows, out)
    ops.experts_mm(a_MR, w_ERJ, ends, max_rows, out)
    return out


def _experts_product(a_MR: torch.Tensor, w_ERJ: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor | None:
    """``a[rows_e] @ w[e]`` as one library GEMM per expert, whole experts per thread; None when
    the native ops do not take these operands."""
    ops = _experts_ops(a_MR, w_ERJ, num_experts=w_ERJ.shape[0])
    if ops is None:
        return None
    out = host_cache.empty((a_MR.shape[0], w_ERJ.shape[2]), dtype=a_MR.dtype)
    ops.experts_mm(a_MR, w_ERJ, _ends(group_ends_E), 0, out)
    return out


def forward(x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    out = _bf16_product(x_MK, w_EKN, group_ends_E, transpose_w=False)
    if out is None:
        out = _few_rows_product(x_MK, w_EKN, group_ends_E)
    if out is None:
        out = _experts_product(x_MK, w_EKN, group_ends_E)
    if out is not None:
        return out
    p = plan(host_bounds(group_ends_E), x_MK.dtype)
    if p.strategy == "padded":
        return _padded_product(x_MK, w_EKN, p)
    return _loop_for(w_EKN, x_MK.shape[0], w_EKN.shape[2]).forward(x_MK, w_EKN, group_ends_E)


def grad_input(dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    out = _bf16_product(dy_MN, w_EKN, group_ends_E, transpose_w=True)
    if out is None:
        out = _few_rows_product(dy_MN, w_EKN.transpose(1, 2), group_ends_E)
    if out is None:
        out = _experts_product(dy_MN, w_EKN.transpose(1, 2), group_ends_E)
    if out is not None:
        return out
    p = plan(host_bounds(group_ends_E), dy_MN.dtype)
    if p.strategy == "padded":
        return _padded_product(dy_MN, w_EKN.transpose(1, 2), p)
    return _loop_for(w_EKN, dy_MN.shape[0], w_EKN.shape[1]).grad_input(dy_MN, w_EKN, group_ends_E)


def _native_grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor | None:
    """grad_weight by the native bfloat16 (AMX, AVX-512 BF16) or float32 (AVX-512) kernel for
    experts up to its row limit and one GEMM per expert for the rest, or all by one GEMM per
    expert; None when the native ops do not take these operands."""
    k, n = x_MK.shape[1], dy_MN.shape[1]
    if x_MK.shape[0] == 0:  # no rows (strides of an empty tensor are arbitrary): the plan's path
        return None
    num_experts = group_ends_E.shape[0]
    ops, kernel, max_rows = None, None, -1
    if (kernels := _bf16_kernels(x_MK, dy_MN, widths=(k, n))) is not None:
        ops, kernel, max_rows = kernels.ops, kernels.op("tn"), kernels.max_rows("tn")
    elif (ops := _avx512(x_MK, dy_MN)) is not None:
        kernel, max_rows = ops.avx512_gemm_tn, AVX512_GRAD_WEIGHT_MAX_ROWS
    elif (ops := _experts_ops(x_MK, dy_MN, num_experts=num_experts)) is None:
        return None
    dw_EKN = host_cache.empty((num_experts, k, n), dtype=x_MK.dtype)
    ends = _ends(group_ends_E)
    if kernel is not None:
        kernel(_unit_rows(x_MK), _unit_rows(dy_MN), ends, max_rows, dw_EKN)
    ops.experts_mm_tn(x_MK, dy_MN, ends, max_rows, dw_EKN)
    return dw_EKN


def grad_weight(x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
    dw_EKN = _native_grad_weight(x_MK, dy_MN, group_ends_E)
    if dw_EKN is not None:
        return dw_EKN
    p = plan(host_bounds(group_ends_E), x_MK.dtype)
    if p.strategy == "padded":
        # P is the reduction dimension here: a multiple of 32 keeps oneDNN's bf16 (AMX/VNNI) kernel on
        # its fast path (E64 P80 took 11.1 ms, P96 8.7 ms). Both paddings zero: 0 * (NaN or stale
        # data in the scratch) could still be NaN.
        rows = -(-p.padded_rows // GRAD_WEIGHT_ROW_MULTIPLE) * GRAD_WEIGHT_ROW_MULTIPLE
        if x_MK.dtype == torch.float32:
            rows = p.padded_rows
        dw_EKN = host_cache.empty((len(p.counts), x_MK.shape[1], dy_MN.shape[1]), dtype=x_MK.dtype)
        width = max(x_MK.shape[1], dy_MN.shape[1])
        for e0, e1, r0, r1 in _expert_chunks(p, rows, width, x_MK.dtype):
            x_EPK = _pad(x_MK[r0:r1], p.counts[e0:e1], rows, "a", zero=True)
            dy_EPN = _pad(dy_MN[r0:r1], p.counts[e0:e1], rows, "b", zero=True)
            torch.bmm(x_EPK.transpose(1, 2), dy_EPN, out=dw_EKN[e0:e1])
        return dw_EKN
    return eager.grad_weight(x_MK, dy_MN, group_ends_E)


BACKEND = GmmBackend(
    name="cpu",
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    forward=forward,
    grad_input=grad_input,
    grad_weight=grad_weight,
    notes="bf16 with AMX or AVX-512 BF16: native kernels; fp32 with AVX-512: native grad_weight and few-row "
    "forward and grad_input; "
    "else small even groups: padded bmm over runs of experts, large or uneven groups: a GEMM loop",
)
