"""A calibration measured under load makes rows beat their roofline floor; the run measures the
limits again and says so, instead of reporting 0.2x the floor in silence."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.bench.gmm import GmmCase, gmm_impls
from moe_gmm.bench.harness import TimingSettings, recheck_calibration, run_benchmark
from moe_gmm.bench.machine import Limits, describe_machine, measure_limits

FAST = TimingSettings(warmup=1, min_repeats=2, max_repeats=2, min_seconds=0.0)
TINY = GmmCase(num_experts=4, top_k=2, num_tokens=6, hidden=8, intermediate=4, projection="gate_up")
# Limits no machine is this slow at: every row beats floors made from them.
CRAWLING = Limits(peak_flops={"fp32": 1e3}, copy_bandwidth=1e3, gemm_sizes=(64,), copy_mib=1)


def _report(limits: Limits):
    return run_benchmark(
        [TINY],
        gmm_impls(["eager"]),
        dtypes=[torch.float32],
        modes=["fwd"],
        limits=limits,
        machine=describe_machine(),
        settings=FAST,
        reference="eager",
        primary=None,
        title="calibration",
    )


def test_rows_under_the_floor_trigger_a_fresh_measurement():
    report = _report(CRAWLING)
    assert all(r["x_floor"] < 1 for r in report.rows)
    said: list[str] = []
    recheck_calibration(report, lambda: measure_limits((torch.float32,), quick=True), said.append)
    assert said and "measuring them again" in said[0]
    assert report.limits.copy_bandwidth > CRAWLING.copy_bandwidth
    assert all(r["x_floor"] >= 1 for r in report.rows)
    assert any(n.startswith("limits measured again: 1 rows beat") for n in report.notes), report.notes


def test_floors_still_beaten_after_the_second_measurement_are_flagged():
    report = _report(CRAWLING)
    said: list[str] = []
    recheck_calibration(report, lambda: CRAWLING, said.append)
    assert len(said) == 2 and said[1].startswith("WARNING: 1 rows still beat their roofline floor")
    assert said[1] in report.notes


def test_a_sound_calibration_is_left_alone():
    report = _report(measure_limits((torch.float32,), quick=True))
    assert all(r["x_floor"] >= 1 for r in report.rows)
    notes = list(report.notes)
    recheck_calibration(report, lambda: pytest.fail("measured again without cause"), pytest.fail)
    assert report.notes == notes
