"""What a padded weight row stride is worth: the same weights, contiguous and with every row padded.

``python -m benchmarks.run_row_stride [--cases results] [--filter E256] [--dtype fp32,bf16]
[--modes fwd,fwdbwd] [--pad 32 | --pad 16,64,256] [--backend cpu] [--repeats 12] [--threads 2]
[--out FILE] [--markdown FILE]``

A contiguous ``[E, K, N]`` weight with N = 1024 float32 puts every row 4 KiB from the next, and some
CPUs stream such a weight slower than the same values with rows a little further apart. For each
case and dtype this builds the benchmark's weight contiguous and, for every pad asked for, as a
view of ``[E, K, N + pad]`` (:attr:`moe_gmm.bench.gmm.GmmCase.weight_row_pad`; the ``ENK`` layout
pads the ``[E, N, K]`` rows), times ``grouped_matmul`` on all of them taking turns in one process
(the machine's state drifts; a ratio from one process is what holds), and checks that the output
and both gradients are identical bit for bit to the contiguous weight's. They are when the padded
rows stay 16-byte aligned: the same kernels then read the weight in place, so the stride changes
the time but not the sums (a stride off that alignment can send a pass to another kernel; the run
then exits with status 1).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from moe_gmm.bench.gmm import CASE_SETS, PROJECTIONS, GmmCase, auto_backend_name, case_set, gmm_impls
from moe_gmm.bench.harness import MODES, TimingSettings, _timed_callable, split_choices, time_interleaved
from moe_gmm.bench.machine import DTYPE_NAMES
from moe_gmm.bench.table import markdown_table, write_outputs

__all__ = ["compare_case", "main", "markdown"]


def compare_case(
    case: GmmCase, dtype: torch.dtype, modes: list[str], pads: list[int], backend: str, settings: TimingSettings
) -> list[dict[str, Any]]:
    """One row per mode and pad: the contiguous and padded timings (all layouts taking turns), the
    speed-up of padding, and whether the results match the contiguous weight's."""
    if not pads or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in pads):
        raise ValueError(f"pads must be positive ints, got {pads!r}")
    if len(set(pads)) != len(pads):
        raise ValueError(f"pads must differ, got {pads!r}")
    layouts = {"contiguous": replace(case, weight_row_pad=0)}
    layouts.update({f"pad {p}": replace(case, weight_row_pad=p) for p in pads})
    inputs = {name: c.make_inputs(dtype) for name, c in layouts.items()}
    impl = gmm_impls([backend])[-1]
    workloads = {name: impl.prepare(inp) for name, inp in inputs.items()}
    outs = {name: w.forward() for name, w in workloads.items()}
    grad_out = torch.randn(outs["contiguous"].shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    results = {
        name: (outs[name].detach(), *torch.autograd.grad(outs[name], w.leaves, grad_out))
        for name, w in workloads.items()
    }

    def stride_bytes(name: str) -> int:
        return max(inputs[name].w_EKN.stride()[1:]) * inputs[name].w_EKN.element_size()

    rows = []
    for mode in modes:
        fns = {name: _timed_callable(w, mode, grad_out) for name, w in workloads.items()}
        timings = time_interleaved(fns, settings)
        base = timings["contiguous"]
        for p in pads:
            name = f"pad {p}"
            rows.append(
                {
                    "case": case.name,
                    **case.columns(),
                    "dtype": DTYPE_NAMES[dtype],
                    "mode": mode,
                    "pad": p,
                    "weight_row_stride_bytes": [stride_bytes("contiguous"), stride_bytes(name)],
                    "contiguous_median_s": base.median_s,
                    "contiguous_min_s": base.min_s,
                    "padded_median_s": timings[name].median_s,
                    "padded_min_s": timings[name].min_s,
                    "repeats": timings[name].repeats,
                    "speedup": base.median_s / timings[name].median_s,
                    "identical": all(
                        torch.equal(a, b) for a, b in zip(results["contiguous"], results[name], strict=True)
                    ),
                }
            )
    return rows


def markdown(rows: list[dict[str, Any]], backend: str, threads: int) -> str:
    lines = [
        (
            f"`grouped_matmul` (backend `{backend}`, {threads} threads) on the same weights, contiguous and with "
            "each row padded by `pad` elements, all taking turns in one process: median (min) ms, and the "
            "speed-up of the padded rows (contiguous median / padded median)"
        ),
        "",
    ]
    header = (
        "case", "projection", "dtype", "mode", "pad", "row stride (bytes)", "contiguous", "padded", "speed-up", "identical"
    )  # fmt: skip
    cells = [
        (
            r["case"],
            r["label"],
            r["dtype"],
            r["mode"],
            r["pad"],
            f"{r['weight_row_stride_bytes'][0]} / {r['weight_row_stride_bytes'][1]}",
            f"{r['contiguous_median_s'] * 1e3:.2f} ({r['contiguous_min_s'] * 1e3:.2f})",
            f"{r['padded_median_s'] * 1e3:.2f} ({r['padded_min_s'] * 1e3:.2f})",
            f"{r['speedup']:.2f}x",
            "yes" if r["identical"] else "**no**",
        )
        for r in rows
    ]
    return "\n".join(lines + markdown_table(header, cells, right={4, 6, 7, 8})) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="results", help=f"case set: {', '.join(CASE_SETS)} (default results)")
    parser.add_argument("--filter", default="E256", help="only cases whose name contains this text (default E256)")
    parser.add_argument("--projection", default=",".join(PROJECTIONS), help="comma list of gate_up, down")
    parser.add_argument("--weight-layout", default="EKN", choices=("EKN", "ENK"))
    parser.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    parser.add_argument("--modes", default="fwd,fwdbwd", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument(
        "--pad",
        default="32",
        help="elements of padding after each weight row; a comma list compares several (default 32)",
    )
    parser.add_argument("--backend", default=None, help="the backend timed (default: what auto picks on CPU)")
    parser.add_argument("--repeats", type=int, default=12, help="timed rounds per layout (default 12)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--out", type=Path, default=Path("out/bench/row_stride.json"))
    parser.add_argument("--markdown", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        pads = [int(p) for p in args.pad.split(",")]
    except ValueError:
        parser.error(f"--pad: a comma list of positive ints, got {args.pad!r}")
    if any(p < 1 for p in pads) or len(set(pads)) != len(pads):
        parser.error(f"--pad: distinct ints >= 1, got {args.pad!r}")
    if args.repeats < 1:
        parser.error(f"--repeats: must be >= 1, got {args.repeats}")
    if args.threads is not None:
        if args.threads < 1:
            parser.error(f"--threads: must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    by_name = {name: dtype for dtype, name in DTYPE_NAMES.items()}
    dtypes = [by_name[n] for n in split_choices(args.dtype, ("fp32", "bf16", "fp16"), "--dtype")]
    modes = split_choices(args.modes, MODES, "--modes")
    projections = split_choices(args.projection, PROJECTIONS, "--projection")
    backend = args.backend or auto_backend_name()
    try:
        gmm_impls([backend])
    except ValueError as err:
        parser.error(f"--backend: {err}")
    cases = [
        replace(c, weight_layout=args.weight_layout)
        for c in case_set(args.cases)
        if c.projection in projections and args.filter in c.name
    ]
    if not cases:
        parser.error("no case matches --cases/--filter/--projection")
    settings = TimingSettings(warmup=1, min_repeats=args.repeats, max_repeats=args.repeats, min_seconds=0.0)
    rows = []
    for case in cases:
        for dtype in dtypes:
            print(f"{case.name} {case.projection} {DTYPE_NAMES[dtype]}...", file=sys.stderr, flush=True)
            rows.extend(compare_case(case, dtype, modes, pads, backend, settings))
    text = markdown(rows, backend, torch.get_num_threads())
    print(text, end="")
    report = {
        "command": "python -m benchmarks.run_row_stride " + " ".join(sys.argv[1:] if argv is None else argv),
        "threads": torch.get_num_threads(),
        "backend": backend,
        "rows": rows,
    }
    write_outputs(report, text, args.out, args.markdown)
    return 0 if all(r["identical"] for r in rows) else 1
