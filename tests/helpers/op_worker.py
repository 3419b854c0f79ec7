"""A long-lived child process that runs API calls for a test, so a crash is a failure, not the end of the run.

A segfault or an abort inside a kernel kills the process it happens in. Tests that feed hostile input
run each call in one child (started once, fed calls over a pipe, restarted when it dies) and see
how every call ended: it returned, it raised (which exception), the child died (which signal) or it
hung.

``OpWorker(runner)`` names a ``"module:function"`` the child imports; ``run(payload)`` calls
``function(payload)`` there. Payloads and results are pickled, so they must be plain data.
"""

from __future__ import annotations

import importlib
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

_HEADER = struct.Struct("<Q")
_REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Outcome:
    """How one call ended: ``kind`` is ``"returned"``, ``"raised"``, ``"died"`` or ``"hung"``."""

    kind: str
    exc_types: tuple[str, ...] = ()  # the exception's class and its bases, most derived first
    message: str = ""
    value: object = None
    exit_code: int | None = None
    stderr_tail: str = field(default="", repr=False)

    def raised(self, exc_type: type[BaseException]) -> bool:
        return self.kind == "raised" and exc_type.__name__ in self.exc_types

    def describe(self) -> str:
        if self.kind == "raised":
            return f"raised {self.exc_types[0]}: {self.message}"
        if self.kind == "returned":
            return f"returned {self.value!r}"
        if self.kind == "died":
            code = self.exit_code
            how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
            return f"the child process died ({how}); stderr ends: {self.stderr_tail[-600:]}"
        return f"hung: {self.message}"


def _source_dir() -> Path:
    import moe_gmm

    return Path(moe_gmm.__file__).resolve().parents[1]


class OpWorker:
    """One child process running ``runner`` calls; restarted after it dies or hangs."""

    def __init__(self, runner: str, *, src_dir: Path | None = None, timeout_s: float = 120.0) -> None:
        self.runner = runner
        self.src_dir = src_dir or _source_dir()
        self.timeout_s = timeout_s
        self.starts = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._stderr_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"op_worker_{os.getpid()}_{id(self)}.err"

    def _start(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.src_dir), str(_REPO_ROOT), env.get("PYTHONPATH", "")])
        env.setdefault("OMP_NUM_THREADS", "1")
        self.starts += 1
        with open(self._stderr_path, "wb") as err:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "tests.helpers.op_worker", self.runner],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, cwd=_REPO_ROOT, env=env,
            )  # fmt: skip
        return self._proc

    def _stderr_tail(self) -> str:
        try:
            return self._stderr_path.read_bytes()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def run(self, payload: object) -> Outcome:
        proc = self._proc if self._proc is not None and self._proc.poll() is None else self._start()
        data = pickle.dumps(payload)
        try:
            proc.stdin.write(_HEADER.pack(len(data)) + data)
            proc.stdin.flush()
            reply = self._read(proc)
        except (BrokenPipeError, EOFError):
            return self._died(proc)
        except TimeoutError:
            self._stop(proc)
            return Outcome("hung", message=f"no answer within {self.timeout_s} s")
        return reply

    def _read(self, proc: subprocess.Popen[bytes]) -> Outcome:
        header = self._read_exactly(proc, _HEADER.size)
        (size,) = _HEADER.unpack(header)
        return Outcome(**pickle.loads(self._read_exactly(proc, size)))

    def _read_exactly(self, proc: subprocess.Popen[bytes], size: int) -> bytes:
        fd = proc.stdout.fileno()
        chunks, left = [], size
        while left:
            ready, _, _ = select.select([fd], [], [], self.timeout_s)
            if not ready:
                raise TimeoutError
            chunk = os.read(fd, left)
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _died(self, proc: subprocess.Popen[bytes]) -> Outcome:
        code = proc.wait(timeout=30)
        self._proc = None
        return Outcome("died", exit_code=code, stderr_tail=self._stderr_tail())

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        proc.kill()
        proc.wait(timeout=30)
        self._proc = None

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._stop(self._proc)
        self._proc = None
        self._stderr_path.unlink(missing_ok=True)


def _serve(runner: str) -> None:
    """The child: answer calls from stdin on a private copy of stdout until stdin closes."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything the code under test prints goes to stderr, not into the replies
    module_name, fn_name = runner.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    inp = sys.stdin.buffer
    while header := inp.read(_HEADER.size):
        (size,) = _HEADER.unpack(header)
        payload = pickle.loads(inp.read(size))
        # A plain dict: this module runs as __main__ here, so an Outcome would not unpickle there.
        try:
            outcome = {"kind": "returned", "value": fn(payload)}
        except Exception as exc:  # noqa: BLE001 -- every exception is an answer here; the parent judges it
            names = tuple(c.__name__ for c in type(exc).__mro__)
            outcome = {"kind": "raised", "exc_types": names, "message": str(exc)[:2000]}
        data = pickle.dumps(outcome)
        out.write(_HEADER.pack(len(data)) + data)
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1])
