"""``moe-gmm bench``: the benchmarks of :mod:`moe_gmm.bench` (GMM, MoE layer) behind one command, plus plots.

The harness does the timing (warm-up, interleaved repeats, medians, correctness column, machine
header, progress bar, JSON); this module chooses its arguments, then draws from the JSON:

- ``<suite>_time_vs_rows.png``: median time and achieved GFLOP/s against mean rows per active
  expert, one marker per implementation, projection, dtype and mode;
- ``<suite>_roofline.png``: achieved GFLOP/s per case against the roofline-attainable rate
  (``flops / floor_s``, the faster of the compute and memory bounds measured on this machine).
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["SUITES", "BenchUsageError", "plot_bench_json", "run_bench"]


class BenchUsageError(ValueError):
    """The benchmark cannot run as asked: exit code 2."""


SUITES = ("gmm", "layer")


def run_bench(
    *, out_dir: str | Path, quick: bool, dtype: str, mode: str, suites: tuple[str, ...] = SUITES
) -> dict[str, Path]:
    """Run the chosen suites of :mod:`moe_gmm.bench` (``gmm``, ``layer``) and plot their JSON."""
    from moe_gmm.bench import gmm, moe_layer

    mains = {"gmm": gmm.main, "layer": moe_layer.main}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    for suite in suites:
        if suite not in mains:
            raise BenchUsageError(f"suite must be one of {SUITES}, got {suite!r}")
        stem = "gmm" if suite == "gmm" else "moe_layer"
        json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
        # The layer suite's train-step table (what training runs) comes first, then the chosen mode.
        modes = f"train,{mode}" if suite == "layer" else mode
        argv = ["--dtype", dtype, "--modes", modes, "--out", str(json_path), "--markdown", str(md_path)]
        if quick:
            argv.insert(0, "--quick")
        try:
            code = mains[suite](argv)
        except SystemExit as exc:  # the harness reports bad arguments by exiting
            raise BenchUsageError(f"{suite} benchmark: {exc.code}") from None
        if code:
            raise BenchUsageError(f"the {suite} benchmark exited with {code}")
        files[f"{suite}_json"], files[f"{suite}_markdown"] = json_path, md_path
        files.update({f"{suite}_{k}": v for k, v in plot_bench_json(json_path, out, prefix=stem).items()})
    return files


def _case_label(row: dict) -> str:
    return f"{row['case']} {row.get('label', '')}".strip()


def plot_bench_json(json_path: str | Path, out_dir: str | Path, prefix: str = "gmm") -> dict[str, Path]:
    """Draw the two bench plots from a harness JSON file; returns their paths."""
    from moe_gmm.report import plots

    data = json.loads(Path(json_path).read_text())
    rows = [r for r in data["rows"] if r.get("median_s") is not None]
    out = Path(out_dir)
    times: dict[str, list[tuple[float, float, float]]] = {}
    achieved: dict[str, list[tuple[str, float]]] = {}
    for r in rows:
        params = r.get("params", {})
        # GMM cases record M and the active experts; layer cases T, k and E (uniform routing).
        rows = params.get("M") or params.get("num_tokens", 0) * params.get("top_k", 1)
        active = max(1, int(params.get("active_experts") or params.get("num_experts", 1)))
        rows_per_expert = float(rows) / active
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
        files["time_vs_rows"] = plots.plot_bench_times(
            times, out / f"{prefix}_time_vs_rows.png", "mean rows per active expert"
        )
        files["roofline"] = plots.plot_bench_roofline(achieved, None, out / f"{prefix}_roofline.png")
    return files
