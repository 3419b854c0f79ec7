"""Strategy choice for the calls no native kernel takes: a padded ``bmm`` or a GEMM loop.

Group sizes are read on the host (they live on the CPU). ``padded`` runs every group padded to
the largest group's P rows as a few ``torch.bmm`` calls: each weight is read once, in place, with
no per-expert dispatch, and the BLAS threads split the batch once. ``loop`` runs one GEMM per
non-empty expert: for few experts, very uneven groups (padding would multiply the work) and float32.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from moe_gmm.ops.backends import eager, torch_grouped_mm
from moe_gmm.ops.backends.base import GmmBackend
from moe_gmm.ops.backends.cpu.tuning import CpuTuning, current_tuning

__all__ = ["GmmPlan", "loop_for", "plan"]


@dataclass(frozen=True)
class GmmPlan:
    """How one call runs: ``strategy`` and, for ``padded``, the rows per expert ``P``."""

    strategy: str  # "padded" | "loop"
    padded_rows: int
    counts: tuple[int, ...]


def plan(
    bounds: list[int],
    dtype: torch.dtype = torch.bfloat16,
    *,
    max_rows: int | None = None,
    max_pad_waste: float | None = None,
    tuning: CpuTuning | None = None,
) -> GmmPlan:
    """Choose the strategy for group bounds ``[0, end_0, ..., end_{E-1}]``.

    Thresholds from ``tuning`` (default: the tuning in force). ``padded`` when torch runs at
    least ``min_threads`` intra-op threads, there are at least ``min_experts`` experts, and the
    largest group P and the padding waste ``E * P / M`` are both small enough: P <= ``max_rows``
    (``max_rows``, or ``max_rows_fp32`` for float32) with waste <= ``max_pad_waste``, or
    P <= ``small_rows`` with waste <= ``small_pad_waste``; otherwise ``loop``.
    """
    t = current_tuning() if tuning is None else tuning
    if not isinstance(t, CpuTuning):
        raise TypeError(f"plan: tuning must be a CpuTuning or None, got {type(t).__name__}")
    if max_rows is None:
        max_rows = t.max_rows_fp32 if dtype == torch.float32 else t.max_rows
    max_pad_waste = t.max_pad_waste if max_pad_waste is None else max_pad_waste
    counts = tuple(b - a for a, b in itertools.pairwise(bounds))
    num_rows = bounds[-1]
    largest = max(counts, default=0)
    if num_rows == 0 or torch.get_num_threads() < t.min_threads or len(counts) < t.min_experts:
        return GmmPlan("loop", 0, counts)
    waste = len(counts) * largest / num_rows
    small = largest <= min(t.small_rows, max_rows) and waste <= max(t.small_pad_waste, max_pad_waste)
    if small or (largest <= max_rows and waste <= max_pad_waste):
        return GmmPlan("padded", largest, counts)
    return GmmPlan("loop", 0, counts)


def loop_for(w_EKN: torch.Tensor, out_rows: int, out_width: int) -> GmmBackend:
    """The loop for a forward or grad_input pass with an ``[out_rows, out_width]`` output.

    grouped_mm's C++ loop for outputs up to ``grouped_mm_max_out_bytes`` (it pays less per expert
    than a Python loop), else the eager loop writing into a cached output (grouped_mm allocates a
    fresh one, page-faulted in on every call). Asks grouped_mm about the weight's *forward* problem
    (K and N) in both passes, so an unaligned shape takes the eager loop in both.
    """
    if out_rows * out_width * w_EKN.element_size() > current_tuning().grouped_mm_max_out_bytes:
        return eager.BACKEND
    k, n = w_EKN.shape[1], w_EKN.shape[2]
    probe_x, probe_w = torch.empty(0, k, dtype=w_EKN.dtype), torch.empty(0, k, n, dtype=w_EKN.dtype)  # shapes only
    if torch_grouped_mm.BACKEND.refusal(probe_x, probe_w) is None:
        return torch_grouped_mm.BACKEND
    return eager.BACKEND
