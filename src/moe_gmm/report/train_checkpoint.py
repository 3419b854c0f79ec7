"""What keeps ``moe-gmm train``'s ``--out`` folder one run's: its identity, its lock, its file kinds, Ctrl-C.

- **Run identity**: the seed and every config value a resume must share (all but the mesh,
  ``training.steps`` and ``training.checkpoint_every``), stored in each checkpoint's signed extras;
  ``--resume`` refuses a checkpoint of another seed or config, naming the keys that differ.
- **Lock**: ``--out/.lock`` held with ``flock`` for the whole run, so a second run on the same
  folder is refused. The kernel drops the lock when its holder exits, however it exits, so a lock
  file left behind by a killed run is never stale.
- **Kinds**: every name the run writes must be absent or of the kind it writes (a directory named
  ``losses.csv`` is a usage error before the first step, not a traceback after the last).
- **Ctrl-C while saving** is held until the checkpoint is complete and signed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from moe_gmm.config import RunConfig, config_to_dict

__all__ = [
    "LOCK_FILE",
    "OutDirError",
    "check_out_kinds",
    "check_run_identity",
    "deferred_interrupt",
    "lock_out_dir",
    "run_identity",
]

LOCK_FILE = ".lock"
# Keys a resumed run may change: the mesh it runs on, how far it goes, how often it saves.
_RESUMABLE = ("parallel", "training.steps", "training.checkpoint_every")


class OutDirError(ValueError):
    """``--out`` cannot hold this run (in use by another run, or a name of the wrong kind)."""


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out |= _flatten(value, f"{prefix}.{key}" if prefix else str(key))
    return out


def run_identity(cfg: RunConfig) -> str:
    """The run's identity as canonical JSON: seed, the config a resume must share, and its sha256."""
    resumable = lambda key: any(key == r or key.startswith(r + ".") for r in _RESUMABLE)
    flat = {k: v for k, v in _flatten(config_to_dict(cfg)).items() if not resumable(k)}
    digest = hashlib.sha256(json.dumps(flat, sort_keys=True).encode()).hexdigest()
    return json.dumps({"seed": cfg.seed, "config": flat, "config_sha256": digest}, sort_keys=True)


def check_run_identity(saved: Any, cfg: RunConfig, where: str) -> str | None:
    """Why the checkpoint ``where`` (whose identity is ``saved``) belongs to another run than ``cfg``'s, or None."""
    try:
        theirs = json.loads(saved)
        their_config, their_seed = dict(theirs["config"]), theirs["seed"]
    except (TypeError, ValueError, KeyError):
        return f"{where} carries no run identity (written by another program?)"
    mine = json.loads(run_identity(cfg))
    if their_seed != mine["seed"]:
        return f"{where} belongs to another run: seed {their_seed} there, {mine['seed']} here"
    differ = sorted(k for k in set(their_config) | set(mine["config"]) if their_config.get(k) != mine["config"].get(k))
    if differ:
        shown = ", ".join(f"{k} ({their_config.get(k)!r} there, {mine['config'].get(k)!r} here)" for k in differ[:3])
        return f"{where} belongs to another run: the config differs in {shown}"
    return None


@contextlib.contextmanager
def lock_out_dir(out: Path) -> Iterator[None]:
    """Hold ``out/.lock`` exclusively for the block; :class:`OutDirError` naming the holder's pid if taken."""
    import fcntl

    path = out / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise OutDirError(f"--out {str(out)!r}: cannot create {LOCK_FILE} ({exc.strerror or exc})") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise OutDirError(f"--out {str(out)!r}: cannot lock {LOCK_FILE} ({exc.strerror or exc})") from None
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
            raise OutDirError(
                f"--out {str(out)!r} is in use by another moe-gmm train (pid {holder}); "
                "wait for it to finish or choose another --out"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # who holds it, for the message above
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def check_out_kinds(out: Path, files: tuple[str, ...], directories: tuple[str, ...]) -> None:
    """Refuse, before anything runs, a name in ``out`` the run writes that exists as the other kind."""
    for name in files:
        if (out / name).exists() and not (out / name).is_file():
            raise OutDirError(f"--out {str(out)!r}: {name} is a directory; the run writes a file there")
    for name in directories:
        if (out / name).exists() and not (out / name).is_dir():
            raise OutDirError(f"--out {str(out)!r}: {name} is a file; the run writes a checkpoint directory there")


@contextlib.contextmanager
def deferred_interrupt() -> Iterator[None]:
    """Hold SIGINT (Ctrl-C) until the block ends, then raise ``KeyboardInterrupt``: a save is never cut in half.

    Only the main thread can own signal handlers; elsewhere the block runs as is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
