"""Rows for the time of one MoE-block training step, eager vs fused, and where it goes.

Phases (see :mod:`moe_gmm.report.timing`): the two expert grouped matmuls, permute/unpermute, host
work, the profiled step that holds them, and the whole step timed again without the profiler
(forward, loss, backward, SGD). Timings are informational rows: no speed is asserted; on a shared
machine they move with the load, so each carries its repeats and spread and a NOISY flag.
"""

from __future__ import annotations

import torch

from moe_gmm.config import ModelConfig
from moe_gmm.report.layer_checks import block_out, build_block_pair
from moe_gmm.report.model import Report, Row
from moe_gmm.report.timing import (
    PROFILED_STEP,
    TIMING_NOTE,
    measure_phases_interleaved,
    ratio_range,
    spread_notes,
    wall_step_ms,
)

__all__ = ["timing_rows"]

_SEC_PERF = "performance (ms per step; information, never pass/fail)"


def timing_rows(report: Report, opts, device: torch.device, shape: ModelConfig) -> dict[str, dict[str, float]]:
    """GMM, permute/unpermute, host and step time of one MoE-block training step, eager vs fused."""
    eager, fused = build_block_pair(shape, opts.torch_dtype, device, opts.seed, opts.backend)
    g = torch.Generator().manual_seed(opts.seed + 300)
    x_TH = torch.randn(opts.tokens, shape.hidden_size, generator=g).to(device=device, dtype=opts.torch_dtype)
    profiled_steps, warmup, repeats = (5, 2, 10) if opts.quick else (11, 3, 30)
    steps = {}
    for name, block in (("eager", eager), ("fused", fused)):
        opt = torch.optim.SGD(block.parameters(), lr=1e-3)

        def step(block=block, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            y = block_out(block, x_TH)
            y.float().square().mean().backward()
            opt.step()

        steps[name] = step
    phases = measure_phases_interleaved(steps, device, rounds=profiled_steps)
    walls = wall_step_ms(steps, device, warmup=warmup, repeats=repeats)
    times: dict[str, dict[str, float]] = {name: {**phases[name], "step": walls[name].median} for name in steps}
    spreads = {name: {**phases[name].spreads, "step": walls[name]} for name in steps}
    profiled = f"median of {profiled_steps} profiled steps"
    labels = {
        "gmm": ("GMM time (the two expert matmuls, fwd+bwd)", profiled, "moe_gmm::grouped_matmul + its 2 backward ops"),
        "permute/unpermute": (
            "permute/unpermute time (fwd+bwd)",
            profiled,
            "moe_gmm::permute/unpermute + autograd nodes",
        ),
        "host": (
            "host time",
            profiled,
            "self time of moe_gmm ops/labels (Python, checks, dispatch) + .item() syncs",
        ),
        PROFILED_STEP: (
            "MoE block step under the profiler",
            profiled,
            "wall time of the steps the rows above are from",
        ),
        "step": (
            "MoE block training step (fwd+bwd+SGD), no profiler",
            f"median of {repeats} steps",
            "a separate run without the profiler's recording",
        ),
    }
    for key, (check, metric, how) in labels.items():
        e, f = spreads["eager"][key], spreads["fused"][key]
        bounds = ratio_range(e, f)
        details = {"eager": e.as_dict(), "fused": f.as_dict(), "eager_over_fused_p20_p80": bounds}
        notes = f"{spread_notes(e, f)}; {how}"
        report.add(Row(_SEC_PERF, check, f"ms, {metric}", e.median, f.median, None, None, notes, details))
    report.notes.append(
        TIMING_NOTE + " The step without the profiler is a separate run: compare the phases with the "
        "profiled step, not with it."
    )
    return times
