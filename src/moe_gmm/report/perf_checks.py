"""Rows for the time of one MoE-block training step, eager vs fused, and where it goes.

Phases (see :mod:`moe_gmm.report.timing`): the two expert grouped matmuls, permute/unpermute, host
work, and the whole step (forward, loss, backward, SGD). Timings are informational rows: no
speed is asserted, on a shared machine they move with the load; the spread is reported.
"""

from __future__ import annotations

import torch

from moe_gmm.config import ModelConfig
from moe_gmm.report.layer_checks import block_out, build_block_pair
from moe_gmm.report.model import Report, Row
from moe_gmm.report.timing import measure_phases_interleaved, median_step_ms

__all__ = ["timing_rows"]

_SEC_PERF = "performance (ms per step)"


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
    times: dict[str, dict[str, float]] = {name: dict(phases[name]) for name in steps}
    walls = median_step_ms(steps, device, warmup=warmup, repeats=repeats)
    spreads = {}
    for name, (median, spread) in walls.items():
        times[name]["step"] = median
        spreads[name] = spread
    labels = {
        "gmm": ("GMM time (the two expert matmuls, fwd+bwd)", "moe_gmm::grouped_matmul + its 2 backward ops"),
        "permute/unpermute": ("permute/unpermute time (fwd+bwd)", "moe_gmm::permute/unpermute + autograd nodes"),
        "host": ("host time", "self time of moe_gmm ops/labels (Python, checks, dispatch) + .item() syncs"),
        "step": ("MoE block training step (fwd+bwd+SGD)", f"median of {repeats}, interleaved, no profiler"),
    }
    for key, (check, how) in labels.items():
        e, f = times["eager"][key], times["fused"][key]
        speedup = f"eager/fused {e / f:.2f}x" if f > 0 else "fused time 0"
        notes = f"{speedup}; {how}"
        if key != "step":
            notes += f"; profiler, median of {profiled_steps} interleaved steps"
        if key == "step":
            notes += f"; spread eager {spreads['eager']:.2f} ms, fused {spreads['fused']:.2f} ms"
        report.add(Row(_SEC_PERF, check, "ms", e, f, None, None, notes))
    return times
