"""``moe-gmm bench``: the benchmark harness of :mod:`moe_gmm.bench` behind one command, plus plots.

The harness does the timing (warm-up, interleaved repeats, medians, correctness column, machine
header, progress bar, JSON); this module chooses its arguments, then draws from the JSON:

- ``gmm_time_vs_rows.png``: median time and achieved GFLOP/s against mean rows per active
  expert, one marker per implementation, projection, dtype and mode;
- ``gmm_roofline.png``: achieved GFLOP/s per case against the roofline-attainable rate
  (``flops / floor_s``, the faster of the compute and memory bounds measured on this machine).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["BenchUsageError", "plot_bench_json", "run_bench"]


class BenchUsageError(ValueError):
    """The benchmark cannot run as asked: exit code 2."""


def run_bench(*, out_dir: str | Path, quick: bool, dtype: str, mode: str) -> dict[str, Path]:
    try:
        from moe_gmm.bench import gmm
    except ImportError as exc:  # pragma: no cover - the bench package ships with moe_gmm
        raise BenchUsageError(f"the benchmark harness is not available: {exc}") from None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = {"json": out / "gmm.json", "markdown": out / "gmm.md"}
    argv = ["--dtype", dtype, "--modes", mode, "--out", str(files["json"]), "--markdown", str(files["markdown"])]
    if quick:
        argv.insert(0, "--quick")
    try:
        code = gmm.main(argv)
    except SystemExit as exc:  # the harness reports bad arguments by exiting
        raise BenchUsageError(str(exc.code)) from None
    if code:
        raise BenchUsageError(f"the grouped-matmul benchmark exited with {code}")
    files.update(plot_bench_json(files["json"], out))
    return files


def _case_label(row: dict) -> str:
    return f"{row['case']} {row.get('label', '')}".strip()


def plot_bench_json(json_path: str | Path, out_dir: str | Path) -> dict[str, Path]:
    """Draw the two bench plots from a harness JSON file; returns their paths."""
    from moe_gmm.report import plots

    data = json.loads(Path(json_path).read_text())
    rows = [r for r in data["rows"] if r.get("median_s") is not None]
    out = Path(out_dir)
    times: dict[str, list[tuple[float, float, float]]] = {}
    achieved: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        params = r.get("params", {})
        active = max(1, int(params.get("active_experts", 1)))
        rows_per_expert = float(params.get("M", 0)) / active
        series = f"{r['impl']} {r.get('label', '')} {r['dtype']} {r['mode']}".strip()
        times.setdefault(series, []).append((rows_per_expert, r["median_s"] * 1e3, r["gflops"]))
        achieved.setdefault(f"{r['impl']} {r['dtype']}", []).append((_case_label(r), r["gflops"]))
        if r.get("floor_s"):
            achieved.setdefault(f"roofline {r['dtype']}", [])
            label = _case_label(r)
            if label not in dict(achieved[f"roofline {r['dtype']}"]):
                achieved[f"roofline {r['dtype']}"].append((label, r["flops"] / r["floor_s"] / 1e9))
    files = {}
    if times:
        files["time_vs_rows"] = plots.plot_bench_times(times, out / "gmm_time_vs_rows.png",
                                                       "mean rows per active expert")
        files["roofline"] = plots.plot_bench_roofline(achieved, None, out / "gmm_roofline.png")
    return files
