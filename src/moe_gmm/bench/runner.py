"""What every benchmark runner's command line shares: options, comma lists, threads, progress."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from typing import Any, ParamSpec

import torch

__all__ = ["add_run_arguments", "maybe_progress", "restores_threads", "set_threads", "split_choices", "warning_printer"]


def maybe_progress(enabled: bool):
    """A transient ``rich`` progress bar on stderr, or a null context with ``None``."""
    if not enabled:
        return nullcontext(None)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )


_P = ParamSpec("_P")


def set_threads(threads: int | None) -> None:
    """Apply a runner's ``--threads`` (None: keep torch's count); its entry point restores the count."""
    if threads is None:
        return
    if threads < 1:
        raise SystemExit(f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def restores_threads(main: Callable[_P, int]) -> Callable[_P, int]:
    """Wrap a runner's ``main`` so the torch thread count it found is back when it returns or raises.

    The runners are called in-process too (tests, ``moe-gmm bench``); a count left behind would
    change the speed and the reduction order of everything that runs after them.
    """

    @functools.wraps(main)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> int:
        before = torch.get_num_threads()
        try:
            return main(*args, **kwargs)
        finally:
            if torch.get_num_threads() != before:
                torch.set_num_threads(before)

    return wrapper


def split_choices(text: str, allowed: Iterable[str], what: str) -> list[str]:
    """Parse a comma list from the command line, every item one of ``allowed`` (else exit with usage)."""
    allowed = list(allowed)
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise SystemExit(f"{what}: expected a comma list of {sorted(allowed)}, got {text!r}")
    return items


def add_run_arguments(parser) -> None:
    """The options every benchmark runner shares: repeats, outputs, threads, progress, baselines."""
    parser.add_argument("--repeats", type=int, default=None, help="minimum timed repeats per implementation")
    parser.add_argument("--out", default=None, help="write the run's JSON here (e.g. out/bench/gmm.json)")
    parser.add_argument("--markdown", default=None, help="also write the tables as Markdown here")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--compare", default=None, metavar="BASELINE", help="print the rows improved / regressed against a baseline"
    )
    parser.add_argument(
        "--baseline-out", default=None, metavar="FILE", help="write this run's summary rows into a baseline file"
    )


def warning_printer(console: Any) -> Callable[[str], None]:
    """``say(line)`` printing a warning on a rich console as plain text (case names hold brackets)."""
    return lambda line: console.print(line, style="yellow", markup=False, highlight=False)
