"""Grouped-matmul benchmark cases, implementations and the runner's command path. No timing asserts."""

from __future__ import annotations

import json

import pytest
import torch

from moe_gmm.bench import gmm as gmm_bench
from moe_gmm.bench.gmm import CASE_SETS, GmmCase, case_set, gmm_impls
from moe_gmm.bench.machine import Limits

# Made-up limits: the command path does not depend on their values.
LIMITS = Limits(peak_flops={"fp32": 1e11, "bf16": 2e11}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)
TINY = GmmCase(num_experts=4, top_k=2, num_tokens=6, hidden=8, intermediate=4, projection="gate_up")


def test_gmm_case_work_and_bytes():
    case = GmmCase(num_experts=4, top_k=1, num_tokens=10, hidden=6, intermediate=3, projection="down", routing="skewed")
    counts = case.counts()
    assert counts.sum() == 10 and counts.numel() == 4
    assert case.kn == (3, 6)
    m, k, n = 10, 3, 6
    assert case.flops("fwd") == 2 * m * k * n
    assert case.flops("fwdbwd") == 3 * case.flops("fwd")
    active = int((counts > 0).sum())
    assert case.min_bytes("fwd", torch.bfloat16) == 2 * (m * k + active * k * n + m * n)
    bwd = m * n + 2 * m * k + active * k * n + 4 * k * n
    assert case.min_bytes("bwd", torch.float32) == 4 * bwd
    assert case.min_bytes("fwdbwd", torch.float32) == case.min_bytes("fwd", torch.float32) + 4 * bwd
    with pytest.raises(ValueError, match="projection"):
        GmmCase(num_experts=2, top_k=1, num_tokens=2, hidden=2, intermediate=2, projection="up")


def test_gmm_case_inputs_are_deterministic_and_transposed_view_is_a_view():
    a, b = TINY.make_inputs(torch.float32), TINY.make_inputs(torch.float32)
    assert torch.equal(a.x_MK, b.x_MK) and torch.equal(a.w_EKN, b.w_EKN)
    assert a.x_MK.shape == (12, 8) and a.w_EKN.shape == (4, 8, 8)
    enk = GmmCase(**{**TINY.__dict__, "weight_layout": "ENK"}).make_inputs(torch.float32)
    assert enk.w_EKN.shape == (4, 8, 8) and not enk.w_EKN.is_contiguous()


@pytest.mark.parametrize("name", CASE_SETS)
def test_case_sets_cover_both_projections(name):
    cases = case_set(name)
    assert {c.projection for c in cases} == {"gate_up", "down"}
    assert any(c.routing == "skewed" for c in cases)
    with pytest.raises(ValueError, match="case set"):
        case_set("nope")


def test_gmm_impls_reference_first_dense_last():
    impls = gmm_impls()
    names = [i.name for i in impls]
    assert names[0] == "eager" and names[-1] == "dense" and "torch" in names
    assert [i.name for i in gmm_impls(["torch"])] == ["eager", "torch"]
    with pytest.raises(ValueError, match="impls"):
        gmm_impls(["nope"])


def test_main_quick_path_writes_json(tmp_path, monkeypatch):
    # Only the limit measurement is replaced: the rest is the real command path.
    monkeypatch.setattr(gmm_bench, "measure_limits", lambda dtypes, quick: LIMITS)
    out = tmp_path / "gmm.json"
    rc = gmm_bench.main(
        [
            "--quick",
            "--cases",
            "tiny",
            "--dtype",
            "fp32",
            "--no-progress",
            "--out",
            str(out),
            "--markdown",
            str(tmp_path / "g.md"),
        ]
    )
    assert rc == 0
    data = json.loads(out.read_text())
    assert {r["label"] for r in data["rows"]} == {"gate_up", "down"}
    assert {r["mode"] for r in data["rows"]} == {"fwd", "fwdbwd"}
    assert data["command"].startswith("python -m moe_gmm.bench.gmm --quick")
    with pytest.raises(SystemExit):
        gmm_bench.main(["--dtype", "fp8"])
