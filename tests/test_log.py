"""The ``moe_gmm`` logger: silent unless asked, opt-in by environment or call, one handler at most."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_gmm
from moe_gmm import log


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    src = str(Path(moe_gmm.__file__).parents[1])
    full_env = {k: v for k, v in os.environ.items() if k != log.LOG_ENV_VAR}
    full_env.update(PYTHONPATH=src, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
        check=False,
    )


_ONE_CALL = """
    import logging
    import torch
    import moe_gmm
    handlers = logging.getLogger("moe_gmm").handlers
    print(sorted(type(h).__name__ for h in handlers))
    moe_gmm.grouped_matmul(torch.randn(6, 8), torch.randn(2, 8, 4), [2, 4])
"""


def test_the_library_adds_only_a_null_handler_and_prints_nothing():
    done = _python(_ONE_CALL)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['NullHandler']"
    assert done.stderr == ""


@pytest.mark.parametrize("level", ["info", "DEBUG"])
def test_the_environment_variable_turns_logging_on(level):
    done = _python(_ONE_CALL, MOE_GMM_LOG=level)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['NullHandler', '_OwnHandler']"
    assert "moe_gmm INFO: grouped_matmul on cpu float32, weight [2, 8, 4]: backend" in done.stderr


def test_an_unknown_level_in_the_environment_warns_and_stays_quiet():
    done = _python(_ONE_CALL, MOE_GMM_LOG="loud")
    assert done.returncode == 0, done.stderr
    assert "MOE_GMM_LOG must be one of ['debug', 'info', 'warning'], got 'loud'" in done.stderr
    assert "backend" not in done.stderr


@pytest.fixture
def restored_logger():
    logger = logging.getLogger("moe_gmm")
    handlers, level = list(logger.handlers), logger.level
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


def test_enable_logging_adds_one_handler_and_changes_its_level(restored_logger):
    stream = io.StringIO()
    log.enable_logging("debug", stream)
    log.enable_logging("warning")
    own = [h for h in restored_logger.handlers if not isinstance(h, logging.NullHandler)]
    assert len(own) == 1 and own[0].level == logging.WARNING
    restored_logger.info("hidden")
    restored_logger.warning("shown")
    assert stream.getvalue() == "moe_gmm WARNING: shown\n"


def test_enable_logging_rejects_a_bad_level(restored_logger):
    with pytest.raises(ValueError, match=r"level must be one of \['debug', 'info', 'warning'\].*got 'verbose'"):
        log.enable_logging("verbose")
    with pytest.raises(TypeError, match="level must be a str or an int, got float"):
        log.enable_logging(1.5)


def test_shows_follows_levels_handlers_and_propagation():
    top = logging.getLogger("moe_gmm_shows_test")
    top.propagate = False  # keep the test's own root handlers (pytest's) out of it
    child = logging.getLogger("moe_gmm_shows_test.child")
    top.setLevel(logging.INFO)
    assert not log.shows(logging.INFO, child), "no handler at all"
    top.addHandler(logging.NullHandler())
    assert not log.shows(logging.INFO, child), "a NullHandler prints nothing"
    handler = logging.StreamHandler(io.StringIO())
    top.addHandler(handler)
    assert log.shows(logging.INFO, child) and not log.shows(logging.DEBUG, child)
    child.propagate = False
    assert not log.shows(logging.INFO, child)
    child.propagate = True
    handler.setLevel(logging.ERROR)
    assert not log.shows(logging.INFO, child) and log.shows(logging.ERROR, child)
