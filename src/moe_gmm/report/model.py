"""The measurement table as data: one :class:`Row` per check, collected in a :class:`Report`.

A row carries the eager-path value, the fused-path value, what the numbers mean (``metric``), the
limit they are held to, and whether the check passed. ``passed=None`` marks an informational row
(a load statistic, a time) that has no pass/fail meaning; it never fails a run. A time whose
repeats spread wide (``details`` holding a spread with ``"noisy": True``) is shown as noisy.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Report", "Row", "format_value"]


@dataclass
class Row:
    """One line of the table."""

    section: str
    check: str
    metric: str
    eager: float | str | None
    fused: float | str | None
    tolerance: float | str | None
    passed: bool | None
    notes: str = ""
    # Machine-readable extras (per-expert arrays, shapes...): kept in JSON, used by plots.
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return "info" if self.passed is None else ("PASS" if self.passed else "FAIL")

    @property
    def noisy(self) -> bool:
        """A timing row whose eager or fused repeats spread too wide to trust (see report.timing)."""
        return any(isinstance(v, dict) and v.get("noisy") is True for v in self.details.values())


def format_value(value: float | str | None) -> str:
    """Numbers in a compact fixed form (3 significant digits); strings unchanged; None as a dash."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            return str(value)
        if value == 0.0:
            return "0"
        if 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return str(value)


@dataclass
class Report:
    """All rows of one run plus what the run was (device, dtype, model, backend, seed...)."""

    title: str
    meta: dict[str, Any] = field(default_factory=dict)
    rows: list[Row] = field(default_factory=list)
    # Sentences a reader needs to interpret the rows (printed under the title).
    notes: list[str] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    @property
    def failures(self) -> list[Row]:
        return [r for r in self.rows if r.passed is False]

    @property
    def ok(self) -> bool:
        return not self.failures

    def sections(self) -> list[str]:
        seen: list[str] = []
        for r in self.rows:
            if r.section not in seen:
                seen.append(r.section)
        return seen

    def to_dict(self) -> dict[str, Any]:
        counts = {"pass": 0, "fail": 0, "info": 0, "noisy": 0}
        for r in self.rows:
            counts[r.status.lower()] += 1
            counts["noisy"] += r.noisy
        return {
            "title": self.title,
            "notes": self.notes,
            "meta": self.meta,
            "summary": {"ok": self.ok, **counts},
            "rows": [{**asdict(r), "status": r.status, "noisy": r.noisy} for r in self.rows],
        }
