"""How fast two threads read the experts' weights from memory in the few-row kernels' orders.

``python -m benchmarks.run_read_order [--shape E,K,N ...] [--seconds S] [--out FILE] [--markdown FILE]``

A weight-streaming product (experts of a few rows each) can go no faster than its weight can be
read in the order its kernel reads it. This compiles ``benchmarks/read_order/read_order.cpp`` with
``$CXX`` (default ``g++``; AVX-512 and OpenMP needed) and times, round after round, plain reads of
E float32 ``[K, N]`` weights: front to back, in the `nn` blocks' 64-column strips (with and without
the next strip prefetched), in the few-row bands of 16 rows, and in strips over chunks of 64 rows
with the next chunk prefetched front to back. The machine's memory bandwidth
drifts between two states over minutes, so each round times every order back to back, rounds go on
for ``--seconds`` per shape, and the table gives each order's rate against front to back in the same
round, over all rounds and over those in the fast state.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from moe_gmm.bench.table import write_outputs
from moe_gmm.ops.native import cpuinfo_value

SOURCE = Path(__file__).with_name("read_order") / "read_order.cpp"
DEFAULT_SHAPES = ("256,256,1024", "256,1024,512")  # E256 down and gate_up, float32
ROUNDS_PER_BATCH = 5
MAX_ELEMENTS = 1 << 28  # the probe's float sums count the elements read exactly up to here
FAST_STATE_GBPS = 65.0  # this VM's copy bandwidth flips between about 36-47 and 65-83 GB/s


def _shape(text: str) -> tuple[int, int, int]:
    try:
        e, k, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected E,K,N, got {text!r}") from None
    if e < 2 or k < 16 or k % 16 or n < 64 or n % 64 or e * k * n > MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(
            f"need E >= 2, K a multiple of 16, N a multiple of 64, E*K*N <= 2**28; got {text!r}"
        )
    return e, k, n


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def unsupported_reason() -> str | None:
    """Why the probe cannot run here (no compiler, no AVX-512), or None."""
    if shutil.which(_compiler()) is None:
        return f"compiler {_compiler()!r} not found (set CXX)"
    flags = cpuinfo_value("flags")
    if flags is None or "avx512f" not in flags.split():
        return "the probe needs an x86 CPU with AVX-512F"
    return None


def build(directory: Path) -> Path:
    """Compile the probe into ``directory``; the executable's path."""
    if (reason := unsupported_reason()) is not None:
        raise SystemExit(f"run_read_order: {reason}")
    binary = directory / "read_order"
    subprocess.run(
        [_compiler(), "-O2", "-march=native", "-fopenmp", str(SOURCE), "-o", str(binary)],
        check=True,
    )
    return binary


def measure(binary: Path, shape: tuple[int, int, int], seconds: float, threads: int) -> list[dict[str, Any]]:
    """Batches of rounds (one process each, so every batch allocates afresh) for ``seconds``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "close"}
    records: list[dict[str, Any]] = []
    expected = shape[0] * shape[1] * shape[2]
    start = time.monotonic()
    batch = 0
    while batch == 0 or time.monotonic() - start < seconds:
        out = subprocess.run(
            [str(binary), *map(str, shape), str(ROUNDS_PER_BATCH)], check=True, capture_output=True, text=True, env=env
        ).stdout
        for line in out.splitlines():
            if line.strip():
                r = json.loads(line)
                if r["elements_read"] != expected:
                    raise RuntimeError(f"order {r['order']!r} read {r['elements_read']} elements of {expected}")
                r["round"] += batch * ROUNDS_PER_BATCH
                r["gbps"] = r["bytes"] / r["seconds"] / 1e9
                records.append(r)
        batch += 1
    return records


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per order: best GB/s, and its rate against front to back in the same round (median, range),
    over all rounds and over the rounds whose front-to-back read ran in the fast memory state."""
    rounds: dict[int, dict[str, float]] = {}
    for r in records:
        rounds.setdefault(r["round"], {})[r["order"]] = r["gbps"]
    orders = list(dict.fromkeys(r["order"] for r in records))
    fast = [rd for rd in rounds.values() if rd["sequential"] >= FAST_STATE_GBPS]
    summary: dict[str, Any] = {"rounds": len(rounds), "fast_rounds": len(fast), "orders": {}}
    for order in orders:
        ratios = [rd[order] / rd["sequential"] for rd in rounds.values()]
        fast_ratios = [rd[order] / rd["sequential"] for rd in fast]
        summary["orders"][order] = {
            "best_gbps": max(rd[order] for rd in rounds.values()),
            "vs_sequential_median": statistics.median(ratios),
            "vs_sequential_range": [min(ratios), max(ratios)],
            "vs_sequential_fast_median": statistics.median(fast_ratios) if fast_ratios else None,
        }
    return summary


def per_round(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Every round's GB/s per order, compactly: ``{"orders": [...], "rounds_gbps": [[...], ...]}``.

    Three significant digits, not a fixed number of decimals: a round stalled by the OS can run
    at a few MB/s, which must not print as a rate of zero."""
    orders = list(dict.fromkeys(r["order"] for r in records))
    rounds: dict[int, dict[str, float]] = {}
    for r in records:
        rounds.setdefault(r["round"], {})[r["order"]] = float(f"{r['gbps']:.3g}")
    return {"orders": orders, "rounds_gbps": [[rd[o] for o in orders] for _, rd in sorted(rounds.items())]}


def markdown(results: list[dict[str, Any]], threads: int) -> str:
    lines = [
        (
            f"Weight read orders, float32, {threads} threads: best GB/s over the rounds, and the rate against front "
            f"to back in the same round (median [range]; fast rounds: front to back at >= {FAST_STATE_GBPS:.0f} GB/s)"
        ),
        "",
        "| E, K, N | order | best GB/s | vs front to back | in fast rounds |",
        "|---|---|---:|---:|---:|",
    ]
    for res in results:
        s = res["summary"]
        for order, o in s["orders"].items():
            lo, hi = o["vs_sequential_range"]
            fast = o["vs_sequential_fast_median"]
            fast_text = f"{fast:.2f} ({s['fast_rounds']} of {s['rounds']})" if fast is not None else "none"
            lines.append(
                f"| {res['shape']} | {order} | {o['best_gbps']:.1f} | {o['vs_sequential_median']:.2f} "
                f"[{lo:.2f}-{hi:.2f}] | {fast_text} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shape", action="append", type=_shape, help="E,K,N (repeatable; default: E256 down and gate_up)"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="time spent per shape (default 60)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("out/bench/read_order.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.seconds < 0:
        parser.error("--seconds: must be >= 0")
    if args.threads < 1:
        parser.error("--threads: must be >= 1")
    shapes = args.shape or [_shape(s) for s in DEFAULT_SHAPES]
    with tempfile.TemporaryDirectory() as tmp:
        binary = build(Path(tmp))
        results = []
        for shape in shapes:
            records = measure(binary, shape, args.seconds, args.threads)
            results.append({"shape": ",".join(map(str, shape)), "summary": summarize(records), **per_round(records)})
    text = markdown(results, args.threads)
    print(text, end="")
    report = {
        "command": "python -m benchmarks.run_read_order " + " ".join(sys.argv[1:] if argv is None else argv),
        "threads": args.threads,
        "results": results,
    }
    write_outputs(report, text, args.out, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
