"""The train report's backend and time rows, from given losses, step times and experts modules."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.config import RunConfig
from moe_gmm.integrations.transformers import ExpertsDescription
from moe_gmm.report.timing import PROFILED_STEP, PhaseTimes, Spread
from moe_gmm.report.train_outputs import loss_report

LOSSES = {"fused": [5.0, 4.0, 3.5, 3.0, 2.9, 2.8], "eager": [5.0, 4.0, 3.5, 3.0, 2.9, 2.8]}


def _experts(path: str, backend: str) -> list[ExpertsDescription]:
    impl = "moe_gmm" if path == "fused" else "moe_gmm_eager"
    names = [f"model.layers.{i}.mlp.experts" for i in (0, 1, 2, 5)]
    out = [ExpertsDescription(n, impl, {"gate_up_proj": backend, "down_proj": backend}) for n in names]
    if path == "fused":  # one layer whose projections run on different backends
        out[3] = ExpertsDescription(names[3], impl, {"gate_up_proj": "cpu", "down_proj": "torch"})
    return out


def _report(step_ms, phases=None, experts=None):
    phases = phases if phases is not None else {p: {} for p in step_ms}
    return loss_report(RunConfig(), LOSSES, step_ms, phases, torch.float32, (1, 1), experts)[0]


def test_step_time_leaves_out_step_one_and_flags_a_noisy_run():
    # The spread the report was missing: medians near 700 ms with single steps from 69 to 2049 ms.
    step_ms = {"fused": [2049.0, 380.0, 389.0, 395.0, 69.0, 400.0], "eager": [900.0, 700.0, 708.0, 715.0, 705.0, 712.0]}
    report = _report(step_ms)
    (row,) = [r for r in report.rows if r.check == "training step"]
    assert row.section == "time (ms per step; information, never pass/fail)" and row.status == "info"
    assert row.metric == "ms, median of 5 steps"
    assert row.fused == Spread.of(step_ms["fused"][1:]).median == 389.0
    assert row.eager == 708.0
    assert row.notes.startswith("NOISY (fused max/min 5.80x > 1.5")
    assert "eager" not in row.notes.split(")")[0], "the eager steps agree within the limits"
    assert "fused p20-p80 " in row.notes and "min-max 69-400" in row.notes
    assert "step 1 left out (first-call work): fused 2.05e+03 ms, eager 900 ms" in row.notes
    assert row.details["fused"]["repeats"] == 5 and row.details["fused"]["noisy"]
    assert any("never pass/fail" in n for n in report.notes)


def test_one_step_is_reported_as_it_is():
    report = _report({"fused": [50.0]})
    (row,) = [r for r in report.rows if r.check == "training step"]
    assert row.metric == "ms, median of 1 steps" and row.fused == 50.0 and row.eager is None
    assert "left out" not in row.notes


def test_profiled_phases_carry_their_repeats():
    phases = {
        p: PhaseTimes({k: Spread.of([1.0 * i, 1.1 * i]) for i, k in enumerate(("gmm", "host", PROFILED_STEP), 1)})
        for p in ("fused", "eager")
    }
    report = _report({"fused": [3.0, 3.0], "eager": [3.0, 3.0]}, phases)
    rows = {r.check: r for r in report.rows}
    assert rows["gmm (profiler)"].metric == "ms, median of 2 profiled steps"
    assert rows["gmm (profiler)"].fused == pytest.approx(1.05)
    assert rows[f"{PROFILED_STEP} (profiler)"].eager == pytest.approx(3.15)
    assert "permute/unpermute (profiler)" not in rows  # not measured, not invented


def test_experts_rows_name_each_layer_group_with_its_backend():
    experts = {"fused": _experts("fused", "cpu"), "eager": _experts("eager", "eager")}
    report = _report({"fused": [1.0], "eager": [1.0]}, experts=experts)
    rows = [r for r in report.rows if r.section == "experts (implementation: backend)"]
    assert [(r.check, r.eager, r.fused) for r in rows] == [
        ("model.layers.{0-2}.mlp.experts", "moe_gmm_eager: eager", "moe_gmm: cpu"),
        ("model.layers.{5}.mlp.experts", "moe_gmm_eager: eager", "moe_gmm: gate_up_proj cpu, down_proj torch"),
    ]
    assert rows[0].notes.startswith("3 module(s)") and all(r.status == "info" for r in rows)
