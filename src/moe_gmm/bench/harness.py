"""The one benchmark harness: cases x implementations x dtypes x modes, timed side by side.

A *case* builds inputs (outside any timing) and states its work: FLOPs and minimal bytes per
mode. An *implementation* turns those inputs into a :class:`Workload` (a forward closure and the
leaves to differentiate). For every case and dtype the harness

1. prepares every implementation on the same inputs and checks it against the reference
   implementation (relative-norm error of the output and of every gradient, float64 arithmetic);
2. for every mode times the implementations in *interleaved rounds* (round r runs each of them
   once, in a rotated order), so a load spike from another process hits all of them alike;
3. reports the median and the 20th/80th percentiles of the repeats, the ratio to the roofline floor
   (``moe_gmm.bench.machine``) and the speed-up over the reference.

Modes: ``fwd`` (forward under ``no_grad``), ``bwd`` (``autograd.grad`` through a graph built
outside the timing, ``retain_graph=True``), ``fwdbwd`` (forward then ``autograd.grad``). The
upstream gradient is a fixed contiguous random tensor.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from moe_gmm.bench.machine import (
    CopyBandwidthProbe,
    GemmRateProbe,
    Limits,
    MachineInfo,
    dtype_name,
    roofline_floor,
)
from moe_gmm.report.timing import Spread
from moe_gmm.testing import relative_error

__all__ = [
    "MODES",
    "BenchReport",
    "Case",
    "Impl",
    "Timing",
    "TimingSettings",
    "Unsupported",
    "Workload",
    "case_rate_note",
    "recheck_calibration",
    "run_benchmark",
    "warning_printer",
    "summarize",
]

MODES = ("fwd", "bwd", "fwdbwd")


class Unsupported(Exception):
    """Raised by ``Impl.prepare`` when an implementation cannot run a case (the row says why)."""


@dataclass(frozen=True)
class Workload:
    """One implementation prepared on one case's inputs; nothing here has been timed."""

    forward: Callable[[], torch.Tensor]
    leaves: tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class Impl:
    """A named implementation. ``compare=False`` for stand-ins (a dense GEMM) with other outputs."""

    name: str
    prepare: Callable[[Any], Workload]
    compare: bool = True
    description: str = ""


class Case(Protocol):
    """What the harness needs from a benchmark case."""

    name: str

    def columns(self) -> dict[str, str]:
        """Short labels for the table (case, projection, shape...)."""

    def params(self) -> dict[str, Any]:
        """Everything that defines the case, for the JSON file."""

    def make_inputs(self, dtype: torch.dtype) -> Any:
        """Fresh, deterministic inputs shared by every implementation."""

    def flops(self, mode: str) -> float: ...

    def min_bytes(self, mode: str, dtype: torch.dtype) -> float: ...


@dataclass(frozen=True)
class TimingSettings:
    """Warm-up calls per implementation, then interleaved rounds until both repeat and time minimums hold."""

    warmup: int = 1
    min_repeats: int = 5
    max_repeats: int = 30
    min_seconds: float = 1.0


@dataclass(frozen=True)
class Timing:
    min_s: float
    median_s: float
    p20_s: float
    p80_s: float
    repeats: int
    max_s: float = math.nan


def timing_from_samples(samples: Sequence[float]) -> Timing:
    if not samples:
        raise ValueError("samples must hold at least one time")
    spread = Spread.of(samples)  # the reports' one definition of median and percentiles
    return Timing(
        min_s=spread.min,
        median_s=spread.median,
        p20_s=spread.p20,
        p80_s=spread.p80,
        repeats=spread.repeats,
        max_s=spread.max,
    )


def time_interleaved(fns: dict[str, Callable[[], Any]], settings: TimingSettings) -> dict[str, Timing]:
    """Time each callable: warm-up, then rounds that run every callable once in a rotated order."""
    names = list(fns)
    for name in names:
        for _ in range(settings.warmup):
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    rounds = 0
    while rounds < settings.max_repeats:
        if rounds >= settings.min_repeats and time.perf_counter() - start >= settings.min_seconds:
            break
        shift = rounds % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: timing_from_samples(s) for name, s in samples.items()}


def _timed_callable(workload: Workload, mode: str, grad_out: torch.Tensor) -> Callable[[], Any]:
    if mode == "fwd":

        def run_fwd():
            with torch.no_grad():
                return workload.forward()

        return run_fwd
    if mode == "bwd":
        out = workload.forward()  # graph built once, outside the timing

        def run_bwd():
            return torch.autograd.grad(out, workload.leaves, grad_out, retain_graph=True)

        return run_bwd
    if mode == "fwdbwd":

        def run_fwdbwd():
            return torch.autograd.grad(workload.forward(), workload.leaves, grad_out)

        return run_fwdbwd
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _errors(workload: Workload, reference: tuple[torch.Tensor, ...], grad_out: torch.Tensor) -> dict[str, float]:
    out = workload.forward()
    grads = torch.autograd.grad(out, workload.leaves, grad_out)
    errs = {"out": relative_error(out, reference[0])}
    for i, (g, ref) in enumerate(zip(grads, reference[1:])):
        errs[f"grad{i}"] = relative_error(g, ref)
    return errs


@dataclass
class BenchReport:
    """Everything one run measured; ``rows`` are flat dicts (one per case x dtype x mode x impl)."""

    title: str
    machine: MachineInfo
    limits: Limits
    settings: TimingSettings
    command: str
    impls: list[str]
    reference: str
    primary: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    started_utc: str = ""
    wall_s: float = 0.0
    load_average_end: tuple[float, float, float] | None = None
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "command": self.command,
            "started_utc": self.started_utc,
            "wall_s": round(self.wall_s, 1),
            "machine": self.machine.as_dict(),
            "load_average_end": self.load_average_end,
            "limits": self.limits.as_dict(),
            "settings": asdict(self.settings),
            "impls": self.impls,
            "reference": self.reference,
            "primary": self.primary,
            "notes": self.notes,
            "rows": self.rows,
            "summary": summarize(self.rows, self.reference),
        }

    def set_limits(self, limits: Limits) -> None:
        """Use ``limits`` (e.g. the better of measurements before and after the run) for every floor;
        a row's own copy bandwidth and GEMM rate, where they were measured with its case, stay its
        own."""
        self.limits = limits
        for row in self.rows:
            _set_floors(row, limits)

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.as_dict(), indent=1) + "\n")
        return path


def _set_floors(row: dict[str, Any], limits: Limits) -> None:
    """A row's floor (``floor_s``, ``bound``, ``x_floor``): the compute part from the run's peak, the
    memory part from the row's own ``copy_bandwidth`` where it has one. With a ``case_gemm_rate``
    also ``case_floor_s`` and ``x_case_floor``: the same floor with the compute part from the GEMM
    rate measured in the case's timing rounds."""
    limits = replace(limits, copy_bandwidth=row.get("copy_bandwidth", limits.copy_bandwidth))
    row["floor_s"], row["bound"] = roofline_floor(row["flops"], row["min_bytes"], row["dtype"], limits)
    if "case_gemm_rate" in row:
        at_case = replace(limits, peak_flops={row["dtype"]: row["case_gemm_rate"]})
        row["case_floor_s"], _ = roofline_floor(row["flops"], row["min_bytes"], row["dtype"], at_case)
    if row.get("median_s") is not None:
        row["x_floor"] = row["median_s"] / row["floor_s"]
        if "case_floor_s" in row:
            row["x_case_floor"] = row["median_s"] / row["case_floor_s"]


def _geomean(values: Iterable[float]) -> float:
    vals = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")


def summarize(rows: list[dict[str, Any]], reference: str) -> list[dict[str, Any]]:
    """Per (dtype, mode, impl): geomean and worst ratio to the floor, geomean speed-up over the reference."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        if row.get("median_s") is None:
            continue
        groups.setdefault((row["dtype"], row["mode"], row["impl"]), []).append(row)
    out = []
    for (dtype, mode, impl), group in sorted(groups.items()):
        worst = max(group, key=lambda r: r["x_floor"])
        entry = {
            "dtype": dtype,
            "mode": mode,
            "impl": impl,
            "cases": len(group),
            "geomean_x_floor": _geomean(r["x_floor"] for r in group),
            "worst_x_floor": worst["x_floor"],
            "worst_case": f"{worst['case']} {worst.get('label', '')}".strip(),
            "geomean_speedup_vs_reference": _geomean(r["speedup_vs_reference"] for r in group),
            "reference": reference,
        }
        if all("x_case_floor" in r for r in group):
            entry["geomean_x_case_floor"] = _geomean(r["x_case_floor"] for r in group)
            entry["worst_x_case_floor"] = max(r["x_case_floor"] for r in group)
        out.append(entry)
    return out


def case_rate_note(rows: list[dict[str, Any]], limits: Limits) -> str:
    """One line for a report's notes: where the compute floors come from, and the range of the GEMM
    rates measured in the cases' rounds as shares of the run's peak."""
    shares: dict[str, list[float]] = {}
    for r in rows:
        if "case_gemm_rate" in r:
            shares.setdefault(r["dtype"], []).append(r["case_gemm_rate"] / limits.peak(r["dtype"]))
    if not shares:
        return "compute floors: the run's peak GEMM rate"
    ranges = ", ".join(f"{name} {min(v):.0%}-{max(v):.0%}" for name, v in shares.items())
    return (
        "compute floors: the run's peak GEMM rate; x floor at the rate here: the compute floor from the median "
        f"of a square GEMM timed in each case's rounds ({ranges} of the peak this run)"
    )


def _beating_the_floor(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows timed below their roofline floor: no code runs faster than the machine's limits allow,
    so each one says the limits were measured too low (under load, or a bandwidth dip)."""
    return [r for r in rows if r.get("x_floor") is not None and r["x_floor"] < 1.0]


def recheck_calibration(report: BenchReport, remeasure: Callable[[], Limits], say: Callable[[str], None]) -> None:
    """When a row beats its floor, measure the limits again and keep the higher of each, then add a
    note saying so; a row still under its floor afterwards is flagged as an unreliable floor.

    ``remeasure`` measures the machine's limits now; ``say`` prints a warning line. A row's own
    copy bandwidth (measured next to its case) counts as a calibration too and is raised likewise.
    """
    suspect = _beating_the_floor(report.rows)
    if not suspect:
        return
    best = min(r["x_floor"] for r in suspect)
    say(
        f"warning: {len(suspect)} rows ran below their roofline floor (down to {best:.2f}x): the machine "
        "limits were measured too low, likely under load; measuring them again"
    )
    fresh = remeasure()
    for row in suspect:
        if "copy_bandwidth" in row:
            row["copy_bandwidth"] = max(row["copy_bandwidth"], fresh.copy_bandwidth)
    report.set_limits(report.limits.merged(fresh))
    still = _beating_the_floor(report.rows)
    if still:
        cases = sorted({f"{r['case']} {r['impl']} {r['mode']}" for r in still})
        note = (
            f"WARNING: {len(still)} rows still beat their roofline floor after the limits were measured again "
            f"(down to {min(r['x_floor'] for r in still):.2f}x): their floors are unreliable ({', '.join(cases[:3])})"
        )
        say(note)
    else:
        note = f"limits measured again: {len(suspect)} rows beat the floors of the first measurement"
    report.notes.append(note)


def run_benchmark(
    cases: Sequence[Case],
    impls: Sequence[Impl],
    *,
    dtypes: Sequence[torch.dtype],
    modes: Sequence[str],
    limits: Limits,
    machine: MachineInfo,
    settings: TimingSettings = TimingSettings(),
    reference: str = "eager",
    primary: str | None = None,
    title: str = "benchmark",
    command: str = "",
    progress: Any | None = None,
    bandwidth_probe: CopyBandwidthProbe | None = None,
    rate_probes: Mapping[str, GemmRateProbe] | None = None,
) -> BenchReport:
    """Run every case x dtype x mode x impl; ``progress`` is an optional ``rich.progress.Progress``.

    With ``bandwidth_probe`` the copy bandwidth is measured before and after each case and mode,
    and the better of the two sets that row's memory floor (``row["copy_bandwidth"]``), instead of
    the run's ``limits``: on a machine whose memory bandwidth changes during a run, a floor from
    another moment would misstate every memory-bound ratio.

    With ``rate_probes`` (dtype name -> probe) the probe's GEMM runs in every timing round beside
    the implementations, and the rate of its median call is the row's ``case_gemm_rate``. It does
    not replace the run's peak in ``x_floor``: it gives a second ratio, ``x_case_floor``, against the
    floor the machine allowed in those rounds, which tells a case that ran slowly from a moment in
    which every GEMM did (a stretch of seconds that before-and-after measurements miss).
    """
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"modes must be drawn from {MODES}, got {mode!r}")
    names = [impl.name for impl in impls]
    if _RATE_PROBE in names:
        raise ValueError(f"impls may not be named {_RATE_PROBE!r}: the GEMM rate probe's timings go by that name")
    if reference not in names:
        raise ValueError(f"reference must name one of the impls {names}, got {reference!r}")
    if primary is not None and primary not in names:
        raise ValueError(f"primary must name one of the impls {names}, got {primary!r}")
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    t_start = time.perf_counter()
    report = BenchReport(
        title=title,
        machine=machine,
        limits=limits,
        settings=settings,
        command=command,
        impls=names,
        reference=reference,
        primary=primary,
        started_utc=started,
    )
    task = progress.add_task(title, total=len(cases) * len(dtypes) * len(modes)) if progress is not None else None
    for case in cases:
        for dtype in dtypes:
            report.rows.extend(
                _run_case(case, impls, dtype, modes, limits, settings, reference, bandwidth_probe, rate_probes)
            )
            if progress is not None:
                progress.advance(task, len(modes))
            gc.collect()
    report.wall_s = time.perf_counter() - t_start
    report.load_average_end = tuple(round(v, 2) for v in os.getloadavg())
    return report


# The rate probe's entry among a case's timed callables; no implementation can take this name
# (run_benchmark rejects it).
_RATE_PROBE = "(gemm rate probe)"


def _run_case(
    case: Case,
    impls: Sequence[Impl],
    dtype: torch.dtype,
    modes: Sequence[str],
    limits: Limits,
    settings: TimingSettings,
    reference: str,
    bandwidth_probe: CopyBandwidthProbe | None = None,
    rate_probes: Mapping[str, GemmRateProbe] | None = None,
) -> list[dict[str, Any]]:
    inputs = case.make_inputs(dtype)
    workloads: dict[str, Workload] = {}
    skipped: dict[str, str] = {}
    for impl in impls:
        try:
            workloads[impl.name] = impl.prepare(inputs)
        except Unsupported as exc:
            skipped[impl.name] = str(exc)
    if reference not in workloads:
        raise RuntimeError(f"reference impl {reference!r} cannot run case {case.name}: {skipped.get(reference)}")

    # Correctness first (also the first, untimed call of every implementation).
    ref_out = workloads[reference].forward()
    grad_out = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(1)).to(ref_out.dtype)
    ref_grads = torch.autograd.grad(ref_out, workloads[reference].leaves, grad_out)
    reference_values = (ref_out.detach(), *ref_grads)
    del ref_out, ref_grads
    errors: dict[str, dict[str, float] | None] = {}
    for impl in impls:
        if impl.name in workloads:
            errors[impl.name] = _errors(workloads[impl.name], reference_values, grad_out) if impl.compare else None
    del reference_values

    rows = []
    base = {"case": case.name, **case.columns(), "params": case.params(), "dtype": dtype_name(dtype)}
    rate_probe = (rate_probes or {}).get(dtype_name(dtype))
    for mode in modes:
        flops, min_bytes = case.flops(mode), case.min_bytes(mode, dtype)
        fns = {name: _timed_callable(w, mode, grad_out) for name, w in workloads.items()}
        if rate_probe is not None:
            fns[_RATE_PROBE] = rate_probe.run
        bandwidth_before = bandwidth_probe.measure(repeats=3) if bandwidth_probe is not None else None
        timings = time_interleaved(fns, settings)
        del fns
        measured = {}
        if bandwidth_probe is not None:
            measured["copy_bandwidth"] = max(bandwidth_before, bandwidth_probe.measure(repeats=3))
        if rate_probe is not None:
            measured["case_gemm_rate"] = rate_probe.flops / timings.pop(_RATE_PROBE).median_s
        ref_median = timings[reference].median_s
        for impl in impls:
            row = {**base, "mode": mode, "impl": impl.name, "flops": flops, "min_bytes": min_bytes, **measured}
            if impl.name in skipped:
                row.update({"median_s": None, "skipped": skipped[impl.name]})
                _set_floors(row, limits)
                rows.append(row)
                continue
            t = timings[impl.name]
            err = errors[impl.name]
            if err is not None and mode == "fwd":
                err = {"out": err["out"]}
            row.update(
                {
                    "median_s": t.median_s,
                    "min_s": t.min_s,
                    "p20_s": t.p20_s,
                    "p80_s": t.p80_s,
                    "max_s": t.max_s,
                    "repeats": t.repeats,
                    "gflops": flops / t.median_s / 1e9,
                    "speedup_vs_reference": ref_median / t.median_s,
                    "rel_err": None if err is None else max(err.values()),
                    "rel_err_parts": err,
                }
            )
            _set_floors(row, limits)
            rows.append(row)
    del workloads, inputs
    return rows
