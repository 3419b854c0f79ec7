"""Process-wide settings a test may change, read before and after it to catch what it leaves behind.

A setting left changed silently alters every later test: a thread count changes reduction orders,
a default dtype changes every factory, a tuning or registry entry changes which kernel runs. Each
:class:`Setting` reads one such thing and can put a read value back, so the guard in
``tests/conftest.py`` fails the leaking test and restores the rest of the run to its start.
"""

from __future__ import annotations

import logging
import operator
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, is_dataclass
from typing import Any

import pytest
import torch

__all__ = ["SETTINGS", "SET_ON_FIRST_USE", "Setting", "describe_leaks", "leaked", "no_leaks", "restore", "snapshot"]


@dataclass(frozen=True)
class Setting:
    """One process-wide setting: how to read it and how to put a read value back."""

    name: str
    read: Callable[[], Any]
    write: Callable[[Any], None]
    same: Callable[[Any, Any], bool] = operator.eq


def _logger_state(logger: logging.Logger) -> tuple:
    return logger.level, tuple(logger.handlers), logger.propagate, logger.disabled


def _set_logger_state(logger: logging.Logger, state: tuple) -> None:
    level, handlers, propagate, disabled = state
    logger.setLevel(level)
    logger.handlers[:] = list(handlers)
    logger.propagate, logger.disabled = propagate, disabled


# pytest itself names the running test and its phase here; it changes between setup and teardown.
_PYTEST_OWN = "PYTEST_CURRENT_TEST"


# Variables a library sets the first time it is used, whichever test that is, to a value it derives
# itself: they may appear during a test, never change or vanish.
SET_ON_FIRST_USE = {
    # torch.compile's inductor records the cache directory it picked, so its compile workers agree.
    "TORCHINDUCTOR_CACHE_DIR",
}


def _same_environ(before: Mapping[str, str], after: Mapping[str, str]) -> bool:
    appeared = {k for k in SET_ON_FIRST_USE if k in after and k not in before}
    return dict(before) == {k: v for k, v in after.items() if k not in appeared}


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != _PYTEST_OWN}


def _set_environ(values: dict[str, str]) -> None:
    for key in set(_environ()) - set(values):
        del os.environ[key]
    os.environ.update(values)


def _deterministic() -> tuple[bool, bool, bool]:
    from torch.utils import deterministic

    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        deterministic.fill_uninitialized_memory,
    )


def _set_deterministic(state: tuple[bool, bool, bool]) -> None:
    from torch.utils import deterministic

    torch.use_deterministic_algorithms(state[0], warn_only=state[1])
    deterministic.fill_uninitialized_memory = state[2]


def _tuning() -> Any:
    from moe_gmm.ops.backends.cpu import tuning

    return tuning.current_tuning()


def _set_tuning(value: Any) -> None:
    from moe_gmm.ops.backends.cpu import tuning

    tuning._current = value  # use_tuning is a context manager; a leak left no block to exit


def _registry() -> dict:
    from moe_gmm.ops import backends

    return backends.registered_backends()  # loads the built-ins first: their loading is no leak


def _set_registry(value: dict) -> None:
    from moe_gmm.ops import backends

    backends._registry.clear()
    backends._registry.update(value)


def _native_enabled() -> bool:
    from moe_gmm.ops import native

    return native.enabled()


def _set_native_enabled(flag: bool) -> None:
    from moe_gmm.ops import native

    native.set_enabled(flag)


_MOE_GMM_LOGGER = logging.getLogger("moe_gmm")
_ROOT = logging.getLogger()

SETTINGS: tuple[Setting, ...] = (
    Setting("torch threads", torch.get_num_threads, torch.set_num_threads),
    Setting("torch default dtype", torch.get_default_dtype, torch.set_default_dtype),
    Setting("torch default device", torch.get_default_device, torch.set_default_device),
    Setting("torch float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    Setting("torch deterministic (on, warn only, fill memory)", _deterministic, _set_deterministic),
    Setting("torch grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
    Setting("torch anomaly mode", torch.is_anomaly_enabled, torch.set_anomaly_enabled),
    Setting("moe_gmm CPU tuning", _tuning, _set_tuning),
    Setting("moe_gmm native kernels enabled", _native_enabled, _set_native_enabled),
    Setting("moe_gmm backend registry", _registry, _set_registry),
    Setting(
        "moe_gmm logger (level, handlers, propagate, disabled)",
        lambda: _logger_state(_MOE_GMM_LOGGER),
        lambda state: _set_logger_state(_MOE_GMM_LOGGER, state),
    ),
    # The root logger's handlers are pytest's per-phase capture handlers: only its level is ours.
    Setting("root logger level", lambda: _ROOT.level, _ROOT.setLevel),
    Setting("os.environ", _environ, _set_environ, _same_environ),
)


def snapshot(settings: tuple[Setting, ...] = SETTINGS) -> dict[str, Any]:
    """Every setting's current value, by name."""
    return {s.name: s.read() for s in settings}


def leaked(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """Names of the settings whose values differ between two snapshots."""
    return [s.name for s in SETTINGS if s.name in before and not s.same(before[s.name], after[s.name])]


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _mapping_change(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """The keys added, removed or changed (not the whole mapping: the environment is long)."""
    parts = [f"+{k}={_short(after[k])}" for k in sorted(after.keys() - before.keys())]
    parts += [f"-{k} (was {_short(before[k])})" for k in sorted(before.keys() - after.keys())]
    parts += [
        f"{k}: {_short(before[k])} -> {_short(after[k])}"
        for k in sorted(before.keys() & after.keys())
        if before[k] != after[k]
    ]
    return ", ".join(parts)


def _change(before: Any, after: Any) -> str:
    if isinstance(before, Mapping) and isinstance(after, Mapping):
        return _mapping_change(before, after)
    if is_dataclass(before) and type(before) is type(after):  # a tuning: only the fields that moved
        return _mapping_change(vars(before), vars(after))
    return f"{_short(before)} -> {_short(after)}"


def describe_leaks(before: Mapping[str, Any], after: Mapping[str, Any]) -> str:
    """One line per leaked setting: its name and what changed, before -> after."""
    return "\n".join(f"{name}: {_change(before[name], after[name])}" for name in leaked(before, after))


def restore(before: Mapping[str, Any], settings: tuple[Setting, ...] = SETTINGS) -> None:
    """Put back every setting that differs from ``before``."""
    now = snapshot(settings)
    for s in settings:
        if not s.same(before[s.name], now[s.name]):
            s.write(before[s.name])


@contextmanager
def no_leaks() -> Iterator[None]:
    """Fail (``pytest.fail``) when the block leaves a setting changed, naming each with its before and
    after, once every setting is back as it was: one leak fails one test, not every later one."""
    before = snapshot()
    yield
    after = snapshot()
    if leaked(before, after):
        restore(before)
        pytest.fail("left process-wide settings changed:\n" + describe_leaks(before, after), pytrace=False)
