"""``moe-gmm bench``: plots drawn from a harness JSON file, and ``--compare`` / ``--baseline-out`` end to end."""

from __future__ import annotations

import json

from moe_gmm.bench.baseline import load_baseline
from moe_gmm.bench.command import plot_bench_json
from moe_gmm.cli import EXIT_FAIL, EXIT_OK, EXIT_USAGE, main
from tests.helpers.bench_runs import tiny_gmm_run


def _row(impl: str, case: str, m: int, active: int, median_s: float | None, floor_s: float = 1e-3) -> dict:
    flops = 2.0 * m * 64 * 128
    row = {
        "case": case,
        "label": "gate_up",
        "params": {"M": m, "active_experts": active},
        "dtype": "fp32",
        "mode": "fwd",
        "impl": impl,
        "flops": flops,
        "floor_s": floor_s,
        "median_s": median_s,
    }
    if median_s is not None:
        row["gflops"] = flops / median_s / 1e9
    else:
        row["skipped"] = "refused"
    return row


def test_plots_from_harness_json(tmp_path):
    rows = [
        _row("eager", "E8 k2 T64", 128, 8, 2e-3),
        _row("torch", "E8 k2 T64", 128, 8, 1e-3),
        _row("eager", "E64 k8 T16", 128, 40, 9e-3),
        _row("triton", "E64 k8 T16", 128, 40, None),  # refused: no point, no crash
    ]
    path = tmp_path / "gmm.json"
    path.write_text(json.dumps({"rows": rows}))
    files = plot_bench_json(path, tmp_path)
    assert set(files) == {"time_vs_rows", "roofline"}
    for p in files.values():
        assert p.read_bytes()[:4] == b"\x89PNG"


def test_layer_rows_without_m_use_tokens_times_top_k(tmp_path):
    row = _row("moe_gmm", "E32-k8-T256", 2048, 32, 5e-3)
    row["params"] = {"num_experts": 32, "top_k": 8, "num_tokens": 256}
    path = tmp_path / "moe_layer.json"
    path.write_text(json.dumps({"rows": [row]}))
    files = plot_bench_json(path, tmp_path, prefix="moe_layer")
    assert files["time_vs_rows"].name == "moe_layer_time_vs_rows.png"


def test_cli_compare_reruns_the_baseline_command_and_fails_on_a_regression(tmp_path, monkeypatch, capsys):
    path = tmp_path / "base.json"
    tiny_gmm_run(monkeypatch, tmp_path, "--baseline-out", str(path))
    out = tmp_path / "bench"
    # The baseline holds only a gmm run: the layer suite is not run.
    assert main(["bench", "--compare", str(path), "--out", str(out), "--baseline-out", str(tmp_path / "new.json")]) in (
        EXIT_OK,
        EXIT_FAIL,  # a tiny row may move beyond its 1-repeat noise
    )
    printed = capsys.readouterr().out
    assert "against the baseline: " in printed and "0 missing in run, 0 new in run" in printed
    assert "--compare: rerunning the baseline's gmm run (1 of 1," in printed  # not minutes of silence
    assert not (out / "moe_layer.json").exists()
    run = json.loads((out / "gmm.json").read_text())
    assert "--cases tiny" in run["command"] and "--compare" in run["command"]
    assert len(load_baseline(tmp_path / "new.json")["rows"]) == len(load_baseline(path)["rows"])

    data = load_baseline(path)
    for row in data["rows"]:
        row.update(median_ms=1e-9, p20_ms=1e-9, p80_ms=1e-9)  # every row regressed
    path.write_text(json.dumps(data))
    assert main(["bench", "--compare", str(path), "--out", str(out)]) == EXIT_FAIL
    assert "| regressed |" in capsys.readouterr().out


def test_cli_compare_usage_errors(tmp_path, capsys):
    assert main(["bench", "--compare", str(tmp_path / "none.json"), "--out", str(tmp_path)]) == EXIT_USAGE
    assert "none.json: cannot read it" in capsys.readouterr().err
    path = tmp_path / "layer_only.json"
    path.write_text(json.dumps({"format": "moe-gmm-baseline/1", "runs": {"layer": {"command": "x"}}, "rows": []}))
    assert main(["bench", "--suite", "gmm", "--compare", str(path), "--out", str(tmp_path)]) == EXIT_USAGE
    assert "holds no run of the chosen suites" in capsys.readouterr().err
