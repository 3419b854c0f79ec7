"""``--verbose``: the backend log on stderr for every command; quiet without it."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import moe_gmm
from moe_gmm.cli import EXIT_USAGE, build_parser


@pytest.mark.parametrize("command", ["validate", "train", "bench"])
def test_every_command_takes_verbose(command):
    assert build_parser().parse_args([command, "--verbose"]).verbose is True
    assert build_parser().parse_args([command]).verbose is False


_RUN = """
    import sys
    from moe_gmm.cli import main
    sys.exit(main(sys.argv[1:]))
"""


def _cli(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "MOE_GMM_LOG"}
    env["PYTHONPATH"] = str(Path(moe_gmm.__file__).parents[1])
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_RUN), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
def test_validate_verbose_logs_the_backend_of_each_layer_shape(tmp_path):
    argv = ["validate", "--quick", "--tokens", "8", "--no-plots", "--dtype", "fp32"]
    loud = _cli(*argv, "--verbose", "--out", str(tmp_path / "a"))
    assert loud.returncode == 0, loud.stderr[-2000:]
    lines = [line for line in loud.stderr.splitlines() if line.startswith("moe_gmm INFO: grouped_matmul on cpu")]
    # The tiny model's two projections at least, each once however many calls ran them.
    assert len(lines) >= 2 and len(lines) == len(set(lines)), loud.stderr[-2000:]
    assert any("weight [8, 64, 64]: backend" in line for line in lines), lines
    quiet = _cli(*argv, "--out", str(tmp_path / "b"))
    assert quiet.returncode == 0 and "moe_gmm INFO" not in quiet.stderr


def test_verbose_does_not_hide_usage_errors():
    done = _cli("validate", "--verbose", "--dtype", "fp8")
    assert done.returncode == EXIT_USAGE and "invalid choice: 'fp8'" in done.stderr
