"""``moe-gmm bench`` plots, drawn from a harness JSON file (rows as ``moe_gmm.bench`` writes them)."""

from __future__ import annotations

import json

from moe_gmm.report.bench import plot_bench_json


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
