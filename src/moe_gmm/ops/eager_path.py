"""When an op may skip the dispatcher, and profiler labels that cost nothing when no one records.

Every moe-gmm op is a ``torch.library`` custom op with a fake and an autograd formula: that is what
``torch.compile``, dispatch modes (``FakeTensorMode``, op counters), ``torch.func`` transforms and
the profiler see. A plain eager call pays for it in host time: each custom op passes through
several Python dispatcher layers, a few times the cost of a built-in op of the same size. So a call
that none of those can observe runs the op's own body directly, wrapped in a
``torch.autograd.Function`` with the same backward: the same kernels, checks and numbers, with
the glue of a built-in op. :func:`direct` says when that is the case.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import record_function

__all__ = ["direct", "label", "profiling"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_profiler_enabled = torch._C._autograd._profiler_enabled
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_function_modes = torch._C._is_torch_function_mode_enabled
_NO_LABEL = contextlib.nullcontext()


def profiling() -> bool:
    """Whether a profiler records now (a C flag: no Python state to consult)."""
    return _profiler_enabled()


def direct(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` can run the op body without the dispatcher.

    Only in plain eager execution: not while compiling or tracing, not under a dispatch mode, a
    ``torch.func`` transform or a torch-function mode (``with torch.device(...)``), not while a
    profiler records (its op events are what the reports read), and only for plain tensors (a
    subclass routes through its own ``__torch_dispatch__``).
    """
    if torch.compiler.is_compiling():  # first: the C flags below cannot be traced
        return False
    if _profiler_enabled() or _dispatch_modes() or _functorch_active() or _function_modes():
        return False
    return all(type(t) in _PLAIN for t in tensors)


def label(name: str):
    """``record_function(name)`` while a profiler records, else a shared no-op context (a label
    costs a few microseconds of host time per call even when nothing records it). Under
    ``torch.compile`` always the label: the compiled graph keeps it for later profiles."""
    if torch.compiler.is_compiling() or _profiler_enabled():
        return record_function(name)
    return _NO_LABEL
