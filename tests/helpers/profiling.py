"""The operators a call runs, from the profiler."""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def op_names(fn: Callable[[], object]) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}
