"""A run judged against a baseline: improved, regressed and unchanged rows, and rows on one side only.

Rows match by ``(suite, case, impl, dtype, mode)``. A row changed only when the difference is
larger than the noise of both measurements: the run's p20-p80 range and the baseline's do not
overlap, and the medians differ by more than ``min_change`` of the baseline's (a 1-repeat row has
no range of its own). ``ratio`` is the run's median over the baseline's: below 1 is faster.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe_gmm.bench.baseline import Key, load_baseline, row_key, summary_rows, update_baseline
from moe_gmm.bench.table import markdown_table

__all__ = [
    "MIN_CHANGE",
    "VERDICTS",
    "RowChange",
    "apply_baseline_options",
    "check_baseline_options",
    "compare_rows",
    "comparison_text",
    "regressed",
]

VERDICTS = ("regressed", "improved", "missing in run", "new in run", "unchanged")
# Medians closer than this are one measurement, whatever the ranges say.
MIN_CHANGE = 0.05


@dataclass(frozen=True)
class RowChange:
    key: Key
    verdict: str
    baseline_ms: float | None
    run_ms: float | None

    @property
    def ratio(self) -> float | None:
        if self.baseline_ms is None or self.run_ms is None or self.baseline_ms <= 0:
            return None
        return self.run_ms / self.baseline_ms


def _verdict(base: dict[str, Any], new: dict[str, Any], min_change: float) -> str:
    b, n = base["median_ms"], new["median_ms"]
    b_lo, b_hi = base.get("p20_ms", b), base.get("p80_ms", b)
    n_lo, n_hi = new.get("p20_ms", n), new.get("p80_ms", n)
    if n > b * (1 + min_change) and n_lo > b_hi:
        return "regressed"
    if n < b * (1 - min_change) and n_hi < b_lo:
        return "improved"
    return "unchanged"


def compare_rows(
    baseline_rows: Iterable[dict[str, Any]], run_rows: Iterable[dict[str, Any]], *, min_change: float = MIN_CHANGE
) -> list[RowChange]:
    """Every row of either side with its verdict, in :data:`VERDICTS` order, then by key."""
    if isinstance(min_change, bool) or not isinstance(min_change, (int, float)) or not 0 <= min_change < 1:
        raise ValueError(f"min_change must be a number in [0, 1), got {min_change!r}")
    base = {row_key(r): r for r in baseline_rows}
    new = {row_key(r): r for r in run_rows}
    out = []
    for key in base.keys() | new.keys():
        b, n = base.get(key), new.get(key)
        if b is None:
            out.append(RowChange(key, "new in run", None, n["median_ms"]))
        elif n is None:
            out.append(RowChange(key, "missing in run", b["median_ms"], None))
        else:
            out.append(RowChange(key, _verdict(b, n, min_change), b["median_ms"], n["median_ms"]))
    return sorted(out, key=lambda c: (VERDICTS.index(c.verdict), c.key))


def regressed(changes: Iterable[RowChange]) -> bool:
    return any(c.verdict == "regressed" for c in changes)


def _ms_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def comparison_text(changes: list[RowChange], *, show_unchanged: bool = False) -> str:
    """A count per verdict, then a Markdown table of the rows (unchanged ones only when asked)."""
    counts = {v: sum(c.verdict == v for c in changes) for v in VERDICTS}
    lines = ["against the baseline: " + ", ".join(f"{n} {v}" for v, n in counts.items())]
    shown = [c for c in changes if show_unchanged or c.verdict != "unchanged"]
    if shown:
        header = ("verdict", "suite", "case", "impl", "dtype", "mode", "baseline ms", "run ms", "run / baseline")
        rows = [
            [
                c.verdict,
                *c.key,
                _ms_text(c.baseline_ms),
                _ms_text(c.run_ms),
                "-" if c.ratio is None else f"{c.ratio:.2f}",
            ]
            for c in shown
        ]
        lines += ["", *markdown_table(header, rows, right=range(6, len(header)))]
    return "\n".join(lines) + "\n"


def check_baseline_options(args: Any) -> None:
    """Fail before a run, not after it, when ``--compare`` names no readable baseline."""
    if getattr(args, "compare", None):
        try:
            load_baseline(args.compare)
        except ValueError as exc:
            raise SystemExit(f"--compare: {exc}") from None


def apply_baseline_options(run: dict[str, Any], args: Any, suite: str, console: Any) -> int:
    """``--baseline-out`` and ``--compare`` of a runner, after its run: 1 when a row regressed, else 0."""
    code = 0
    if getattr(args, "compare", None):
        baseline_rows = [r for r in load_baseline(args.compare)["rows"] if r["suite"] == suite]
        changes = compare_rows(baseline_rows, summary_rows(run, suite))
        console.print(comparison_text(changes), highlight=False, markup=False, soft_wrap=True)
        code = 1 if regressed(changes) else 0
    if getattr(args, "baseline_out", None):
        try:
            path = update_baseline(args.baseline_out, run, suite=suite)
        except ValueError as exc:
            raise SystemExit(f"--baseline-out: {exc}") from None
        console.print(f"baseline rows ({suite}) written to {Path(path)}")
    return code
