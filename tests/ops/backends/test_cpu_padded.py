"""The ``cpu`` backend's padded strategy (``padded``): runs of experts per bmm.

The padded passes themselves are held to the contract in test_cpu_planning.py (``strategy`` fixture).
"""

from __future__ import annotations

import pytest
import torch

from moe_gmm.ops.backends import cpu
from moe_gmm.ops.backends.cpu import padded


@pytest.mark.parametrize("num_experts", [1, 7, 16, 60, 64, 256])
@pytest.mark.parametrize("chunk_bytes", [1, 64 << 10, 4 << 20])
def test_expert_runs_cover_every_expert_in_order(num_experts, chunk_bytes):
    counts = tuple((e * 7) % 5 for e in range(num_experts))
    p = cpu.GmmPlan("padded", max(counts), counts)
    with cpu.use_tuning(padded_chunk_bytes=chunk_bytes):
        runs = padded.expert_chunks(p, rows=8, width=1024, dtype=torch.bfloat16)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    assert [r[0] for r in runs] == [0, *(r[1] for r in runs[:-1])] and runs[-1][1] == num_experts
    assert all((r[2], r[3]) == (bounds[r[0]], bounds[r[1]]) for r in runs)
    threads = torch.get_num_threads()
    sizes = [r[1] - r[0] for r in runs]
    assert all(size % threads == 0 for size in sizes[:-1]), "every run but the last splits evenly between threads"
    if num_experts in (16, 64, 256) and threads in (1, 2, 4):
        assert len(set(sizes)) == 1, "E with a fitting divisor runs in one bmm shape"
