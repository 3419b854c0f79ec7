"""What ``moe-gmm train`` writes: the loss-alignment report, ``losses.csv`` and ``losses.png``.

The report judges one thing, the fused path's loss against the eager path's, step by step, with
the dtype's tolerance (``|fused - eager| <= atol + rtol |eager|``); losses must also fall. It names
each experts module's implementation and grouped-matmul backend on both paths. Times are
informational, each with its repeats, spread and a NOISY flag (:mod:`moe_gmm.report.timing`).
"""

from __future__ import annotations

import csv
import importlib.util
import math
import re
from pathlib import Path

import torch

from moe_gmm.config import RunConfig
from moe_gmm.report.model import Report, Row
from moe_gmm.report.timing import PROFILED_STEP, TIMING_NOTE, Spread, spread_notes
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


def loss_report(
    cfg: RunConfig, losses, step_ms, phases, dtype, mesh_shape: tuple[int, int], experts=None
) -> tuple[Report, float | None]:
    """The report: loss rows, then (``experts``: ``{path: describe_experts(model)}``) each experts
    module's implementation and backend per path, then the times with their spread.

    ``mesh_shape``: the ``(dp, ep)`` sizes the run trained on (``(1, 1)`` in one process)."""
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
            "data_parallel_size": mesh_shape[0],
            "expert_parallel_size": mesh_shape[1],
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
    if experts:
        _experts_rows(report, experts)
    _time_rows(report, step_ms, phases)
    return report, max_diff


def _index_ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    runs: list[list[int]] = []
    for i in sorted(indices):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _experts_rows(report: Report, experts) -> None:
    """One row per group of experts modules that differ only by a layer index and run alike."""
    by_name: dict[str, dict[str, str]] = {}
    for path, descriptions in experts.items():
        for d in descriptions:
            by_name.setdefault(d.name, {})[path] = f"{d.implementation}: {d.backend}"
    groups: dict[tuple, list[int | None]] = {}
    for name, per_path in by_name.items():
        match = re.search(r"\.(\d+)\.", name)
        pattern = name[: match.start(1)] + "*" + name[match.end(1) :] if match else name
        key = (pattern, per_path.get("eager"), per_path.get("fused"))
        groups.setdefault(key, []).append(int(match.group(1)) if match else None)
    for (pattern, eager, fused), indices in groups.items():
        numbered = [i for i in indices if i is not None]
        check = pattern.replace("*", f"{{{_index_ranges(numbered)}}}") if numbered else pattern
        note = f"{len(indices)} module(s)" + ("; implementation: grouped-matmul backend" if fused or eager else "")
        report.add(Row("experts (implementation: backend)", check, "runs on", eager, fused, None, None, note))


def _step_spread(ms: list[float]) -> tuple[Spread, float | None]:
    # Step 1 holds first-call work (allocation, kernel builds and loads): left out of the spread.
    if len(ms) > 1:
        return Spread.of(ms[1:]), ms[0]
    return Spread.of(ms), None


def _time_rows(report: Report, step_ms, phases) -> None:
    sec = "time (ms per step; information, never pass/fail)"
    steps = {p: _step_spread(v) for p, v in step_ms.items() if v}
    if steps:
        spreads = {p: sp for p, (sp, _) in steps.items()}
        firsts = [f"{p} {first:.3g} ms" for p, (_, first) in steps.items() if first is not None]
        counts = sorted({sp.repeats for sp in spreads.values()})
        notes = spread_notes(spreads.get("eager"), spreads.get("fused"))
        notes += "; whole model: forward, loss, backward, clip, AdamW"
        if firsts:
            notes += "; step 1 left out (first-call work): " + ", ".join(firsts)
        report.add(
            Row(
                sec,
                "training step",
                f"ms, median of {'/'.join(map(str, counts))} steps",
                spreads["eager"].median if "eager" in spreads else None,
                spreads["fused"].median if "fused" in spreads else None,
                None,
                None,
                notes,
                {p: sp.as_dict() for p, sp in spreads.items()},
            )
        )
    notes = {
        "gmm": "the two expert matmuls of every MoE layer, fwd+bwd",
        "permute/unpermute": "token permute/unpermute of every MoE layer, fwd+bwd",
        "host": "Python, checks and dispatch outside aten kernels (whole model) + host syncs",
        PROFILED_STEP: "wall time of the profiled steps the rows above are from",
    }
    for key, note in notes.items():
        found = {p: ph.spreads[key] for p, ph in phases.items() if key in getattr(ph, "spreads", {})}
        if not found:
            continue
        counts = sorted({sp.repeats for sp in found.values()})
        report.add(
            Row(
                sec,
                f"{key} (profiler)",
                f"ms, median of {'/'.join(map(str, counts))} profiled steps",
                found["eager"].median if "eager" in found else None,
                found["fused"].median if "fused" in found else None,
                None,
                None,
                f"{spread_notes(found.get('eager'), found.get('fused'))}; {note}",
                {p: sp.as_dict() for p, sp in found.items()},
            )
        )
    if steps or any(phases.values()):
        report.notes.append(
            TIMING_NOTE + " The training step is timed apart from the profiled steps, which the profiler lengthens."
        )


def _finite(v: float) -> bool:
    return math.isfinite(v)
