"""Baseline files: summary rows of a real tiny run, replaced per suite in place, read back strictly."""

from __future__ import annotations

import copy
import json

import pytest

from moe_gmm.bench import baseline
from moe_gmm.bench.baseline import (
    FORMAT,
    load_baseline,
    replay_argv,
    row_key,
    suite_of,
    suites_of,
    summary_rows,
    update_baseline,
)
from tests.helpers.bench_runs import tiny_gmm_run


def test_run_writes_one_summary_row_per_timed_row(tmp_path, monkeypatch):
    path = tmp_path / "amd-avx512bf16-2c.json"
    code, run = tiny_gmm_run(monkeypatch, tmp_path, "--baseline-out", str(path))
    assert code == 0
    data = load_baseline(path)
    assert data["format"] == FORMAT and data["machine_class"] == "amd-avx512bf16-2c"
    assert data["machine"]["cpu_model"] == run["machine"]["cpu_model"]
    assert "--cases tiny" in data["runs"]["gmm"]["command"]
    assert str(tmp_path) not in data["runs"]["gmm"]["command"]  # no file options: rerunnable anywhere
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


def test_the_train_step_rows_are_a_suite_of_their_own(tmp_path, monkeypatch, capsys):
    """A layer run with the train mode writes its headline rows as the ``train`` suite, beside the
    ``gmm`` rows already there, and a second run compares against them alone."""
    from moe_gmm.bench import moe_layer

    path = tmp_path / "base.json"
    tiny_gmm_run(monkeypatch, tmp_path, "--baseline-out", str(path))
    argv = ["--quick", "--cases", "tiny", "--dtype", "fp32", "--modes", "train", "--train-modes", "train_fused",
            "--train-impls", "hf_moe_gmm", "--lm", "none", "--repeats", "1", "--no-progress"]  # fmt: skip
    assert moe_layer.main([*argv, "--out", str(tmp_path / "train.json"), "--baseline-out", str(path)]) == 0
    data = load_baseline(path)
    assert set(data["runs"]) == {"gmm", "train"}
    assert "--modes train" in data["runs"]["train"]["command"] and "--baseline-out" not in data["runs"]["train"]["command"]
    train = [r for r in data["rows"] if r["suite"] == "train"]
    assert {(r["case"], r["impl"], r["mode"]) for r in train} == {
        ("block E4-k2-T8", impl, "train_fused") for impl in ("hf_grouped_mm", "hf_moe_gmm")
    }
    assert all(r["median_ms"] > 0 and r["p20_ms"] <= r["p80_ms"] and r["rel_err"] < 1e-5 for r in train)
    run = json.loads((tmp_path / "train.json").read_text())
    assert suites_of(run) == ["train"] and summary_rows(run, "train") == train

    capsys.readouterr()
    assert moe_layer.main([*argv, "--compare", str(path)]) in (0, 1)  # verdicts depend on the machine
    printed = capsys.readouterr().out
    assert "against the baseline:" in printed and " 0 missing in run" in printed  # gmm rows are not its rows
