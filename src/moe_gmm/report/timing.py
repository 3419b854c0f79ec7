"""Per-phase times from ``torch.profiler``: the grouped matmuls, permute/unpermute, host work, a step.

Phases are read from the profiler by name, so no layer has to cooperate:

- ``gmm``: the ``moe_gmm::grouped_matmul`` custom op and its two backward ops
  (``..._grad_input``, ``..._grad_weight``), i.e. the two expert matmuls, forward and backward;
- ``permute``: the ``moe_gmm::permute`` / ``moe_gmm::unpermute`` custom ops and their autograd nodes;
- ``host``: time spent outside any aten kernel in our own frames (self time of the ``moe_gmm::``
  ops, their autograd nodes and the ``moe::`` labels: Python, argument checks, dispatch) plus the
  host syncs (``aten::item`` / ``aten::_local_scalar_dense``, e.g. reading group bounds);
- ``step``: the whole training step, measured without the profiler (median wall time), because
  starting the profiler and recording events inflates it.

Paths are profiled interleaved (eager, fused, eager, ...) and each phase is the median over steps.

On CPU every phase is CPU time. On an accelerator the kernel phases use device time when the
profiler recorded any, and ``host`` stays CPU time.
"""

from __future__ import annotations

import bisect
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["STEP_LABEL", "PhaseTimes", "measure_phases", "measure_phases_interleaved", "median_step_ms", "synchronize"]

STEP_LABEL = "moe::step"
_GMM_KEYS = ("moe_gmm::grouped_matmul", "moe_gmm::grouped_matmul_grad_input", "moe_gmm::grouped_matmul_grad_weight")
_PERMUTE_OPS = ("permute", "unpermute")
_SYNC_KEYS = ("aten::_local_scalar_dense",)


class PhaseTimes(dict):
    """``{"gmm": ms, "permute/unpermute": ms, "host": ms}`` per step (a plain dict with a name)."""


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # pragma: no cover - needs torch_npu
        torch.npu.synchronize(device)


def median_step_ms(
    steps: dict[str, Callable[[], None]], device: torch.device, *, warmup: int, repeats: int
) -> dict[str, tuple[float, float]]:
    """``{name: (median, spread = max - min)}`` wall milliseconds per call, after ``warmup`` calls.

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
    return {name: (statistics.median(v), max(v) - min(v)) for name, v in samples.items()}


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
    """Profile ``rounds`` rounds of every step (a, b, a, b, ...); per path, the median step's phases in ms.

    Interleaving and medians keep a burst of load from other processes out of one path's numbers.
    Each profiled event is attributed to the step whose labelled time interval contains its start.
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
        (e.time_range.start, e.time_range.end, e.name[len(STEP_LABEL) + 1 : -1], [0.0, 0.0, 0.0])
        for e in events
        if e.name.startswith(STEP_LABEL + "[")
    )
    starts = [lab[0] for lab in labels]

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
        out[name] = PhaseTimes(
            {
                phase: statistics.median(v[i] for v in per_step) / 1e3
                for i, phase in enumerate(("gmm", "permute/unpermute", "host"))
            }
        )
    return out


def measure_phases(step: Callable[[], None], device: torch.device, *, steps: int) -> PhaseTimes:
    """Profile ``steps`` calls of one step; the median step's phase times in ms."""
    return measure_phases_interleaved({"step": step}, device, rounds=steps)["step"]
