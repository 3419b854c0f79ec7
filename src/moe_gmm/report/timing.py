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

On CPU every phase is CPU time. On an accelerator the kernel phases use device time when the
profiler recorded any, and ``host`` stays CPU time.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["STEP_LABEL", "PhaseTimes", "measure_phases", "median_step_ms", "synchronize"]

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


def measure_phases(step: Callable[[], None], device: torch.device, *, steps: int) -> PhaseTimes:
    """Run ``step`` ``steps`` times under the profiler and return per-step phase times in ms."""
    step()  # warm-up outside the profile (first-call allocation and op registration)
    synchronize(device)
    prof = profile(activities=_activities(device))
    with _native_stderr_silenced():
        prof.start()
    try:
        for _ in range(steps):
            with record_function(STEP_LABEL):
                step()
        synchronize(device)
    finally:
        with _native_stderr_silenced():
            prof.stop()
    events = {e.key: e for e in prof.key_averages()}

    def kernel_us(key: str) -> float:
        e = events.get(key)
        if e is None:
            return 0.0
        device_us = float(getattr(e, "device_time_total", 0.0) or 0.0)
        return device_us if device.type != "cpu" and device_us > 0 else float(e.cpu_time_total)

    gmm_us = sum(kernel_us(k) for k in _GMM_KEYS)
    permute_us = 0.0
    own_frames = [k for k in events if k.startswith(("moe_gmm::", "moe::"))]
    for name in _PERMUTE_OPS:
        permute_us += kernel_us(f"moe_gmm::{name}")
        # The autograd node of a custom op is named GeneratedBackwardFor_<ns>_<op>_defaultBackward;
        # its inclusive time covers the registered backward.
        node = f"GeneratedBackwardFor_moe_gmm_{name}_defaultBackward"
        permute_us += kernel_us(node)
        own_frames.append(node)
    own_frames += [f"GeneratedBackwardFor_moe_gmm_{op.split('::')[1]}_defaultBackward" for op in _GMM_KEYS[:1]]
    host_us = sum(float(events[k].self_cpu_time_total) for k in set(own_frames) if k in events)
    host_us += sum(float(events[k].cpu_time_total) for k in _SYNC_KEYS if k in events)
    return PhaseTimes(
        {
            "gmm": gmm_us / 1e3 / steps,
            "permute/unpermute": permute_us / 1e3 / steps,
            "host": host_us / 1e3 / steps,
        }
    )
