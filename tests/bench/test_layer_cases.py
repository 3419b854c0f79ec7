"""MoE-layer benchmark cases and implementations on a tiny block: every implementation agrees. No timing asserts."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from moe_gmm.bench.harness import TimingSettings, run_benchmark
from moe_gmm.bench.layer_cases import IMPLS, MoeLayerCase, case_set, layer_impls
from moe_gmm.bench.machine import Limits, describe_machine

FAST = TimingSettings(warmup=0, min_repeats=1, max_repeats=1, min_seconds=0.0)
LIMITS = Limits(peak_flops={"fp32": 1e11, "bf16": 2e11}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)
TINY = MoeLayerCase(num_experts=8, num_tokens=12, top_k=2, hidden=32, intermediate=16, shared_intermediate=24)


def test_all_implementations_agree_with_transformers_eager():
    report = run_benchmark(
        [TINY], layer_impls(list(IMPLS)), dtypes=[torch.float32], modes=["fwdbwd"], limits=LIMITS,
        machine=describe_machine(), settings=FAST, reference="hf_eager", primary="moe_gmm",
    )  # fmt: skip
    rows = {r["impl"]: r for r in report.rows}
    assert sorted(rows) == sorted(IMPLS)
    for name, row in rows.items():
        assert row["median_s"] > 0, name
        # output and the grads of x and of every parameter, in transformers' layout
        assert len(row["rel_err_parts"]) == 1 + 1 + 7, name
        assert row["rel_err"] < 1e-5, (name, row["rel_err_parts"])


def test_case_sets_and_impl_names():
    assert [c.name for c in case_set("qwen")] == ["E64-k8-T1024", "E64-k8-T4096", "E256-k8-T1024", "E256-k8-T4096"]
    assert case_set("quick")[0].flops("fwdbwd") == 3 * case_set("quick")[0].flops("fwd")
    assert [i.name for i in layer_impls(["moe_gmm"])] == ["hf_eager", "moe_gmm"]
    assert [i.name for i in layer_impls(["moe_gmm"], "hf_grouped_mm")] == ["hf_grouped_mm", "moe_gmm"]
    assert [c.num_experts for c in case_set("experts")] == [8, 64, 128, 256]
    with pytest.raises(ValueError, match="impls"):
        layer_impls(["nope"])
    with pytest.raises(ValueError, match="reference"):
        layer_impls(["moe_gmm"], "hf_fast")
    with pytest.raises(ValueError, match="case set"):
        case_set("huge")
