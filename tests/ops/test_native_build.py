"""The native build reports itself: a line before, progress while it runs, a line after; a cached
library loads without a word. Real compilations into a fresh ``MOE_GMM_NATIVE_DIR``."""

from __future__ import annotations

import io
import logging
import os
import pty
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_gmm.log import enable_logging
from moe_gmm.ops import native

needs_compiler = pytest.mark.skipif(
    native.compiler() is None,
    reason="no C++ compiler here: the build cannot run, its fallback is tested in test_native",
)

# The smallest kernel file: a real compilation of the same kind as the full build, in less time.
_BUILD = """
    import torch
    from moe_gmm.ops import native
    path = native.build(sources=[native.SOURCES[0]])
    torch.ops.load_library(str(path))
    print(path)
"""


def _python(code: str, stderr=subprocess.PIPE, **env: str) -> subprocess.CompletedProcess:
    src = str(Path(native.__file__).parents[3])
    full_env = {k: v for k, v in os.environ.items() if k != "MOE_GMM_LOG"}  # the default: no logging set up
    full_env.update(PYTHONPATH=src, **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=full_env,
        timeout=600,
        check=False,
    )


@pytest.mark.slow
@needs_compiler
def test_a_first_build_says_what_where_and_how_long_and_a_cached_one_says_nothing(tmp_path):
    first = _python(_BUILD, MOE_GMM_NATIVE_DIR=str(tmp_path))
    assert first.returncode == 0, first.stderr
    path = first.stdout.strip()
    assert Path(path).parent == tmp_path and Path(path).exists()
    lines = first.stderr.splitlines()
    before = [i for i, line in enumerate(lines) if line.startswith("moe_gmm: compiling the native CPU kernels (")]
    assert len(before) == 1, first.stderr
    assert "kernels.cpp" in lines[before[0]] and str(tmp_path) in lines[before[0]]
    assert "make setup" in lines[before[0]] and "python -m moe_gmm.ops.native" in lines[before[0]]
    after = [
        re.fullmatch(rf"moe_gmm: native CPU kernels built in ([0-9.]+) s: {re.escape(path)}", line) for line in lines
    ]
    found = [(i, m) for i, m in enumerate(after) if m]
    assert len(found) == 1 and found[0][0] > before[0], first.stderr
    seconds = float(found[0][1].group(1))
    assert seconds > 0
    progress = [
        line for line in lines if re.fullmatch(r"moe_gmm: compiling the native CPU kernels, \d+ s so far", line)
    ]
    # Piped stderr: a plain line once the build passes 2 s (then every 15 s); none for a quick one.
    if seconds >= 3.0:
        assert 1 <= len(progress) <= 1 + seconds // 15, first.stderr
    elif seconds < 1.5:
        assert not progress, first.stderr

    second = _python(_BUILD, MOE_GMM_NATIVE_DIR=str(tmp_path))
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == path
    assert second.stderr == "", "a cached library must load silently"


@needs_compiler
@pytest.mark.skipif(not native.enabled(), reason="MOE_GMM_NATIVE=0 turns the kernels off")
def test_the_full_library_loads_silently_once_built():
    # The library the package uses, in the user's cache: built by an earlier run or by this one.
    native.build()
    done = _python(
        "from moe_gmm.ops import native; print(native.available(), native.library_path().exists())",
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "True"]
    assert done.stderr == ""


def _on_a_terminal(code: str) -> str:
    """What ``code`` writes to stderr when stderr is a terminal (a pty)."""
    leader, follower = pty.openpty()
    try:
        done = _python(code, stderr=follower)
        os.close(follower)
        follower = -1
        chunks = []
        while True:
            try:
                data = os.read(leader, 4096)
            except OSError:  # the pty closed: everything was read
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert done.returncode == 0
    return b"".join(chunks).decode()


_PROGRESS = """
    import os, sys, time
    from moe_gmm.ops import native
    native._PROGRESS_AFTER_S = 0.2
    native._PLAIN_PROGRESS_EVERY_S = 1.0
    if {replaced}:  # what a progress display does while it runs
        sys.stderr = os.fdopen(os.dup(2), "w")
    with native._build_progress():
        time.sleep(1.6)
    sys.stderr.write("AFTER\\n")
    sys.stderr.flush()
"""


def test_progress_on_a_terminal_rewrites_one_line_and_clears_it():
    text = _on_a_terminal(_PROGRESS.format(replaced=False))
    before = text.split("AFTER")[0]
    ticks = re.findall(r"\rmoe_gmm: compiling the native CPU kernels, (\d+) s so far\x1b\[K", before)
    assert len(ticks) >= 2 and ticks == sorted(ticks, key=int), repr(text)
    assert "\n" not in before, "a terminal gets one rewritten line"
    assert before.endswith("\r\x1b[K"), "the line is cleared when the build ends"


def test_progress_through_a_replaced_stderr_is_plain_lines():
    text = _on_a_terminal(_PROGRESS.format(replaced=True))
    before = text.split("AFTER")[0]
    assert "\x1b[K" not in before and "\r" not in before.replace("\r\n", "")
    lines = before.replace("\r\n", "\n").splitlines()
    assert len(lines) >= 2 and all(
        re.fullmatch(r"moe_gmm: compiling the native CPU kernels, \d+ s so far", x) for x in lines
    )


def test_sources_must_name_files(tmp_path):
    with pytest.raises(ValueError, match="sources must name at least one C\\+\\+ file, got none"):
        native.build(sources=[])
    with pytest.raises(ValueError, match=r"sources must be existing files, got missing \[.*nope.cpp'\]"):
        native.build(sources=[tmp_path / "nope.cpp"])
    with pytest.raises(TypeError, match="sources must be a sequence of paths, got the single path"):
        native.build(sources=str(native.SOURCES[0]))


def test_with_logging_on_the_build_lines_go_through_the_logger_once(capsys):
    logger = logging.getLogger("moe_gmm")
    handlers, level = list(logger.handlers), logger.level
    stream = io.StringIO()
    try:
        native._announce("compiling, for the test")
        assert capsys.readouterr().err == "moe_gmm: compiling, for the test\n", "no handler shows INFO: stderr"
        enable_logging("info", stream)
        native._announce("built, for the test")
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(level)
    assert stream.getvalue() == "moe_gmm INFO: built, for the test\n"
    assert capsys.readouterr().err == "", "shown by the handler, not printed a second time"
