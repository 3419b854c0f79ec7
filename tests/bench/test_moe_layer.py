"""MoE-layer benchmark runner on a tiny block: phases, glue share, JSON and Markdown. No timing asserts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moe_gmm.bench import moe_layer
from moe_gmm.bench.harness import TimingSettings
from moe_gmm.bench.layer_cases import MoeLayerCase
from moe_gmm.bench.machine import Limits
from moe_gmm.bench.moe_layer import PHASES, profile_breakdown

LIMITS = Limits(peak_flops={"fp32": 1e11, "bf16": 2e11}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)
TINY = MoeLayerCase(num_experts=8, num_tokens=12, top_k=2, hidden=32, intermediate=16, shared_intermediate=24)


def test_profile_breakdown_has_every_phase():
    result = profile_breakdown(TINY, torch.float32, steps=1)
    assert set(result["fwd"]) == {*PHASES, "total"}
    assert set(result["bwd"]) == {*PHASES, "total"} - {"router", "shared_expert"}
    for direction in ("fwd", "bwd"):
        assert result[direction]["gmm"] > 0
        assert result[direction]["total"] >= result[direction]["gmm"]
    for phase in ("router", "permute", "swiglu", "unpermute", "shared_expert"):
        assert result["fwd"][phase] > 0, phase


def test_profile_breakdown_reports_the_median_step_whole(monkeypatch):
    totals = iter([5.0, 1.0, 9.0, 3.0])  # the lower middle of four: 3.0

    def fake_phases(prof):
        total = next(totals)
        return {
            "fwd": {"gmm": total / 2, "other": 0.0, "total": total / 2},
            "bwd": {"gmm": total / 2, "total": total / 2},
        }

    monkeypatch.setattr(moe_layer, "_phases_of", fake_phases)
    result = profile_breakdown(TINY, torch.float32, steps=4)
    assert result["fwd"]["total"] + result["bwd"]["total"] == 3.0
    assert result["fwd"]["gmm"] == 1.5


def test_glue_alone_is_a_part_of_the_step():
    settings = TimingSettings(warmup=1, min_repeats=3, max_repeats=3, min_seconds=0.0)
    glue = moe_layer.time_glue_alone(TINY, torch.float32, settings)
    # The step runs the same permute and unpermute plus the router, experts and shared expert.
    assert 0 < glue["glue_ms"] < glue["step_ms"]
    assert glue["share"] == glue["glue_ms"] / glue["step_ms"]


@pytest.mark.parametrize(("steps", "error"), [(0, ValueError), (2.0, TypeError), (True, TypeError)])
def test_profile_breakdown_rejects_bad_steps(steps, error):
    with pytest.raises(error, match="steps"):
        profile_breakdown(TINY, torch.float32, steps=steps)


def test_runner_writes_json_and_markdown(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(moe_layer, "measure_limits", lambda dtypes, quick=False: LIMITS)  # skip the calibration
    out, md = tmp_path / "moe_layer.json", tmp_path / "moe_layer.md"
    argv = ["--cases", "tiny", "--dtype", "fp32", "--modes", "fwd,fwdbwd", "--repeats", "1", "--breakdown-steps", "1"]
    assert moe_layer.main([*argv, "--no-progress", "--out", str(out), "--markdown", str(md)]) == 0
    data = json.loads(out.read_text())
    assert {r["impl"] for r in data["rows"]} == {"hf_eager", "hf_grouped_mm", "hf_moe_gmm", "moe_gmm"}
    assert all(r["rel_err"] < 1e-5 for r in data["rows"])
    assert data["breakdown"][0]["ms_per_step"]["fwd"]["gmm"] > 0
    assert 0 < data["breakdown"][0]["glue_alone"]["share"] < 1
    text = md.read_text()
    assert "moe_gmm time by phase" in text and "| gmm |" in text
    assert "permute + unpermute fwd+bwd timed alone, without the profiler" in text


def test_runner_with_another_reference(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(moe_layer, "measure_limits", lambda dtypes, quick=False: LIMITS)
    out = tmp_path / "moe_layer.json"
    argv = ["--cases", "tiny", "--dtype", "fp32", "--modes", "fwdbwd", "--repeats", "1", "--breakdown-steps", "0"]
    argv += ["--impls", "moe_gmm", "--reference", "hf_grouped_mm", "--no-progress", "--out", str(out)]
    assert moe_layer.main(argv) == 0
    data = json.loads(out.read_text())
    assert {r["impl"] for r in data["rows"]} == {"hf_grouped_mm", "moe_gmm"}
    assert data["reference"] == "hf_grouped_mm"
    assert all(r["rel_err"] < 1e-5 for r in data["rows"])
