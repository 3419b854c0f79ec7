"""Grouped-matmul benchmark cases and the implementations compared on them.

Legend: T tokens, k top-k, E experts, H hidden, I moe intermediate, M = T*k permuted rows,
K/N the GEMM's input/output features: ``gate_up`` is K = H, N = 2I; ``down`` is K = I, N = H.

Work per mode (``s`` = bytes per element, ``E_active`` = experts with at least one row):

- FLOPs: fwd ``2MKN``; bwd ``4MKN`` (grad_input + grad_weight); fwdbwd ``6MKN``.
- minimal bytes, every operand read once and every result written once:
  fwd ``s(MK + E_active KN + MN)`` (x, the weights of experts that have rows, y);
  bwd ``s(MN + MK + E_active KN + MK + E KN)`` (dy, x, weights, dx, and dW for every expert, since
  empty experts' gradients must be written as zeros); fwdbwd = fwd + bwd.

Implementations: ``eager`` (the per-expert loop, the reference), every registered grouped-matmul
backend that accepts CPU inputs of the dtype, and ``dense``, one ``[M, K] @ [K, N]`` GEMM with the
same FLOPs (what the grouping costs compared with a single GEMM; its outputs are not compared).
"""

from __future__ import annotations

import argparse
import shlex
import sys
from dataclasses import dataclass
from typing import Any

import torch

from moe_gmm.bench.compare import apply_baseline_options, check_baseline_options
from moe_gmm.bench.harness import (
    Impl,
    TimingSettings,
    Unsupported,
    Workload,
    case_rate_note,
    recheck_calibration,
    run_benchmark,
)
from moe_gmm.bench.runner import (
    add_run_arguments,
    maybe_progress,
    restores_threads,
    set_threads,
    split_choices,
    warning_printer,
)
from moe_gmm.bench.machine import (
    DTYPE_NAMES,
    CopyBandwidthProbe,
    describe_machine,
    gemm_rate_probes,
    measure_limits,
)
from moe_gmm.ops import grouped_matmul
from moe_gmm.ops.backends import AUTO_PRIORITY, registered_backends, select_backend
from moe_gmm.testing import routing_ids

__all__ = ["CASE_SETS", "GmmCase", "GmmInputs", "build_parser", "case_set", "gmm_impls", "main"]

PROJECTIONS = ("gate_up", "down")
_MODE_FLOP_FACTOR = {"fwd": 1, "bwd": 2, "fwdbwd": 3}


@dataclass(frozen=True)
class GmmInputs:
    x_MK: torch.Tensor
    w_EKN: torch.Tensor
    counts_E: torch.Tensor
    w_dense_KN: torch.Tensor


@dataclass(frozen=True)
class GmmCase:
    """One MoE expert projection: routing of T tokens to k of E experts, then ``x @ w[e]`` per expert."""

    num_experts: int
    top_k: int
    num_tokens: int
    hidden: int
    intermediate: int
    projection: str = "gate_up"
    routing: str = "uniform"
    weight_layout: str = "EKN"  # "ENK": the weight is a transposed view of an [E, N, K] tensor
    seed: int = 0

    def __post_init__(self) -> None:
        if self.projection not in PROJECTIONS:
            raise ValueError(f"projection must be one of {PROJECTIONS}, got {self.projection!r}")
        if self.weight_layout not in ("EKN", "ENK"):
            raise ValueError(f"weight_layout must be 'EKN' or 'ENK', got {self.weight_layout!r}")

    @property
    def name(self) -> str:
        routing = "" if self.routing == "uniform" else f" {self.routing}"
        return f"E{self.num_experts} k{self.top_k} T{self.num_tokens} H{self.hidden} I{self.intermediate}{routing}"

    @property
    def rows(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def kn(self) -> tuple[int, int]:
        if self.projection == "gate_up":
            return self.hidden, 2 * self.intermediate
        return self.intermediate, self.hidden

    def counts(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        ids = routing_ids(self.num_tokens, self.top_k, self.num_experts, self.routing, generator=g)
        return torch.bincount(ids.flatten(), minlength=self.num_experts)

    def columns(self) -> dict[str, str]:
        k, n = self.kn
        label = self.projection + ("" if self.weight_layout == "EKN" else " (ENK view)")
        return {"label": label, "shape": f"{self.rows}x{k}x{n}"}

    def params(self) -> dict[str, Any]:
        counts = self.counts()
        active = counts[counts > 0]
        k, n = self.kn
        return {
            "E": self.num_experts,
            "top_k": self.top_k,
            "T": self.num_tokens,
            "H": self.hidden,
            "I": self.intermediate,
            "projection": self.projection,
            "routing": self.routing,
            "weight_layout": self.weight_layout,
            "M": self.rows,
            "K": k,
            "N": n,
            "active_experts": int(active.numel()),
            "rows_min_mean_max": [int(active.min()), float(active.float().mean()), int(active.max())]
            if active.numel()
            else [0, 0.0, 0],
        }

    def make_inputs(self, dtype: torch.dtype) -> GmmInputs:
        g = torch.Generator().manual_seed(self.seed + 1)
        k, n = self.kn
        x = torch.randn(self.rows, k, generator=g).to(dtype)
        rows, row_len = (k, n) if self.weight_layout == "EKN" else (n, k)
        w = (torch.randn(self.num_experts, rows, row_len, generator=g) / k**0.5).to(dtype)
        if self.weight_layout == "ENK":
            w = w.transpose(1, 2)
        w_dense = (torch.randn(k, n, generator=g) / k**0.5).to(dtype)
        for t in (x, w, w_dense):
            t.requires_grad_(True)
        return GmmInputs(x_MK=x, w_EKN=w, counts_E=self.counts(), w_dense_KN=w_dense)

    def flops(self, mode: str) -> float:
        k, n = self.kn
        return 2.0 * self.rows * k * n * _MODE_FLOP_FACTOR[mode]

    def min_bytes(self, mode: str, dtype: torch.dtype) -> float:
        k, n = self.kn
        m, e = self.rows, self.num_experts
        e_active = int((self.counts() > 0).sum())
        size = torch.empty((), dtype=dtype).element_size()
        fwd = m * k + e_active * k * n + m * n
        bwd = m * n + m * k + e_active * k * n + m * k + e * k * n
        return float(size * {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode])


def _both(**kw) -> list[GmmCase]:
    return [GmmCase(projection=p, **kw) for p in PROJECTIONS]


def case_set(name: str) -> list[GmmCase]:
    """Named case lists. ``full`` is the union of ``qwen`` (Qwen3.5-MoE proportions) and ``sweep``."""
    if name == "tiny":
        # Smoke test: milliseconds per row; the skewed case leaves experts empty.
        return [
            *_both(num_experts=4, top_k=2, num_tokens=16, hidden=32, intermediate=16),
            *_both(num_experts=8, top_k=2, num_tokens=16, hidden=32, intermediate=16, routing="skewed"),
        ]
    if name == "quick":
        # One case per regime: few big groups, many small groups (weight-bound), skewed with empty experts.
        return [
            *_both(num_experts=8, top_k=2, num_tokens=512, hidden=1024, intermediate=256),
            *_both(num_experts=256, top_k=8, num_tokens=64, hidden=512, intermediate=128),
            *_both(num_experts=64, top_k=8, num_tokens=256, hidden=1024, intermediate=256, routing="skewed"),
        ]
    if name == "qwen":
        # Qwen3.5-MoE-like proportions: hidden 2048, moe_intermediate 512, top-8.
        out = []
        for e in (8, 64, 256):
            for t in (512, 2048):
                out += _both(num_experts=e, top_k=8, num_tokens=t, hidden=2048, intermediate=512)
        out += _both(num_experts=256, top_k=8, num_tokens=4096, hidden=2048, intermediate=512)
        out += _both(num_experts=256, top_k=8, num_tokens=2048, hidden=2048, intermediate=512, routing="skewed")
        return out
    if name == "sweep":
        # E 8..256, top-k 2 and 8, tokens 128..4096, hidden 1024, intermediate 256-512, uniform and skewed.
        out = []
        for e, k, t, i in (
            (256, 8, 128, 256),  # decode-like: 4 rows per expert, weight-bandwidth-bound
            (8, 2, 4096, 512),
            (64, 8, 2048, 256),
            (128, 2, 4096, 512),
            (128, 8, 2048, 256),
            (256, 8, 512, 256),
            (256, 8, 2048, 256),
        ):
            out += _both(num_experts=e, top_k=k, num_tokens=t, hidden=1024, intermediate=i)
        out += _both(num_experts=64, top_k=2, num_tokens=4096, hidden=1024, intermediate=512, routing="skewed")
        out += _both(num_experts=256, top_k=8, num_tokens=2048, hidden=1024, intermediate=256, routing="skewed")
        return out
    if name == "results":
        # The reduced set of the baselines (benchmarks/baselines/; a run fits in ~10 minutes on 2 cores).
        out = []
        for e, k, t, h, i, routing in (
            (256, 8, 128, 1024, 256, "uniform"),  # decode-like, 4 rows per expert
            (256, 8, 512, 1024, 256, "uniform"),  # 16 rows per expert
            (128, 2, 4096, 1024, 512, "uniform"),  # 64 rows per expert
            (64, 8, 512, 2048, 512, "uniform"),  # Qwen3.5 proportions, 64 rows per expert
            (8, 2, 4096, 1024, 512, "uniform"),  # few big groups
            (256, 8, 2048, 1024, 256, "skewed"),  # 3/4 of the experts empty
        ):
            out += _both(num_experts=e, top_k=k, num_tokens=t, hidden=h, intermediate=i, routing=routing)
        return out
    if name == "full":
        return case_set("qwen") + case_set("sweep")
    raise ValueError(f"case set must be one of {sorted(CASE_SETS)}, got {name!r}")


CASE_SETS = ("tiny", "quick", "results", "qwen", "sweep", "full")


def _backend_impl(name: str) -> Impl:
    def prepare(inp: GmmInputs) -> Workload:
        reason = registered_backends()[name].refusal(inp.x_MK, inp.w_EKN)
        if reason is not None:
            raise Unsupported(reason)
        return Workload(
            forward=lambda: grouped_matmul(inp.x_MK, inp.w_EKN, inp.counts_E, backend=name),
            leaves=(inp.x_MK, inp.w_EKN),
        )

    return Impl(name=name, prepare=prepare, description=registered_backends()[name].notes)


def _dense_impl() -> Impl:
    def prepare(inp: GmmInputs) -> Workload:
        return Workload(forward=lambda: torch.mm(inp.x_MK, inp.w_dense_KN), leaves=(inp.x_MK, inp.w_dense_KN))

    return Impl(name="dense", prepare=prepare, compare=False, description="one [M,K]@[K,N] GEMM, same FLOPs")


def gmm_impls(names: list[str] | None = None, device: str = "cpu") -> list[Impl]:
    """``eager``, the backends ``auto`` may pick on ``device`` (in priority order), then ``dense``.

    ``names`` selects instead; it may name any backend registered and available on ``device``
    (e.g. ``triton`` under ``TRITON_INTERPRET=1``, left out by default because it is an interpreter).
    """
    backends = registered_backends()
    usable = [n for n, b in backends.items() if device in b.devices and b.unavailable_reason() is None]
    auto = [n for n in AUTO_PRIORITY.get(device, ()) if n in usable and n != "eager"]
    if names:
        allowed = ["eager", *usable, "dense"]
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise ValueError(f"--impls: unknown or unavailable {unknown}; choose from {sorted(set(allowed))}")
        chosen = ["eager", *(n for n in names if n != "eager")]  # eager: the reference every row is compared with
    else:
        chosen = ["eager", *auto, "dense"]
    return [_dense_impl() if n == "dense" else _backend_impl(n) for n in dict.fromkeys(chosen)]


def auto_backend_name(dtype: torch.dtype = torch.float32) -> str:
    """The backend ``grouped_matmul`` picks for CPU inputs of ``dtype``."""
    return select_backend(torch.empty(8, 64, dtype=dtype), torch.empty(2, 64, 64, dtype=dtype)).name


_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def _case_bandwidth_note(rows: list[dict]) -> str:
    measured = [r["copy_bandwidth"] for r in rows if "copy_bandwidth" in r]
    if not measured:
        return "memory floors: the run's copy bandwidth"
    return (
        "memory floors: the copy bandwidth measured before and after each case and mode, the better "
        f"of the two ({min(measured) / 1e9:.1f}-{max(measured) / 1e9:.1f} GB/s this run)"
    )


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(description="Grouped-matmul benchmark: implementations side by side.")
    p.add_argument("--quick", action="store_true", help="small cases, fewer repeats (well under a minute)")
    p.add_argument("--cases", default=None, help=f"case set: {', '.join(CASE_SETS)} (default: full, or quick)")
    p.add_argument("--filter", default=None, help="only cases whose name contains this text")
    p.add_argument("--dtype", default="fp32,bf16", help="comma list of fp32, bf16, fp16")
    p.add_argument("--modes", default="fwd,fwdbwd", help="comma list of fwd, bwd, fwdbwd")
    p.add_argument("--impls", default=None, help="comma list of implementations (eager is always included)")
    p.add_argument("--projection", default="gate_up,down", help="comma list of gate_up, down")
    p.add_argument("--weight-layout", default="EKN", choices=("EKN", "ENK"), help="ENK: transposed-view weights")
    p.add_argument("--min-seconds", type=float, default=None, help="keep repeating until this much time passed")
    add_run_arguments(p)
    return p


@restores_threads
def main(argv: list[str] | None = None) -> int:
    from moe_gmm.bench.table import markdown_report, print_report
    from moe_gmm.report.render import wide_console

    args = build_parser().parse_args(argv)
    dtypes = [_DTYPES[n] for n in split_choices(args.dtype, ("fp32", "bf16", "fp16"), "--dtype")]
    modes = split_choices(args.modes, ("fwd", "bwd", "fwdbwd"), "--modes")
    projections = split_choices(args.projection, PROJECTIONS, "--projection")
    cases = case_set(args.cases or ("quick" if args.quick else "full"))
    cases = [c for c in cases if c.projection in projections and (not args.filter or args.filter in c.name)]
    if args.weight_layout != "EKN":
        cases = [GmmCase(**{**c.__dict__, "weight_layout": args.weight_layout}) for c in cases]
    if not cases:
        raise SystemExit("no case matches --cases/--filter/--projection")
    check_baseline_options(args)
    impls = gmm_impls(args.impls.split(",") if args.impls else None)
    settings = (
        TimingSettings(warmup=0, min_repeats=3, max_repeats=3, min_seconds=0.0) if args.quick else TimingSettings()
    )
    if args.repeats is not None or args.min_seconds is not None:
        settings = TimingSettings(
            warmup=settings.warmup,
            min_repeats=args.repeats or settings.min_repeats,
            max_repeats=max(settings.max_repeats, args.repeats or 0),
            min_seconds=settings.min_seconds if args.min_seconds is None else args.min_seconds,
        )
    set_threads(args.threads)
    console = wide_console()
    machine = describe_machine()
    console.print(f"measuring machine limits ({', '.join(DTYPE_NAMES[d] for d in dtypes)} GEMM, copy bandwidth)...")
    limits = measure_limits(tuple(dtypes), quick=args.quick)
    names = [i.name for i in impls]
    primary = auto_backend_name()
    command = "python -m moe_gmm.bench.gmm " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
    )
    with maybe_progress(not args.no_progress) as progress:
        report = run_benchmark(
            cases,
            impls,
            dtypes=dtypes,
            modes=modes,
            limits=limits,
            machine=machine,
            settings=settings,
            reference="eager",
            primary=primary if primary in names else None,
            title="grouped_matmul: " + ", ".join(names) + f" (auto backend on CPU: {primary})",
            command=command.strip(),
            progress=progress,
            bandwidth_probe=None if args.quick else CopyBandwidthProbe(limits.copy_mib),
            rate_probes=None if args.quick else gemm_rate_probes(dtypes, limits),
        )
    if not args.quick:
        # Limits again after the run; each floor uses the better of the two measurements, so a
        # load spike during one of them cannot make the floors (and the ratios to them) look better.
        report.set_limits(limits.merged(measure_limits(tuple(dtypes), quick=False)))
        report.notes.append("limits: the better of measurements before and after the run")
    recheck_calibration(report, lambda: measure_limits(tuple(dtypes), quick=args.quick), warning_printer(console))
    if not args.quick:
        report.notes.append(_case_bandwidth_note(report.rows))
        report.notes.append(case_rate_note(report.rows, report.limits))
    print_report(report, console)
    if args.out:
        console.print(f"JSON written to {report.write_json(args.out)}")
    if args.markdown:
        from pathlib import Path

        Path(args.markdown).write_text(markdown_report(report))
        console.print(f"Markdown written to {args.markdown}")
    return apply_baseline_options(report.as_dict(), args, "gmm", console)


if __name__ == "__main__":  # the command recorded in results: it runs from any folder
    sys.exit(main())
