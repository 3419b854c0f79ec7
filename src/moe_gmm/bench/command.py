"""``moe-gmm bench``: the GMM and MoE-layer benchmarks behind one command, plus plots and baselines.

The harness does the timing (warm-up, interleaved repeats, medians, correctness column, machine
header, progress bar, JSON); this module chooses the runners' arguments, then draws from the JSON:

- ``<suite>_time_vs_rows.png``: median time and achieved GFLOP/s against mean rows per active
  expert, one marker per implementation, projection, dtype and mode;
- ``<suite>_roofline.png``: achieved GFLOP/s per case against the roofline-attainable rate
  (``flops / floor_s``, the faster of the compute and memory bounds measured on this machine).

With ``compare`` each suite reruns the baseline's recorded command (the same cases, dtypes, modes
and repeats) and prints the rows improved or regressed (:mod:`moe_gmm.bench.compare`).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from moe_gmm._validation import writable_directory
from moe_gmm.bench.baseline import load_baseline, replay_argv

__all__ = ["SUITES", "BenchResult", "BenchUsageError", "plot_bench_json", "run_bench"]


class BenchUsageError(ValueError):
    """The benchmark cannot run as asked: exit code 2."""


SUITES = ("gmm", "layer")  # the layer suite's runner also writes the "train" baseline rows


@dataclass
class BenchResult:
    files: dict[str, Path] = field(default_factory=dict)
    regressed: bool = False  # a row slower than the baseline, beyond both runs' noise


def _suite_argv(
    suite: str, *, quick: bool, dtype: str, mode: str, baseline: dict | None, compare: Path | None
) -> list[str]:
    if baseline is None:
        # The layer suite's train-step table (what training runs) comes first, then the chosen mode.
        modes = f"train,{mode}" if suite == "layer" else mode
        argv = ["--dtype", dtype, "--modes", modes]
        return ["--quick", *argv] if quick else argv
    try:
        return [*replay_argv(baseline, suite), "--compare", str(compare)]
    except ValueError as exc:
        raise BenchUsageError(f"--compare {compare}: {exc}") from None


def run_bench(
    *,
    out_dir: str | Path,
    quick: bool,
    dtype: str,
    mode: str,
    suites: tuple[str, ...] = SUITES,
    compare: str | Path | None = None,
    baseline_out: str | Path | None = None,
) -> BenchResult:
    """Run the chosen suites (``gmm``, ``layer``) and plot their JSON.

    ``compare``: a baseline file; the suites it holds rerun its commands (``quick``, ``dtype`` and
    ``mode`` do not apply) and their rows are judged against it. ``baseline_out``: also write the
    runs' summary rows into this baseline file.
    """
    from moe_gmm.bench import gmm, moe_layer

    for suite in suites:
        if suite not in SUITES:
            raise BenchUsageError(f"suite must be one of {SUITES}, got {suite!r}")
    _check_backend_variable()
    baseline = None
    if compare is not None:
        baseline, suites = _baseline_suites(compare, suites)
    mains = {"gmm": gmm.main, "layer": moe_layer.main, "train": moe_layer.main}
    try:  # before minutes of benchmarks, not after them
        out = writable_directory(out_dir, "--out")
    except ValueError as exc:
        raise BenchUsageError(str(exc)) from None
    result = BenchResult()
    for index, suite in enumerate(suites):
        stem = {"gmm": "gmm", "layer": "moe_layer", "train": "train_step"}[suite]
        json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
        argv = _suite_argv(suite, quick=quick, dtype=dtype, mode=mode, baseline=baseline, compare=compare)
        if baseline is not None:  # a replay takes minutes and its runner prints nothing until measured
            rows = sum(r["suite"] == suite for r in baseline["rows"])
            print(f"--compare: rerunning the baseline's {suite} run ({index + 1} of {len(suites)}, {rows} rows)...")
        argv += ["--out", str(json_path), "--markdown", str(md_path)]
        if baseline_out is not None:
            argv += ["--baseline-out", str(baseline_out)]
        try:
            code = mains[suite](argv)
        except SystemExit as exc:  # the harness reports bad arguments by exiting
            raise BenchUsageError(f"{suite} benchmark: {exc.code}") from None
        if code == 1 and compare is not None:
            result.regressed = True
        elif code:
            raise BenchUsageError(f"the {suite} benchmark exited with {code}")
        files = result.files
        files[f"{suite}_json"], files[f"{suite}_markdown"] = json_path, md_path
        files.update({f"{suite}_{k}": v for k, v in plot_bench_json(json_path, out, prefix=stem).items()})
    if baseline_out is not None:
        result.files["baseline"] = Path(baseline_out)
    return result


def _check_backend_variable() -> None:
    """A ``$MOE_GMM_BACKEND`` naming no registered backend fails here, not inside the first case."""
    from moe_gmm.ops.backends import BACKEND_ENV_VAR, get_backend

    name = os.environ.get(BACKEND_ENV_VAR)
    if name and name != "auto":
        try:
            get_backend(name)
        except ValueError as exc:
            raise BenchUsageError(f"${BACKEND_ENV_VAR}: {exc}") from None


def _baseline_suites(compare: str | Path, suites: tuple[str, ...]) -> tuple[dict, tuple[str, ...]]:
    """The baseline behind ``--compare`` and the chosen suites it holds a run of."""
    try:
        baseline = load_baseline(compare)
    except ValueError as exc:
        raise BenchUsageError(f"--compare: {exc}") from None
    runs = baseline.get("runs", {})
    if "layer" in suites and "train" in runs and runs["train"]["command"] != runs.get("layer", {}).get("command"):
        suites = (*suites, "train")  # the headline rows came from a run of their own: rerun it too
    suites = tuple(s for s in suites if s in runs)
    if not suites:
        raise BenchUsageError(f"--compare: {compare} holds no run of the chosen suites")
    return baseline, suites


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
