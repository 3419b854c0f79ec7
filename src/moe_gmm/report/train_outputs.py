"""What ``moe-gmm train`` writes: the loss-alignment report, ``losses.csv`` and ``losses.png``.

The report judges one thing, the fused path's loss against the eager path's, step by step, with
the dtype's tolerance (``|fused - eager| <= atol + rtol |eager|``); losses must also fall. Times
are informational.
"""

from __future__ import annotations

import csv
import importlib.util
import math
import statistics
from pathlib import Path

import torch

from moe_gmm.config import RunConfig
from moe_gmm.report.model import Report, Row
from moe_gmm.testing import tolerance_for

__all__ = ["loss_report", "write_outputs"]


def write_outputs(report: Report, out: Path, losses, step_ms) -> dict[str, Path]:
    from moe_gmm.report.render import write_report

    files = write_report(report, out)
    files["markdown"] = files["markdown"].rename(out / "train_report.md")
    files["json"] = files["json"].rename(out / "train_report.json")
    files["csv"] = _write_csv(out / "losses.csv", losses, step_ms)
    if importlib.util.find_spec("matplotlib") is not None:  # the optional "plot" extra
        from moe_gmm.report.plots import plot_loss_curves

        files["plot"] = plot_loss_curves(losses, out / "losses.png")
    return files


def _write_csv(path: Path, losses: dict[str, list[float]], step_ms: dict[str, list[float]]) -> Path:
    names = list(losses)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        header = ["step", *[f"loss_{n}" for n in names], *[f"step_ms_{n}" for n in names]]
        if "fused" in losses and "eager" in losses:
            header.append("abs_diff")
        w.writerow(header)
        for i in range(len(losses[names[0]])):
            row = [i + 1, *[f"{losses[n][i]:.8f}" for n in names], *[f"{step_ms[n][i]:.3f}" for n in names]]
            if "abs_diff" in header:
                row.append(f"{abs(losses['fused'][i] - losses['eager'][i]):.3e}")
            w.writerow(row)
    return path


def loss_report(cfg: RunConfig, losses, step_ms, phases, dtype, world: int) -> tuple[Report, float | None]:
    tol = tolerance_for(dtype)
    report = Report(
        title="moe-gmm train: fused vs eager loss alignment",
        meta={
            "model": cfg.model.model_id,
            "dtype": cfg.dtype,
            "device": cfg.device,
            "seed": cfg.seed,
            "steps": len(next(iter(losses.values()))),
            "E": cfg.model.num_experts,
            "top_k": cfg.model.num_experts_per_tok,
            "layers": cfg.model.num_hidden_layers,
            "expert_parallel_size": world,
            "torch": torch.__version__,
        },
    )
    sec = "loss"
    get = lambda p, i: losses[p][i] if p in losses else None
    report.add(Row(sec, "first loss", "loss", get("eager", 0), get("fused", 0), None, None))
    report.add(Row(sec, "final loss", "loss", get("eager", -1), get("fused", -1), None, None))
    for p in losses:
        falling = losses[p][-1] < losses[p][0]
        report.add(
            Row(
                sec,
                f"loss decreases ({p})",
                "final < first",
                losses[p][0],
                losses[p][-1],
                None,
                falling and all(map(_finite, losses[p])),
                "eager column: first loss, fused column: final loss",
            )
        )
    max_diff = None
    if "fused" in losses and "eager" in losses:
        diffs = [abs(f - e) for f, e in zip(losses["fused"], losses["eager"])]
        bounds = [tol.atol + tol.rtol * abs(e) for e in losses["eager"]]
        worst = max(range(len(diffs)), key=lambda i: diffs[i] / bounds[i])
        max_diff = max(diffs)
        report.add(
            Row(
                sec,
                "max |loss_fused - loss_eager| over steps",
                "abs diff",
                None,
                max_diff,
                f"rtol={tol.rtol:g} atol={tol.atol:g}",
                all(d <= b for d, b in zip(diffs, bounds)),
                f"worst step {worst + 1}; per-step values in losses.csv",
                details={"per_step": diffs},
            )
        )
    sec = "time (ms per step)"
    get_ms = lambda p: statistics.median(step_ms[p]) if p in step_ms else None
    report.add(
        Row(
            sec,
            "training step (median)",
            "ms",
            get_ms("eager"),
            get_ms("fused"),
            None,
            None,
            "whole model: forward, loss, backward, clip, AdamW",
        )
    )
    notes = {
        "gmm": "the two expert matmuls of every MoE layer, fwd+bwd",
        "permute/unpermute": "token permute/unpermute of every MoE layer, fwd+bwd",
        "host": "Python, checks and dispatch outside aten kernels (whole model) + host syncs",
    }
    for key, note in notes.items():
        if any(key in ph for ph in phases.values()):
            report.add(
                Row(
                    sec,
                    f"{key} (profiler, per step)",
                    "ms",
                    phases.get("eager", {}).get(key),
                    phases.get("fused", {}).get(key),
                    None,
                    None,
                    note,
                )
            )
    return report, max_diff


def _finite(v: float) -> bool:
    return math.isfinite(v)
