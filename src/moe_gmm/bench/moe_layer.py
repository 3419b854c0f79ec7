"""MoE-layer benchmark: one Qwen3.5-MoE sparse block, moe-gmm's vs transformers', side by side.

The cases and implementations are in :mod:`moe_gmm.bench.layer_cases`.

The headline mode, ``train`` (printed first), times the step training runs: ``zero_grad``, forward,
``loss.backward()``, AdamW's step, over this block and small causal LMs (:mod:`moe_gmm.bench.train_step`).
The other modes time ``torch.autograd.grad``, which never accumulates into ``.grad``.

:func:`profile_breakdown` times ``moe_gmm``'s phases with ``torch.profiler`` from the
``record_function`` labels in the layer: ``moe::router``, ``moe::permute``, ``moe::gmm``,
``moe::swiglu``, ``moe::unpermute``, ``moe::shared_expert`` (forward), ``moe::*_bwd`` and the
grouped matmul's grad ops (backward); it reports the median of ``--breakdown-steps`` profiled steps.

``--memory`` also reports, per case x dtype x implementation, the resident peak of one fwd+bwd step
against its budget (weights + grads + ``x`` and ``dx`` + the activations autograd saves), each
measured in a fresh process; the definitions are in :mod:`moe_gmm.bench.memory`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from moe_gmm.bench import train_step
from moe_gmm.bench.compare import apply_baseline_options, check_baseline_options
from moe_gmm.bench.harness import (
    TimingSettings,
    case_rate_note,
    recheck_calibration,
    run_benchmark,
    time_interleaved,
)
from moe_gmm.bench.runner import (
    add_run_arguments,
    maybe_progress,
    restores_threads,
    set_threads,
    split_choices,
    warning_printer,
)
from moe_gmm.bench.layer_cases import CASE_SETS, DEFAULT_IMPLS, IMPLS, MoeLayerCase, case_set, layer_impls
from moe_gmm.bench.machine import DTYPE_NAMES, describe_machine, gemm_rate_probes, measure_limits
from moe_gmm.bench.memory import measure_in_subprocess, memory_markdown, print_memory_table

# CASE_SETS, IMPLS, MoeLayerCase, case_set, layer_impls: re-exported from layer_cases.
__all__ = [
    "CASE_SETS",
    "IMPLS",
    "MoeLayerCase",
    "case_set",
    "layer_impls",
    "main",
    "measure_memory",
    "profile_breakdown",
    "time_glue_alone",
]


# Forward phases are the layer's own labels; backward phases are our autograd labels and the
# grouped matmul's grad ops (each custom op is one profiler event).
_FWD_PHASES = {
    "moe::router": "router",
    "moe::permute": "permute",
    "moe::gmm": "gmm",
    "moe::swiglu": "swiglu",
    "moe::unpermute": "unpermute",
    "moe::shared_expert": "shared_expert",
}
_BWD_PHASES = {
    "moe::permute_bwd": "permute",
    "moe_gmm::grouped_matmul_grad_input": "gmm",
    "moe_gmm::grouped_matmul_grad_weight": "gmm",
    "moe::swiglu_bwd": "swiglu",
    "moe::unpermute_bwd": "unpermute",
}
PHASES = ("router", "permute", "gmm", "swiglu", "unpermute", "shared_expert", "other")


def _phases_of(prof) -> dict[str, dict[str, float]]:
    """One profiled step's milliseconds by phase."""
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    out: dict[str, dict[str, float]] = {
        "fwd": dict.fromkeys(PHASES, 0.0),
        "bwd": dict.fromkeys((p for p in PHASES if p not in ("router", "shared_expert")), 0.0),
    }
    for key, phase in _FWD_PHASES.items():
        out["fwd"][phase] += totals.get(key, 0.0)
    for key, phase in _BWD_PHASES.items():
        out["bwd"][phase] += totals.get(key, 0.0)
    for direction, label in (("fwd", "moe::step_fwd"), ("bwd", "moe::step_bwd")):
        labelled = sum(out[direction].values())
        out[direction]["other"] = max(totals.get(label, 0.0) - labelled, 0.0)
        out[direction]["total"] = totals.get(label, 0.0)
    return out


def _block_step(case: MoeLayerCase, dtype: torch.dtype):
    """``moe_gmm``'s block for ``case``, its input, an upstream gradient and one labelled fwd+bwd step."""
    inp = case.make_inputs(dtype)
    block, x = inp.block, inp.x
    params = [x, *block.parameters()]
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)

    def step():
        with record_function("moe::step_fwd"):
            out = block(x)
        with record_function("moe::step_bwd"):
            return torch.autograd.grad(out, params, dy)

    return block, x, dy, step


def profile_breakdown(case: MoeLayerCase, dtype: torch.dtype, *, steps: int = 3) -> dict[str, dict[str, float]]:
    """Milliseconds of ``moe_gmm``'s forward and backward by phase, in the median of ``steps`` steps.

    Each step is profiled on its own; the result is the step whose fwd+bwd total is the median (the
    lower of the two middle ones for an even count), whole, so its phases add up to its total. One
    step disturbed by the machine (a shared VM's steps vary by several ms) then moves no phase.
    ``other`` is the rest of the labelled step: in the forward the residual add and reshapes, in
    the backward the router's and the shared expert's autograd (plain ``nn.Linear`` ops, not
    labelled individually, so ``bwd`` has no ``router``/``shared_expert`` entries) and gradient
    bookkeeping. One warm-up step runs outside the profile. The profiler's cost per op is in every
    phase, most in those of many short ops (permute, unpermute).
    """
    if isinstance(steps, bool) or not isinstance(steps, int):
        raise TypeError(f"steps must be an int, got {type(steps).__name__}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    _, _, _, step = _block_step(case, dtype)
    step()
    results = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        results.append(_phases_of(prof))
    results.sort(key=lambda r: r["fwd"]["total"] + r["bwd"]["total"])
    return results[(steps - 1) // 2]


def time_glue_alone(case: MoeLayerCase, dtype: torch.dtype, settings: TimingSettings | None = None) -> dict[str, float]:
    """permute + unpermute forward and backward timed without the profiler, against the layer's step.

    The profiler's cost per op inflates the phases of many short ops (:func:`profile_breakdown`),
    so the glue's share is also measured this way: ``moe_gmm``'s block runs fwd+bwd, and
    ``permute`` of the same input with the block's own routing followed by ``unpermute`` of the
    permuted rows (standing in for the experts' output, same shape) runs fwd+bwd into the input and
    the routing weights; the two are timed in interleaved rounds (medians), so the glue starts
    where a step left the caches and the thread pool, as in training. Neither measure is exact:
    the profiled share carries the profiler's cost per op; this one times the glue's ops apart
    from the phases that warm its inputs in the layer. Returns ``glue_ms``, ``step_ms`` and
    ``share``.
    """
    from moe_gmm.ops.permute import permute, unpermute

    settings = settings or TimingSettings(warmup=2, min_repeats=10, max_repeats=60, min_seconds=1.0)
    block, x, dy, step = _block_step(case, dtype)
    x_TH = x.detach().reshape(-1, case.hidden).clone().requires_grad_(True)
    with torch.no_grad():
        _, weights_Tk, indices_Tk = block.gate(x_TH)
    weights_Tk = weights_Tk.detach().clone().requires_grad_(True)
    dy_TH = dy.reshape(-1, case.hidden)

    def glue():
        permuted_RH, row_id_map_R, _ = permute(x_TH, indices_Tk, case.num_experts)
        out_TH = unpermute(permuted_RH, row_id_map_R, weights_Tk)
        return torch.autograd.grad(out_TH, (x_TH, weights_Tk), dy_TH)

    timings = time_interleaved({"step": step, "glue": glue}, settings)
    step_ms, glue_ms = timings["step"].median_s * 1e3, timings["glue"].median_s * 1e3
    return {"glue_ms": glue_ms, "step_ms": step_ms, "share": glue_ms / step_ms}


def _glue_line(glue: dict[str, float]) -> str:
    return (
        f"permute + unpermute fwd+bwd timed alone, without the profiler: {glue['glue_ms']:.2f} ms, "
        f"{glue['share']:.1%} of the step's {glue['step_ms']:.1f} ms (medians, interleaved)"
    )


def _print_breakdown(console, case: MoeLayerCase, dtype: torch.dtype, result: dict[str, dict[str, float]]) -> None:
    from rich.table import Table

    table = Table(title=f"moe_gmm SparseMoeBlock time by phase, {case.name} {DTYPE_NAMES[dtype]} (ms per step)")
    for col in ("phase", "fwd ms", "bwd ms", "fwd+bwd ms", "share"):
        table.add_column(col, justify="left" if col == "phase" else "right")
    total = result["fwd"]["total"] + result["bwd"]["total"]
    for phase in PHASES:
        f, b = result["fwd"][phase], result["bwd"].get(phase)
        both = f + (b or 0.0)
        label = "other (bwd: + router, shared expert)" if phase == "other" else phase
        b_text = "in other" if b is None else f"{b:.2f}"
        table.add_row(label, f"{f:.2f}", b_text, f"{both:.2f}", f"{both / total:.0%}" if total else "-")
    table.add_row("total", f"{result['fwd']['total']:.2f}", f"{result['bwd']['total']:.2f}", f"{total:.2f}", "100%")
    console.print(table)


def measure_memory(
    cases: list[MoeLayerCase], dtypes: list[torch.dtype], impl_names: list[str], *, console=None
) -> list[dict[str, Any]]:
    """Peak memory vs budget per case x dtype x impl, each in a fresh process with this process's threads.

    Prints the table when ``console`` is given. A failed measurement becomes a row with ``error``.
    """
    records = []
    for case in cases:
        for dtype in dtypes:
            for name in impl_names:
                head = {"case": case.name, "dtype": DTYPE_NAMES[dtype], "impl": name}
                if console is not None:
                    console.print(f"memory: {case.name} {head['dtype']} {name} (fresh process)...", highlight=False)
                spec = {"case": case.params(), "dtype": head["dtype"], "impl": name}
                try:
                    records.append({**head, **measure_in_subprocess(spec)})
                except RuntimeError as exc:
                    records.append({**head, "error": str(exc).strip().splitlines()[-1]})
    if console is not None:
        print_memory_table(records, console)
    return records


_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(description="MoE-layer benchmark: moe-gmm vs transformers, side by side.")
    p.add_argument("--quick", action="store_true", help="one scaled-down case, few repeats (under a minute)")
    p.add_argument("--cases", default=None, help=f"case set: {', '.join(CASE_SETS)} (default: qwen, or quick)")
    p.add_argument("--filter", default=None, help="only cases whose name contains this text")
    p.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16")
    p.add_argument(
        "--modes",
        default="train,fwdbwd",
        help="comma list of train (the training step users run, printed first: moe_gmm.bench.train_step), "
        "fwd, bwd, fwdbwd (autograd.grad)",
    )
    p.add_argument("--impls", default=None, help=f"comma list from {', '.join(IMPLS)} (the reference always runs)")
    p.add_argument(
        "--reference",
        default="hf_eager",
        choices=IMPLS,
        help="numerics and speed-up reference (default hf_eager; its O(E^2) backward takes minutes per step "
        "at E=256 on a CPU, so large-E runs compare against hf_grouped_mm)",
    )
    p.add_argument(
        "--breakdown-steps",
        type=int,
        default=3,
        help="profiled steps per phase breakdown, the median step reported (0: none)",
    )
    p.add_argument(
        "--memory",
        action="store_true",
        help="also report each impl's peak memory of one fwd+bwd step vs its budget (a fresh process per impl; "
        "the impls named in --impls, default all but hf_eager)",
    )
    add_run_arguments(p)
    train_step.add_train_arguments(p)
    return p


@restores_threads
def main(argv: list[str] | None = None) -> int:
    import json
    from pathlib import Path

    from moe_gmm.bench.table import markdown_report, print_report
    from moe_gmm.report.render import wide_console

    args = build_parser().parse_args(argv)
    dtypes = [_DTYPES[n] for n in split_choices(args.dtype, ("fp32", "bf16"), "--dtype")]
    modes = split_choices(args.modes, ("train", "fwd", "bwd", "fwdbwd"), "--modes")
    cases = [
        c
        for c in case_set(args.cases or ("quick" if args.quick else "qwen"))
        if not args.filter or args.filter in c.name
    ]
    if not cases:
        raise SystemExit("no case matches --cases/--filter")
    check_baseline_options(args)
    impls = layer_impls(split_choices(args.impls, IMPLS, "--impls") if args.impls else None, args.reference)
    settings = (
        TimingSettings(warmup=1, min_repeats=3, max_repeats=5, min_seconds=0.0) if args.quick else TimingSettings()
    )
    if args.repeats is not None:
        settings = TimingSettings(
            settings.warmup, args.repeats, max(settings.max_repeats, args.repeats), settings.min_seconds
        )
    set_threads(args.threads)
    console = wide_console()
    command = "python -m moe_gmm.bench.moe_layer " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    train = None
    if "train" in modes:  # the headline: before the autograd.grad modes
        train = {**train_step.run_from_args(args, cases, dtypes, settings, console), "command": command.strip()}
        modes = [m for m in modes if m != "train"]
        if not modes:
            _write_train_only(train, args, console)
            return apply_baseline_options({"train_step": train}, args, "train", console)
    names = [i.name for i in impls]
    console.print(f"measuring machine limits ({', '.join(DTYPE_NAMES[d] for d in dtypes)} GEMM, copy bandwidth)...")
    limits = measure_limits(tuple(dtypes), quick=args.quick)
    with maybe_progress(not args.no_progress) as progress:
        report = run_benchmark(
            cases,
            impls,
            dtypes=dtypes,
            modes=modes,
            limits=limits,
            machine=describe_machine(),
            settings=settings,
            reference=args.reference,
            primary="moe_gmm" if "moe_gmm" in names else None,
            title="MoE layer (Qwen3.5-MoE sparse block): " + ", ".join(names),
            command=command.strip(),
            progress=progress,
            rate_probes=None if args.quick else gemm_rate_probes(dtypes, limits),
        )
    recheck_calibration(report, lambda: measure_limits(tuple(dtypes), quick=args.quick), warning_printer(console))
    if not args.quick:
        report.notes.append(case_rate_note(report.rows, report.limits))
    print_report(report, console)
    breakdowns = []
    if args.breakdown_steps > 0 and "moe_gmm" in names:
        for case in cases:
            for dtype in dtypes:
                result = profile_breakdown(case, dtype, steps=args.breakdown_steps)
                glue = time_glue_alone(case, dtype)
                _print_breakdown(console, case, dtype, result)
                console.print(_glue_line(glue), highlight=False)
                breakdowns.append(
                    {"case": case.name, "dtype": DTYPE_NAMES[dtype], "ms_per_step": result, "glue_alone": glue}
                )
    memory = []
    if args.memory:
        memory_names = (
            split_choices(args.impls, IMPLS, "--impls") if args.impls else [n for n in DEFAULT_IMPLS if n != "hf_eager"]
        )
        memory = measure_memory(cases, dtypes, memory_names, console=console)
    if args.out:
        path = report.write_json(args.out)
        data = json.loads(path.read_text())
        data["breakdown"] = breakdowns
        if train is not None:
            data["train_step"] = train
        if args.memory:
            data["memory"] = memory
        path.write_text(json.dumps(data, indent=1) + "\n")
        console.print(f"JSON written to {path}")
    if args.markdown:
        text = markdown_report(report)
        if train is not None:
            text = train_step.train_markdown(train) + "\n" + text
        for b in breakdowns:
            text += f"\n\nmoe_gmm time by phase, {b['case']} {b['dtype']} (ms per step)\n\n| phase | fwd | bwd |\n|---|---:|---:|\n"
            text += "\n".join(
                f"| {ph} | {b['ms_per_step']['fwd'][ph]:.2f} | "
                + ("in other" if ph not in b["ms_per_step"]["bwd"] else f"{b['ms_per_step']['bwd'][ph]:.2f}")
                + " |"
                for ph in (*PHASES, "total")
            )
            text += "\n\n" + _glue_line(b["glue_alone"])
        if args.memory:
            text += "\n\n" + memory_markdown(memory).rstrip("\n")
        Path(args.markdown).write_text(text + "\n")
        console.print(f"Markdown written to {args.markdown}")
    code = apply_baseline_options(report.as_dict(), args, "layer", console)
    if train is not None:
        code = max(code, apply_baseline_options({"train_step": train}, args, "train", console))
    return code


def _write_train_only(train: dict[str, Any], args, console) -> None:
    """``--out`` / ``--markdown`` of a run whose only mode is ``train``."""
    import json
    from pathlib import Path

    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"title": "MoE layer train step", "rows": [], "train_step": train}, indent=1) + "\n")
        console.print(f"JSON written to {path}")
    if args.markdown:
        Path(args.markdown).write_text(train_step.train_markdown(train))
        console.print(f"Markdown written to {args.markdown}")


if __name__ == "__main__":  # the command recorded in results: it runs from any folder
    sys.exit(main())
