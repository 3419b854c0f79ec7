"""The guard every test runs under (``tests/conftest.py``): a changed process-wide setting fails the test.

Each case changes one setting inside the guard the fixture uses and leaves it changed; the guard
must fail naming that setting with its before and after, and put it back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

import pytest
import torch

from moe_gmm import log
from moe_gmm.ops import backends, native
from moe_gmm.ops.backends.cpu.tuning import current_tuning, use_tuning
from tests.helpers.global_state import SET_ON_FIRST_USE, SETTINGS, leaked, no_leaks, snapshot


def _other_threads() -> None:
    torch.set_num_threads(2 if torch.get_num_threads() == 1 else 1)


_OPEN_BLOCKS: list = []  # held, or collecting the generator would run its finally and undo the leak


def _tuning_block_left_open() -> None:
    block = use_tuning(min_threads=current_tuning().min_threads + 5)
    block.__enter__()
    _OPEN_BLOCKS.append(block)


def _extra_backend() -> None:
    backends.register_backend(dataclasses.replace(backends.get_backend("eager"), name="leak_probe"))


def _environ_added() -> None:
    os.environ["MOE_GMM_LEAK_PROBE"] = "1"


def _environ_removed() -> None:
    os.environ.pop("HF_HUB_OFFLINE")  # set by tests/conftest.py for the whole run


LEAKS: dict[str, tuple[str, Callable[[], None]]] = {
    "threads": ("torch threads", _other_threads),
    "dtype": ("torch default dtype", lambda: torch.set_default_dtype(torch.float64)),
    "device": ("torch default device", lambda: torch.set_default_device("meta")),
    "matmul precision": ("torch float32 matmul precision", lambda: torch.set_float32_matmul_precision("medium")),
    "deterministic": ("torch deterministic (on, warn only, fill memory): (False", lambda: torch.use_deterministic_algorithms(True)),
    "grad mode": ("torch grad mode", lambda: torch.set_grad_enabled(False)),
    "anomaly mode": ("torch anomaly mode", lambda: torch.set_anomaly_enabled(True)),
    "tuning": ("moe_gmm CPU tuning: min_threads", _tuning_block_left_open),
    "native": ("moe_gmm native kernels enabled", lambda: native.set_enabled(not native.enabled())),
    "registry added": ("moe_gmm backend registry: +leak_probe", _extra_backend),
    "registry removed": ("moe_gmm backend registry: -torch", lambda: backends.unregister_backend("torch")),
    "logger": ("moe_gmm logger (level, handlers, propagate, disabled): (0,", lambda: log.enable_logging("debug")),
    "root logger": ("root logger level: 30 -> 10", lambda: logging.getLogger().setLevel(logging.DEBUG)),
    "environ added": ("os.environ: +MOE_GMM_LEAK_PROBE='1'", _environ_added),
    "environ removed": ("os.environ: -HF_HUB_OFFLINE", _environ_removed),
    "environ changed": ("os.environ: HF_HUB_OFFLINE: '1' -> '0'", lambda: os.environ.update(HF_HUB_OFFLINE="0")),
}


@pytest.mark.parametrize("case", sorted(LEAKS))
def test_a_leaked_setting_fails_names_it_and_is_put_back(case: str):
    what, leak = LEAKS[case]
    before = snapshot()
    with pytest.raises(pytest.fail.Exception) as failure:
        with no_leaks():
            leak()
    assert what in str(failure.value), str(failure.value)
    assert leaked(before, snapshot()) == []


def test_every_setting_has_a_leak_case():
    """Each setting the guard reads is proved to be caught by a case above."""
    names = {s.name for s in SETTINGS}
    caught = {n for n in names if any(what.startswith(n) for what, _ in LEAKS.values())}
    assert caught == names, sorted(names - caught)


def test_a_change_undone_inside_the_block_is_no_leak():
    with no_leaks():
        with use_tuning(min_threads=99):
            torch.set_num_threads(torch.get_num_threads())
        os.environ["MOE_GMM_LEAK_PROBE"] = "1"
        del os.environ["MOE_GMM_LEAK_PROBE"]


def test_a_variable_libraries_set_on_first_use_may_appear_but_not_change(monkeypatch):
    """torch's inductor records its cache directory in the environment the first time any test
    compiles; the guard accepts it appearing, and nothing else about it."""
    name = next(iter(SET_ON_FIRST_USE))
    monkeypatch.delenv(name, raising=False)
    with no_leaks():
        os.environ[name] = "/tmp/first-use"
    monkeypatch.setenv(name, "/tmp/first-use")  # monkeypatch's undo removes it again
    with pytest.raises(pytest.fail.Exception, match=f"{name}: '/tmp/first-use' -> '/elsewhere'"):
        with no_leaks():
            os.environ[name] = "/elsewhere"
    assert os.environ[name] == "/tmp/first-use"
