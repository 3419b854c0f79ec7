"""validate's timing rows: information only, each with its repeats, spread and noise flag."""

from __future__ import annotations

import torch

from moe_gmm.report.model import Report
from moe_gmm.report.perf_checks import timing_rows
from moe_gmm.report.render import to_markdown
from moe_gmm.report.timing import PROFILED_STEP, Spread
from moe_gmm.report.validate import MODEL_PRESETS, ValidateOptions


def test_timing_rows_carry_repeats_spread_and_a_consistent_breakdown():
    report = Report("t")
    opts = ValidateOptions(quick=True, num_tokens=16, dtype="fp32")
    times = timing_rows(report, opts, torch.device("cpu"), MODEL_PRESETS["tiny"])
    rows = report.rows
    assert [r.check for r in rows] == [
        "GMM time (the two expert matmuls, fwd+bwd)",
        "permute/unpermute time (fwd+bwd)",
        "host time",
        "MoE block step under the profiler",
        "MoE block training step (fwd+bwd+SGD), no profiler",
    ]
    assert [r.metric for r in rows] == ["ms, median of 5 profiled steps"] * 4 + ["ms, median of 10 steps"]
    for r in rows:
        assert r.passed is None and r.status == "info" and r.tolerance is None, r
        assert "never pass/fail" in r.section
        for path, value in (("eager", r.eager), ("fused", r.fused)):
            spread = r.details[path]
            assert spread["repeats"] in (5, 10) and spread["median"] == value
            assert spread["min"] <= spread["p20"] <= value <= spread["p80"] <= spread["max"]
            assert f"{path} p20-p80 " in r.notes
            assert ("NOISY" in r.notes) == (r.details["eager"]["noisy"] or r.details["fused"]["noisy"])
            if spread["noisy"]:
                noise = Spread(**{k: v for k, v in spread.items() if k != "noisy"}).noise
                assert r.notes.startswith("NOISY (") and f"{path} {noise}" in r.notes.split(")")[0]
    # The phases come from the profiled steps that hold them: none exceeds that step's time.
    for path in ("eager", "fused"):
        for phase in ("gmm", "permute/unpermute", "host"):
            assert times[path][phase] <= times[path][PROFILED_STEP], (path, phase)
    assert any("never pass/fail" in n and "separate run" in n for n in report.notes)
    assert "| MoE block step under the profiler | ms, median of 5 profiled steps |" in to_markdown(report)
