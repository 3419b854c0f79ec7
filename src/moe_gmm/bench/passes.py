"""The three passes of the ``cpu`` backend one at a time, for comparing two versions of its kernels.

On a shared machine the same code runs 20-50% apart from one hour to the next, and a before/after
pair of full benchmark runs minutes apart can show a change that is only the neighbours. So a
kernel change is measured as an A/B: each checkout times forward, grad_input and grad_weight on
the grouped-matmul cases (``time``), the two checkouts take turns several times, and ``compare``
keeps each side's best time per pass over all its turns::

    for turn in 1 2 3; do
      PYTHONPATH=../base/src python -m benchmarks.run_passes time --out /tmp/base_$turn.json
      PYTHONPATH=src python -m benchmarks.run_passes time --out /tmp/new_$turn.json
    done
    python -m benchmarks.run_passes compare --base /tmp/base_*.json --new /tmp/new_*.json --markdown AB.md

Times are the best of ``--repeats`` calls of the backend function itself (no autograd), with
inputs and weights exactly as ``moe_gmm.bench.gmm`` builds them.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from moe_gmm.bench.gmm import CASE_SETS, case_set
from moe_gmm.bench.machine import describe_machine, dtype_name

__all__ = ["PASSES", "compare_runs", "main", "time_passes"]

PASSES = ("forward", "grad_input", "grad_weight")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _best_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: workspace, oneDNN kernels, native build
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def time_passes(cases: str, dtype: torch.dtype, repeats: int, name_filter: str | None = None) -> dict[str, Any]:
    """``{"machine", "dtype", "cases": {name: {pass: seconds}}}`` for the cpu backend on ``cases``."""
    from moe_gmm.ops.backends import cpu

    timed: dict[str, dict[str, float]] = {}
    for case in case_set(cases):
        name = f"{case.name} {case.projection}"
        if name_filter and name_filter not in name:
            continue
        inputs = case.make_inputs(dtype)
        x, w = inputs.x_MK.detach(), inputs.w_EKN.detach()
        ends = torch.cumsum(inputs.counts_E, 0)
        dy = torch.randn(x.shape[0], w.shape[2], generator=torch.Generator().manual_seed(case.seed)).to(dtype)
        calls = {
            "forward": lambda x=x, w=w, ends=ends: cpu.forward(x, w, ends),
            "grad_input": lambda dy=dy, w=w, ends=ends: cpu.grad_input(dy, w, ends),
            "grad_weight": lambda x=x, dy=dy, ends=ends: cpu.grad_weight(x, dy, ends),
        }
        timed[name] = {p: _best_seconds(calls[p], repeats) for p in PASSES}
    return {"machine": asdict(describe_machine()), "dtype": dtype_name(dtype), "repeats": repeats, "cases": timed}


def _best_over(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    best: dict[str, dict[str, float]] = {}
    for run in runs:
        for name, passes in run["cases"].items():
            slot = best.setdefault(name, {})
            for p, seconds in passes.items():
                slot[p] = min(slot.get(p, math.inf), seconds)
    return best


def compare_runs(base: list[dict[str, Any]], new: list[dict[str, Any]]) -> dict[str, Any]:
    """Per case and pass, each side's best time over its runs and the speed-up base / new; geomeans."""
    if not base or not new:
        raise ValueError("compare_runs: base and new each need at least one run")
    dtypes = {run["dtype"] for run in base + new}
    if len(dtypes) != 1:
        raise ValueError(f"compare_runs: runs of different dtypes {sorted(dtypes)}")
    b, n = _best_over(base), _best_over(new)
    common = [name for name in b if name in n]
    if not common:
        raise ValueError("compare_runs: the two sides share no case")
    rows = []
    for name in common:
        row: dict[str, Any] = {"case": name}
        for p in (*PASSES, "total"):
            before = sum(b[name].values()) if p == "total" else b[name][p]
            after = sum(n[name].values()) if p == "total" else n[name][p]
            row[p] = {"base_ms": before * 1e3, "new_ms": after * 1e3, "speedup": before / after}
        rows.append(row)
    geomean = {p: math.exp(sum(math.log(r[p]["speedup"]) for r in rows) / len(rows)) for p in (*PASSES, "total")}
    return {"dtype": dtypes.pop(), "base_runs": len(base), "new_runs": len(new), "rows": rows, "geomean": geomean}


def comparison_markdown(result: dict[str, Any]) -> str:
    head = "| case | " + " | ".join(f"{p} ms (speed-up)" for p in (*PASSES, "total")) + " |"
    lines = [
        (
            f"{result['dtype']}: best of {result['base_runs']} base and {result['new_runs']} new runs; "
            "ms base -> new (base / new)"
        ),
        "",
        head,
        "|---" * (len(PASSES) + 2) + "|",
    ]
    for row in result["rows"]:
        cells = [
            f"{row[p]['base_ms']:.1f} -> {row[p]['new_ms']:.1f} ({row[p]['speedup']:.2f}x)" for p in (*PASSES, "total")
        ]
        lines.append(f"| {row['case']} | " + " | ".join(cells) + " |")
    lines.append("| geomean | " + " | ".join(f"{result['geomean'][p]:.2f}x" for p in (*PASSES, "total")) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="cpu backend passes, one at a time: time a checkout, or compare two.")
    sub = parser.add_subparsers(dest="command", required=True)
    timing = sub.add_parser("time", help="time forward, grad_input and grad_weight on a case set")
    timing.add_argument("--cases", default="results", choices=sorted(CASE_SETS), help="case set (default: results)")
    timing.add_argument("--filter", default=None, help="only cases whose name contains this text")
    timing.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="default: bf16")
    timing.add_argument("--repeats", type=int, default=5, help="timed calls per pass; the best counts")
    timing.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    timing.add_argument("--out", required=True, help="write the JSON here")
    comparing = sub.add_parser("compare", help="compare runs: --base BASE.json ... --new NEW.json ...")
    comparing.add_argument("--base", nargs="+", required=True, help="the base checkout's runs (JSON from `time`)")
    comparing.add_argument("--new", nargs="+", required=True, help="the new checkout's runs")
    comparing.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    if args.command == "time":
        if args.repeats < 1:
            parser.error("--repeats must be at least 1")
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        result = time_passes(args.cases, _DTYPES[args.dtype], args.repeats, args.filter)
        Path(args.out).write_text(json.dumps(result, indent=1))
        for name, passes in result["cases"].items():
            print(f"{name:42s} " + "  ".join(f"{p} {s * 1e3:7.2f} ms" for p, s in passes.items()))
        return 0
    base = [json.loads(Path(f).read_text()) for f in args.base]
    new = [json.loads(Path(f).read_text()) for f in args.new]
    table = comparison_markdown(compare_runs(base, new))
    print(table, end="")
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0
