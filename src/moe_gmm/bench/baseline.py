"""Baselines: one JSON file per machine class holding the summary rows of its accepted runs.

A run's JSON (the harness's full record: params, floors, errors, notes) becomes summary rows, one
per case x impl x dtype x mode that ran: median, p20/p80 and min in milliseconds, ratio to the
roofline floor (``x_case_floor``: at the GEMM rate measured in the case's rounds, where the run
measured it), speed-up over the run's reference and relative error. The baseline keeps the rows
of each suite (``gmm``, ``layer``, and ``train``: the layer runner's train-step rows, the headline)
from that suite's latest accepted run, with the run's command, so the same measurement can be
repeated; writing a suite's rows replaces that suite's rows in place.

``python -m moe_gmm.bench.baseline RUN.json [RUN.json ...] --out benchmarks/baselines/CLASS.json``
turns runs written earlier into a baseline.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "FORMAT",
    "RUNNERS",
    "SUITES",
    "load_baseline",
    "portable_command",
    "replay_argv",
    "row_key",
    "suite_of",
    "suites_of",
    "summary_rows",
    "update_baseline",
    "write_baseline",
]

FORMAT = "moe-gmm-baseline/1"
SUITES = ("gmm", "layer", "train")
RUNNERS = {"gmm": "moe_gmm.bench.gmm", "layer": "moe_gmm.bench.moe_layer", "train": "moe_gmm.bench.moe_layer"}
# The runners' names in commands recorded before they ran from the package (only from a clone's root).
_OLD_RUNNERS = {"gmm": "benchmarks.run_gmm", "layer": "benchmarks.run_moe_layer", "train": "benchmarks.run_moe_layer"}
# Machine fields that name the class; the rest (commit, load) belong to a run.
_MACHINE_FIELDS = (
    "cpu_model", "logical_cpus", "usable_cpus", "torch_threads", "cpu_capability", "torch_version", "blas",
)  # fmt: skip
# Runner options that name files: a replayed command gets its own.
_FILE_OPTIONS = ("--out", "--markdown", "--baseline-out", "--compare")

Key = tuple[str, str, str, str, str]


def row_key(row: dict[str, Any]) -> Key:
    """``(suite, case, impl, dtype, mode)``: what a run's row and a baseline's row are matched by."""
    return (row["suite"], row["case"], row["impl"], row["dtype"], row["mode"])


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 6)


def summary_rows(run: dict[str, Any], suite: str) -> list[dict[str, Any]]:
    """The summary rows of a run's JSON (``BenchReport.as_dict()``); skipped rows have no timing and are left out."""
    if suite not in SUITES:
        raise ValueError(f"suite must be one of {SUITES}, got {suite!r}")
    if suite == "train":
        return _train_rows(run)
    out = []
    for r in run["rows"]:
        if r.get("median_s") is None:
            continue
        out.append(
            {
                "suite": suite,
                "case": f"{r['case']} {r.get('label', '')}".strip(),
                "impl": r["impl"],
                "dtype": r["dtype"],
                "mode": r["mode"],
                "median_ms": _ms(r["median_s"]),
                "p20_ms": _ms(r.get("p20_s", r["median_s"])),
                "p80_ms": _ms(r.get("p80_s", r["median_s"])),
                "min_ms": _ms(r.get("min_s", r["median_s"])),
                "repeats": r.get("repeats"),
                "x_floor": _round(r.get("x_floor"), 4),
                "x_case_floor": _round(r.get("x_case_floor"), 4),
                "bound": r.get("bound"),
                "speedup_vs_reference": _round(r.get("speedup_vs_reference"), 4),
                "rel_err": None if r.get("rel_err") is None else float(f"{r['rel_err']:.3g}"),
            }
        )
    return out


def _train_rows(run: dict[str, Any]) -> list[dict[str, Any]]:
    """The train-step rows (``run["train_step"]``, already in milliseconds) as summary rows."""
    out = []
    for r in run.get("train_step", {}).get("rows", []):
        if r.get("median_ms") is None:
            continue
        errors = [e for e in (r.get("loss_rel_err"), r.get("grad_rel_err")) if e is not None]
        out.append(
            {
                "suite": "train",
                "case": f"{r['model']} {r['case']}",
                "impl": r["impl"],
                "dtype": r["dtype"],
                "mode": r["mode"],
                "median_ms": _round(r["median_ms"], 6),
                "p20_ms": _round(r.get("p20_ms", r["median_ms"]), 6),
                "p80_ms": _round(r.get("p80_ms", r["median_ms"]), 6),
                "min_ms": _round(r.get("min_ms", r["median_ms"]), 6),
                "repeats": r.get("repeats"),
                "speedup_vs_reference": _round(r.get("speedup_vs_hf_grouped_mm"), 4),
                "rel_err": float(f"{max(errors):.3g}") if errors else None,
            }
        )
    return out


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def suites_of(run: dict[str, Any]) -> list[str]:
    """The suites a run's JSON holds rows of: a layer run can hold ``layer`` and ``train`` rows."""
    command = run.get("command") or run.get("train_step", {}).get("command", "")
    if _runs(command, "gmm"):
        return ["gmm"]
    if _runs(command, "layer"):
        held = [s for s, rows in (("layer", run.get("rows")), ("train", run.get("train_step", {}).get("rows"))) if rows]
        return held or ["layer"]
    raise ValueError(f"run: its command names none of the runners {sorted(set(RUNNERS.values()))}, got {command!r}")


def suite_of(run: dict[str, Any]) -> str:
    """The first suite a run's JSON holds rows of (see :func:`suites_of`)."""
    return suites_of(run)[0]


def load_baseline(path: str | Path) -> dict[str, Any]:
    """Read a baseline file; ValueError naming the file and the first field that breaks the schema.

    Everything a comparison reads is checked here, so a file of another shape fails before any
    benchmark runs instead of deep inside one.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"baseline {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"baseline {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"baseline {path}: not JSON ({exc.msg}, line {exc.lineno})") from None
    except RecursionError:  # the decoder recurses once per nested array or object
        raise ValueError(f"baseline {path}: nested too deeply to be a baseline") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"baseline {path}: format must be {FORMAT!r}, got {_short(found)}")
    problem = _schema_problem(data)
    if problem:
        raise ValueError(f"baseline {path}: {problem}")
    return data


# Row fields a comparison reads, with their JSON types; ``p20_ms`` / ``p80_ms`` may be absent.
_ROW_TEXT = ("suite", "case", "impl", "dtype", "mode")
_ROW_MS = ("median_ms", "p20_ms", "p80_ms")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _schema_problem(data: dict[str, Any]) -> str | None:
    """The first way ``data`` differs from the baseline schema, or None."""
    rows, runs = data.get("rows", []), data.get("runs", {})
    if not isinstance(rows, list):
        return f"'rows' must be a list, got {type(rows).__name__}"
    if not isinstance(runs, dict):
        return f"'runs' must be an object, got {type(runs).__name__}"
    for suite, run in runs.items():
        if suite not in SUITES:
            return f"runs.{_short(suite)}: not a suite; suites are {list(SUITES)}"
        command = run.get("command") if isinstance(run, dict) else run
        if not isinstance(command, str):
            return f"runs.{suite}.command must be a string, got {_short(command)}"
    for i, row in enumerate(rows):
        problem = _row_problem(row)
        if problem:
            return f"rows[{i}]: {problem}"
    return None


def _row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"must be an object, got {_short(row)}"
    missing = [k for k in (*_ROW_TEXT, "median_ms") if k not in row]
    if missing:
        return f"a row lacks {missing}"
    for key in _ROW_TEXT:
        if not isinstance(row.get(key), str):
            return f"{key!r} must be a string, got {_short(row.get(key))}"
    for key in _ROW_MS:
        value = row.get(key, 0.0 if key != "median_ms" else None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            return f"{key!r} must be a number >= 0, got {_short(value)}"
    return None


def update_baseline(
    path: str | Path, run: dict[str, Any], *, suite: str | None = None, machine_class: str | None = None
) -> Path:
    """Write ``run``'s summary rows into the baseline at ``path``, replacing the rows of the same suite.

    A new file is created; an existing one keeps its other suites. ``machine_class`` defaults to the
    file's name. The run must come from the machine the file describes (same CPU model and count).
    """
    path = Path(path)
    suite = suite or suite_of(run)
    record = run["train_step"] if suite == "train" else run  # where the run's machine and command are
    machine = {k: record["machine"].get(k) for k in _MACHINE_FIELDS}
    old = load_baseline(path) if path.exists() else {"rows": [], "runs": {}}
    if "machine" in old:
        differs = [k for k in ("cpu_model", "logical_cpus") if old["machine"].get(k) != machine[k]]
        if differs:
            theirs = {k: old["machine"].get(k) for k in differs}
            ours = {k: machine[k] for k in differs}
            raise ValueError(f"baseline {path}: it describes {theirs}, this run's machine is {ours}")
    limits = run.get("limits", {})
    runs = {
        **old["runs"],
        suite: {
            "command": portable_command(record.get("command", "")),
            "started_utc": record.get("started_utc", ""),
            "git_commit": record["machine"].get("git_commit"),
            "reference": run.get("reference"),
            "peak_gflops": {k: round(v / 1e9, 1) for k, v in limits.get("peak_flops", {}).items()},
            "copy_gb_s": round(limits["copy_bandwidth"] / 1e9, 2) if "copy_bandwidth" in limits else None,
        },
    }
    rows = [r for r in old["rows"] if r["suite"] != suite] + summary_rows(run, suite)
    data = {
        "format": FORMAT,
        "machine_class": machine_class or old.get("machine_class") or path.stem,
        "machine": machine,
        "runs": dict(sorted(runs.items())),
        "rows": sorted(rows, key=row_key),
    }
    write_baseline(path, data)
    return path


def write_baseline(path: str | Path, data: dict[str, Any]) -> None:
    """Write ``data`` one row per line, so a replaced baseline's diff shows which rows moved."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = ",\n".join("  " + json.dumps(r) for r in data["rows"])
    head = json.dumps({k: v for k, v in data.items() if k != "rows"}, indent=1)[:-2]
    path.write_text(f'{head},\n "rows": [\n{body}\n ]\n}}\n')


def _without_file_options(words: list[str]) -> list[str]:
    out, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in _FILE_OPTIONS:
            skip = True
        elif not word.startswith(tuple(f"{o}=" for o in _FILE_OPTIONS)):
            out.append(word)
    return out


def portable_command(command: str) -> str:
    """``command`` without the options that name files: what anyone can rerun, on any machine."""
    return shlex.join(_without_file_options(shlex.split(command)))


def replay_argv(baseline: dict[str, Any], suite: str) -> list[str]:
    """The runner arguments of the baseline's ``suite`` run, without its file options."""
    run = baseline.get("runs", {}).get(suite)
    if run is None:
        raise ValueError(f"baseline: no {suite!r} run; it has {sorted(baseline.get('runs', {}))}")
    words = shlex.split(run["command"])
    runner = next((name for name in (RUNNERS[suite], _OLD_RUNNERS[suite]) if name in words), None)
    if runner is None:
        raise ValueError(f"baseline: the {suite!r} command must run {RUNNERS[suite]}, got {run['command']!r}")
    return _without_file_options(words[words.index(runner) + 1 :])


def _runs(command: str, suite: str) -> bool:
    """Whether ``command`` runs the runner of ``suite``, under its current or its former name."""
    return RUNNERS[suite] in command or _OLD_RUNNERS[suite] in command


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write the summary rows of benchmark runs into a baseline file.")
    p.add_argument("runs", nargs="+", help="run JSON files written by moe_gmm.bench.gmm / moe_layer --out")
    p.add_argument("--out", required=True, help="the baseline file, e.g. benchmarks/baselines/CLASS.json")
    p.add_argument("--machine-class", default=None, help="the class's name (default: the file's name)")
    args = p.parse_args(argv)
    for run_path in args.runs:
        run = json.loads(Path(run_path).read_text())
        for suite in suites_of(run):
            update_baseline(args.out, run, suite=suite, machine_class=args.machine_class)
            print(f"{run_path}: {len(summary_rows(run, suite))} {suite} rows -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
