"""Baseline files: summary rows of a real tiny run, replaced per suite in place, read back strictly."""

from __future__ import annotations

import copy
import json

import pytest

from moe_gmm.bench import baseline
from moe_gmm.bench.baseline import FORMAT, load_baseline, replay_argv, row_key, suite_of, update_baseline
from tests.helpers.bench_runs import tiny_gmm_run


def test_run_writes_one_summary_row_per_timed_row(tmp_path, monkeypatch):
    path = tmp_path / "amd-avx512bf16-2c.json"
    code, run = tiny_gmm_run(monkeypatch, tmp_path, "--baseline-out", str(path))
    assert code == 0
    data = load_baseline(path)
    assert data["format"] == FORMAT and data["machine_class"] == "amd-avx512bf16-2c"
    assert data["machine"]["cpu_model"] == run["machine"]["cpu_model"]
    assert "--cases tiny" in data["runs"]["gmm"]["command"]
    timed = [r for r in run["rows"] if r["median_s"] is not None]
    assert len(data["rows"]) == len(timed) > 0
    by_key = {row_key(r): r for r in data["rows"]}
    for r in timed:
        row = by_key[("gmm", f"{r['case']} {r['label']}", r["impl"], "fp32", "fwd")]
        assert row["median_ms"] == pytest.approx(r["median_s"] * 1e3, rel=1e-6)
        assert row["p20_ms"] <= row["median_ms"] <= row["p80_ms"]
        assert row["x_floor"] == pytest.approx(r["x_floor"], abs=1e-4)
        assert row["rel_err"] == pytest.approx(r["rel_err"], rel=1e-2, abs=0)
    # The skewed tiny case leaves experts empty; its rows are there like any other.
    assert any("skewed" in r["case"] for r in data["rows"])


def test_writing_a_suite_replaces_its_rows_and_keeps_the_others(tmp_path, monkeypatch):
    path = tmp_path / "class.json"
    _, run = tiny_gmm_run(monkeypatch, tmp_path)
    update_baseline(path, run)
    n = len(load_baseline(path)["rows"])
    layer_run = copy.deepcopy(run)
    layer_run["command"] = "python -m benchmarks.run_moe_layer --cases tiny"
    update_baseline(path, layer_run)
    faster = copy.deepcopy(run)
    for r in faster["rows"]:
        if r["median_s"] is not None:
            r["median_s"] /= 2
    update_baseline(path, faster)
    data = load_baseline(path)
    assert sorted(data["runs"]) == ["gmm", "layer"]
    assert len(data["rows"]) == 2 * n  # gmm replaced, not added beside the old rows
    gmm_ms = {row_key(r)[1:]: r["median_ms"] for r in data["rows"] if r["suite"] == "gmm"}
    layer_ms = {row_key(r)[1:]: r["median_ms"] for r in data["rows"] if r["suite"] == "layer"}
    # Medians are kept to the nanosecond: halving a rounded value is off by at most 1e-6 ms.
    assert all(gmm_ms[k] == pytest.approx(layer_ms[k] / 2, abs=1e-6) for k in gmm_ms)


def test_a_run_from_another_machine_is_refused(tmp_path, monkeypatch):
    path = tmp_path / "class.json"
    _, run = tiny_gmm_run(monkeypatch, tmp_path)
    update_baseline(path, run)
    other = copy.deepcopy(run)
    other["machine"]["cpu_model"] = "Some Other CPU"
    with pytest.raises(ValueError, match="class.json: it describes .*cpu_model"):
        update_baseline(path, other)


def test_bad_files_name_the_file_and_the_problem(tmp_path):
    with pytest.raises(ValueError, match="nope.json: cannot read it"):
        load_baseline(tmp_path / "nope.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        load_baseline(bad)
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(ValueError, match=f"bad.json: format must be '{FORMAT}', got None"):
        load_baseline(bad)
    bad.write_text(json.dumps({"format": FORMAT, "rows": [{"suite": "gmm", "case": "c"}]}))
    with pytest.raises(ValueError, match="a row lacks"):
        load_baseline(bad)
    with pytest.raises(ValueError, match="names none of the runners"):
        suite_of({"command": "python other.py"})
    with pytest.raises(ValueError, match="suite must be one of"):
        baseline.summary_rows({"rows": []}, "ep")


def test_replay_drops_the_file_options():
    command = "python -m benchmarks.run_gmm --cases results --out a.json --markdown a.md --compare=b.json --repeats 5"
    data = {"runs": {"gmm": {"command": command}}}
    assert replay_argv(data, "gmm") == ["--cases", "results", "--repeats", "5"]
    with pytest.raises(ValueError, match="no 'layer' run"):
        replay_argv(data, "layer")


def test_module_entry_turns_run_files_into_a_baseline(tmp_path, monkeypatch, capsys):
    _, run = tiny_gmm_run(monkeypatch, tmp_path)
    out = tmp_path / "baselines" / "x.json"
    assert baseline.main([str(tmp_path / "run.json"), "--out", str(out), "--machine-class", "tiny-2c"]) == 0
    data = load_baseline(out)
    assert data["machine_class"] == "tiny-2c"
    assert len(data["rows"]) == sum(r["median_s"] is not None for r in run["rows"])
    assert "gmm rows ->" in capsys.readouterr().out
