"""The weight read-order probe: argument checks, the per-round summary, and one real run."""

from __future__ import annotations

import argparse
import json

import pytest

from benchmarks import run_read_order as ro


@pytest.mark.parametrize("text", ["256,256", "1,256,1024", "256,250,1024", "256,256,1000", "a,b,c", "4096,4096,4096"])
def test_shape_rejects_bad_text(text):
    with pytest.raises(argparse.ArgumentTypeError):
        ro._shape(text)


def test_shape_parses():
    assert ro._shape("256,1024,512") == (256, 1024, 512)


def _records(rounds):
    return [
        {"round": i, "order": order, "gbps": gbps}
        for i, rates in enumerate(rounds)
        for order, gbps in zip(("sequential", "strips"), rates)
    ]


def test_summary_compares_each_round_with_its_own_front_to_back_read():
    # round 0 slow (40 GB/s), rounds 1-2 fast (>= 65)
    records = _records([(40.0, 30.0), (80.0, 40.0), (70.0, 42.0)])
    s = ro.summarize(records)
    assert s["rounds"] == 3 and s["fast_rounds"] == 2
    strips = s["orders"]["strips"]
    assert strips["best_gbps"] == 42.0
    assert strips["vs_sequential_range"] == pytest.approx([0.5, 0.75])
    assert strips["vs_sequential_median"] == pytest.approx(0.6)
    assert strips["vs_sequential_fast_median"] == pytest.approx((0.5 + 0.6) / 2)
    assert s["orders"]["sequential"]["vs_sequential_median"] == 1.0
    assert ro.per_round(records) == {
        "orders": ["sequential", "strips"],
        "rounds_gbps": [[40.0, 30.0], [80.0, 40.0], [70.0, 42.0]],
    }


def test_per_round_keeps_a_stalled_round_positive():
    rates = ro.per_round(_records([(16.54, 0.0312)]))["rounds_gbps"]
    assert rates == [[16.5, 0.0312]]


def test_summary_without_fast_rounds():
    s = ro.summarize(_records([(40.0, 30.0)]))
    assert s["fast_rounds"] == 0 and s["orders"]["strips"]["vs_sequential_fast_median"] is None


@pytest.mark.skipif(ro.unsupported_reason() is not None, reason=str(ro.unsupported_reason()))
def test_real_run_reads_every_element_in_every_order(tmp_path):
    out = tmp_path / "ro.json"
    assert ro.main(["--shape", "4,32,128", "--seconds", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (result,) = report["results"]
    assert result["shape"] == "4,32,128"
    assert result["orders"] == ["sequential", "strips", "strips+next", "bands", "chunks+next"]
    assert len(result["rounds_gbps"]) == ro.ROUNDS_PER_BATCH
    assert all(g > 0 for rates in result["rounds_gbps"] for g in rates)


def test_missing_compiler_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert "no-such-compiler" in ro.unsupported_reason()
    with pytest.raises(SystemExit, match="no-such-compiler"):
        ro.main(["--seconds", "0", "--out", str(tmp_path / "ro.json")])
