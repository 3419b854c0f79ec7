"""The glue benchmark runs, times both paths side by side and writes its report."""

from __future__ import annotations

import json

import pytest

from moe_gmm.bench import glue
from moe_gmm.bench.harness import TimingSettings
from moe_gmm.ops import native

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler: nothing native to time")


def test_run_reports_both_paths_against_the_floor():
    case = glue.GlueCase(num_tokens=16, top_k=2, hidden=32, intermediate=16, num_experts=4)
    report = glue.run([case], ["fp32", "bf16"], TimingSettings(warmup=1, min_repeats=2, max_repeats=2, min_seconds=0))
    assert report["copy_bandwidth_gb_s"] > 0
    rows = report["rows"]
    assert {(r["dtype"], r["op"]) for r in rows} == {
        (d, op) for d in ("fp32", "bf16") for op in ("permute+unpermute", "swiglu")
    }
    for row in rows:
        assert row["native_ms"] > 0 and row["composed_ms"] > 0 and row["floor_ms"] > 0
        assert row["speedup"] == pytest.approx(row["composed_ms"] / row["native_ms"])
    assert "| T16-k2-H32-I16 | bf16 | swiglu |" in glue.markdown(report)
    assert native.enabled(), "timing the composed path must not leave the kernels turned off"


def test_cli_writes_json_and_markdown(tmp_path, capsys):
    out, md = tmp_path / "glue.json", tmp_path / "glue.md"
    assert glue.main(["--quick", "--dtype", "bf16", "--out", str(out), "--markdown", str(md)]) == 0
    assert json.loads(out.read_text())["rows"][0]["dtype"] == "bf16"
    assert "native speed-up" in md.read_text() and "native speed-up" in capsys.readouterr().out


def test_cli_rejects_an_unknown_dtype():
    with pytest.raises(SystemExit):
        glue.main(["--dtype", "fp8"])
