"""Run a function on N local gloo ranks, bounded in time, with every rank's failure reported.

Used by the distributed tests and the benchmark runners (``torchrun`` is the launcher for real
jobs). Each rank is a fresh process, forked from a ``forkserver`` that imported torch once (a cold
``spawn`` re-imports torch in every rank, seconds each on a busy machine). Each rank

1. pins one intra-op thread (N CPU-heavy processes with several threads each on a few cores run
   10-50x slower),
2. joins a gloo process group on ``127.0.0.1`` with a timeout, so a dead or hung peer turns into an
   error instead of a hang,
3. runs ``fn(rank, world_size, *args)`` and sends back its return value or its traceback.

The parent kills every rank once ``timeout_s`` has passed and raises :class:`RankFailure` listing
what each rank did (returned, raised with traceback, exited with a code, or was killed).
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import multiprocessing as mp
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailure", "free_port", "run_ranks"]


class RankFailure(RuntimeError):
    """At least one rank failed; ``reports[r]`` says what rank r did, ``results[r]`` its return value."""

    def __init__(self, message: str, reports: dict[int, str], results: dict[int, Any]):
        super().__init__(message)
        self.reports = reports
        self.results = results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """``forkserver`` with torch preloaded where the platform has it, else ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Takes effect when the server starts (the first call), then every rank forks from it. The
    # server imports torch but runs no op, so no thread pool exists yet when it forks.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "moe_gmm.parallel.launch"])
    return ctx


def _rank_main(rank, world_size, port, pg_timeout_s, watchdog_s, fn, args, results) -> None:
    torch.set_num_threads(1)
    # A rank still running at the deadline prints every thread's stack before the parent kills it.
    faulthandler.dump_traceback_later(watchdog_s, exit=False)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        value = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(value, buf)  # bytes, not shared-memory handles: this process may exit before they are read
        results.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # best effort: a dead peer can make teardown fail too
                dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120.0,
    pg_timeout_s: float | None = None,
    may_exit: Iterable[int] = (),
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` must be importable by name (defined at module level). ``may_exit`` lists ranks that are
    expected to end without returning (a fault-injection test killing a rank); their result is None.
    ``pg_timeout_s`` (default: half of ``timeout_s``, at most 30 s) bounds every collective.
    Raises :class:`RankFailure` if any other rank raised, exited early or ran past ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if pg_timeout_s is None:
        pg_timeout_s = min(30.0, timeout_s / 2)
    if pg_timeout_s >= timeout_s:
        raise ValueError(f"pg_timeout_s ({pg_timeout_s}) must be below timeout_s ({timeout_s})")
    may_exit = set(may_exit)
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    watchdog_s = max(timeout_s - 3.0, 1.0)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(r, world_size, port, pg_timeout_s, watchdog_s, fn, args, results),
            name=f"rank{r}",
            daemon=True,
        )
        for r in range(world_size)
    ]
    start = time.monotonic()
    for p in procs:
        p.start()
    outcome: dict[int, tuple[str, Any]] = {}
    deadline = start + timeout_s
    timed_out = False
    while True:
        try:  # drain continuously: a rank cannot exit until its result has left the pipe
            rank, status, payload = results.get(timeout=0.05)
            outcome[rank] = (status, payload)
            continue
        except queue.Empty:
            pass
        if all(not p.is_alive() for p in procs):
            break
        if len(outcome) == world_size:
            # Every rank finished its work: give them a moment to tear down, then stop waiting for
            # interpreter shutdown (seconds on a loaded machine) and end them below.
            for p in procs:
                p.join(timeout=max(0.0, min(2.0, deadline - time.monotonic())))
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join(timeout=5.0)
    while True:  # results that arrived while the last processes were exiting
        try:
            rank, status, payload = results.get(timeout=0.05)
            outcome[rank] = (status, payload)
        except queue.Empty:
            break
    values: dict[int, Any] = {}
    reports: dict[int, str] = {}
    failed = False
    for r, p in enumerate(procs):
        status, payload = outcome.get(r, (None, None))
        if status == "ok":
            values[r] = torch.load(io.BytesIO(payload), weights_only=False)
            reports[r] = "returned"
        elif status == "error":
            reports[r] = "raised:\n" + payload
            failed = True
        elif timed_out and p.exitcode is not None and p.exitcode < 0:
            reports[r] = f"killed after the {timeout_s:.0f} s timeout (its stack is in the captured stderr)"
            failed = True
        else:
            reports[r] = f"exited with code {p.exitcode} without a result"
            failed = failed or r not in may_exit
    elapsed = time.monotonic() - start
    if failed or timed_out:
        lines = [
            f"{sum(1 for v in reports.values() if v != 'returned')} of {world_size} ranks failed "
            f"after {elapsed:.1f} s" + (f" (timeout {timeout_s:.0f} s)" if timed_out else "")
        ]
        lines += [f"--- rank {r}: {reports[r]}" for r in range(world_size)]
        raise RankFailure("\n".join(lines), reports, values)
    return [values.get(r) for r in range(world_size)]
