"""Per-phase times from ``torch.profiler``: the grouped matmuls, permute/unpermute, host work, a step.

Phases are read from the profiler by name, so no layer has to cooperate:

- ``gmm``: the ``moe_gmm::grouped_matmul`` custom op and its two backward ops
  (``..._grad_input``, ``..._grad_weight``), i.e. the two expert matmuls, forward and backward;
- ``permute``: the ``moe_gmm::permute`` / ``moe_gmm::unpermute`` custom ops and their autograd nodes;
- ``host``: time spent outside any aten kernel in our own frames (self time of the ``moe_gmm::``
  ops, their autograd nodes and the ``moe::`` labels: Python, argument checks, dispatch) plus the
  host syncs (``aten::item`` / ``aten::_local_scalar_dense``, e.g. reading group bounds);
- ``profiled step``: the wall time of each profiled step itself, which holds the phases above: the
  phases are shares of it, measured in the same steps;
- ``step``: the whole training step, measured in a separate run without the profiler (the
  profiler's recording makes the profiled step longer).

Paths are profiled interleaved (eager, fused, eager, ...) and each phase is the median over steps,
kept with its spread (:class:`Spread`): every time reported carries its repeats, p20-p80 and
min-max, and is flagged noisy when they are far apart (:data:`NOISY_MAX_OVER_MIN`,
:data:`NOISY_P80_OVER_P20`), as on a machine shared with other work.

On CPU every phase is CPU time. On an accelerator the kernel phases use device time when the
profiler recorded any, and ``host`` stays CPU time.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = [
    "NOISY_MAX_OVER_MIN",
    "NOISY_P80_OVER_P20",
    "PROFILED_STEP",
    "STEP_LABEL",
    "TIMING_NOTE",
    "PhaseTimes",
    "Spread",
    "measure_phases",
    "measure_phases_interleaved",
    "ratio_range",
    "spread_notes",
    "synchronize",
    "wall_step_ms",
]

STEP_LABEL = "moe::step"
_GMM_KEYS = ("moe_gmm::grouped_matmul", "moe_gmm::grouped_matmul_grad_input", "moe_gmm::grouped_matmul_grad_weight")
_PERMUTE_OPS = ("permute", "unpermute")
_SYNC_KEYS = ("aten::_local_scalar_dense",)


# A spread this wide means the repeats disagree (other processes, frequency changes): a median
# still summarises them, but a ratio of two such medians can be off by the same factor.
NOISY_MAX_OVER_MIN = 1.5
NOISY_P80_OVER_P20 = 1.25
PROFILED_STEP = "profiled step"
_PHASES = ("gmm", "permute/unpermute", "host", PROFILED_STEP)


def _quantile(ordered: Sequence[float], q: float) -> float:
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass(frozen=True)
class Spread:
    """Repeated measurements of one time: the median, p20-p80, min-max and how many there were."""

    median: float
    p20: float
    p80: float
    min: float
    max: float
    repeats: int

    @classmethod
    def of(cls, samples: Sequence[float]) -> Spread:
        if len(samples) == 0:
            raise ValueError("samples must hold at least one time, got none")
        ordered = sorted(float(v) for v in samples)
        if not all(math.isfinite(v) and v >= 0 for v in ordered):
            raise ValueError(f"samples must be finite times >= 0, got {ordered}")
        return cls(
            median=statistics.median(ordered),
            p20=_quantile(ordered, 0.2),
            p80=_quantile(ordered, 0.8),
            min=ordered[0],
            max=ordered[-1],
            repeats=len(ordered),
        )

    @property
    def noise(self) -> str | None:
        """Why the spread is too wide to trust a ratio, or None when it is not."""
        reasons = []
        if self.min > 0 and self.max / self.min > NOISY_MAX_OVER_MIN:
            reasons.append(f"max/min {self.max / self.min:.2f}x > {NOISY_MAX_OVER_MIN:g}")
        if self.p20 > 0 and self.p80 / self.p20 > NOISY_P80_OVER_P20:
            reasons.append(f"p80/p20 {self.p80 / self.p20:.2f}x > {NOISY_P80_OVER_P20:g}")
        return ", ".join(reasons) or None

    @property
    def noisy(self) -> bool:
        return self.noise is not None

    def ranges(self) -> str:
        """``p20-p80 {p20}-{p80}, min-max {min}-{max}``."""
        return f"p20-p80 {self.p20:.3g}-{self.p80:.3g}, min-max {self.min:.3g}-{self.max:.3g}"

    def describe(self, unit: str = "ms") -> str:
        """``median {median} ms ({ranges}, {n} repeats)``, then ``NOISY: why``
        when the spread is wide."""
        plural = "s" if self.repeats != 1 else ""
        text = f"median {self.median:.3g} {unit} ({self.ranges()}, {self.repeats} repeat{plural})"
        return text + (f" NOISY: {self.noise}" if self.noisy else "")

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "noisy": self.noisy}


def ratio_range(numerator: Spread, denominator: Spread) -> tuple[float, float] | None:
    """The ratio of two times as far as their p20-p80 ranges allow (low, high); None with a zero time."""
    if numerator.p20 <= 0 or denominator.p20 <= 0:
        return None
    return numerator.p20 / denominator.p80, numerator.p80 / denominator.p20


TIMING_NOTE = (
    "Timings are information, never pass/fail: each is a median over the repeats its metric names; "
    "the notes give p20-p80 and min-max, and NOISY marks a spread wider than max/min "
    f"{NOISY_MAX_OVER_MIN:g} or p80/p20 {NOISY_P80_OVER_P20:g} (a busy machine: do not trust the ratio). "
    "Profiler phases are shares of the profiled step, measured in the same steps."
)


def spread_notes(eager: Spread | None, fused: Spread | None) -> str:
    """The eager/fused ratio with its p20/p80 range, each path's spread, NOISY first when either is."""
    parts = []
    noisy = [f"{name} {s.noise}" for name, s in (("eager", eager), ("fused", fused)) if s is not None and s.noisy]
    if noisy:
        parts.append("NOISY (" + "; ".join(noisy) + ")")
    if eager is not None and fused is not None:
        bounds = ratio_range(eager, fused)
        if fused.median > 0:
            ratio = f"eager/fused {eager.median / fused.median:.2f}x"
            parts.append(ratio + (f" (from p20/p80: {bounds[0]:.2f}-{bounds[1]:.2f}x)" if bounds else ""))
    for name, s in (("eager", eager), ("fused", fused)):
        if s is not None:
            parts.append(f"{name} {s.ranges()}")
    return "; ".join(parts)


class PhaseTimes(dict):
    """``{"gmm": ms, "permute/unpermute": ms, "host": ms, "profiled step": ms}``: the median step's
    phases (a plain dict with a name); :attr:`spreads` holds each phase's :class:`Spread`."""

    def __init__(self, spreads: dict[str, Spread]) -> None:
        super().__init__({phase: spread.median for phase, spread in spreads.items()})
        self.spreads = spreads


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize(device)


def wall_step_ms(
    steps: dict[str, Callable[[], None]], device: torch.device, *, warmup: int, repeats: int
) -> dict[str, Spread]:
    """``{name: Spread}`` of wall milliseconds per call, after ``warmup`` calls.

    The callables are timed interleaved (a, b, a, b, ...) so that load from other processes
    falls on all of them alike rather than on whichever ran during a busy second.
    """
    for _ in range(warmup):
        for step in steps.values():
            step()
    synchronize(device)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e3)
    return {name: Spread.of(v) for name, v in samples.items()}


@contextlib.contextmanager
def _native_stderr_silenced():
    """Drop what is written to file descriptor 2 meanwhile (only around profiler start/stop).

    Workaround: the CPU profiler backend prints ``USDT: ... profiler_start/stop`` lines straight to
    fd 2 every time it starts and stops, which would interleave with the progress and the table.
    Exceptions still propagate; only text printed during those two calls is lost.
    """
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no usable fd 2 (an embedded interpreter): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _activities(device: torch.device) -> list[ProfilerActivity]:
    acts = [ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(ProfilerActivity.CUDA)
    return acts


def _permute_node(name: str) -> str:
    # The autograd node of a custom op is named GeneratedBackwardFor_<ns>_<op>_defaultBackward; its
    # inclusive time covers the registered backward.
    return f"GeneratedBackwardFor_moe_gmm_{name}_defaultBackward"


_PERMUTE_KEYS = tuple(k for n in _PERMUTE_OPS for k in (f"moe_gmm::{n}", _permute_node(n)))
_OWN_NODES = (*_PERMUTE_KEYS[1::2], "GeneratedBackwardFor_moe_gmm_grouped_matmul_defaultBackward")


def measure_phases_interleaved(
    steps: dict[str, Callable[[], None]], device: torch.device, *, rounds: int
) -> dict[str, PhaseTimes]:
    """Profile ``rounds`` rounds of every step (a, b, a, b, ...); per path, each phase's median in ms
    with its spread over the rounds, and the profiled step's own wall time.

    Interleaving and medians keep a burst of load from other processes out of one path's numbers.
    Each profiled event is attributed to the step whose labelled time interval contains its start,
    so within a step every phase is at most the profiled step, and so are their medians.
    """
    for step in steps.values():
        step()  # warm-up outside the profile (first-call allocation and op registration)
    synchronize(device)
    prof = profile(activities=_activities(device))
    with _native_stderr_silenced():
        prof.start()
    try:
        for _ in range(rounds):
            for name, step in steps.items():
                with record_function(f"{STEP_LABEL}[{name}]"):
                    step()
                    synchronize(device)
    finally:
        with _native_stderr_silenced():
            prof.stop()
    events = list(prof.events())
    labels = sorted(
        (e.time_range.start, e.time_range.end, e.name[len(STEP_LABEL) + 1 : -1], [0.0, 0.0, 0.0, 0.0])
        for e in events
        if e.name.startswith(STEP_LABEL + "[")
    )
    starts = [lab[0] for lab in labels]
    for lab in labels:
        lab[3][3] = float(lab[1] - lab[0])  # the step's own wall time, in us like the phases

    def kernel_us(e) -> float:
        device_us = float(getattr(e, "device_time_total", 0.0) or 0.0)
        return device_us if device.type != "cpu" and device_us > 0 else float(e.cpu_time_total)

    for e in events:
        i = bisect.bisect_right(starts, e.time_range.start) - 1
        if i < 0 or e.time_range.start > labels[i][1]:
            continue  # outside every step (profiler bookkeeping)
        acc = labels[i][3]
        key = e.name
        if key in _GMM_KEYS:
            acc[0] += kernel_us(e)
        elif key in _PERMUTE_KEYS:
            acc[1] += kernel_us(e)
        if key.startswith(("moe_gmm::", "moe::")) or key in _OWN_NODES:
            acc[2] += float(e.self_cpu_time_total)
        elif key in _SYNC_KEYS:
            acc[2] += float(e.cpu_time_total)
    out = {}
    for name in steps:
        per_step = [lab[3] for lab in labels if lab[2] == name]
        out[name] = PhaseTimes({phase: Spread.of([v[i] / 1e3 for v in per_step]) for i, phase in enumerate(_PHASES)})
    return out


def measure_phases(step: Callable[[], None], device: torch.device, *, steps: int) -> PhaseTimes:
    """Profile ``steps`` calls of one step; the median step's phase times in ms."""
    return measure_phases_interleaved({"step": step}, device, rounds=steps)["step"]
