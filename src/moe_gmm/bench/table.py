"""Render a :class:`~moe_gmm.bench.harness.BenchReport` for people: rich tables and Markdown."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import Any

from moe_gmm.bench.harness import BenchReport, summarize
from moe_gmm.report.timing import NOISY_MAX_OVER_MIN, NOISY_P80_OVER_P20, Spread

__all__ = ["markdown_report", "markdown_table", "print_report", "write_outputs"]


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], right: Collection[int] = ()) -> list[str]:
    """A Markdown pipe table as lines: the header, its rule (right-aligned for the column indices in
    ``right``), one line per row; a ``|`` inside a cell becomes ``/``."""
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
    lines = ["| " + " | ".join(header) + " |", rule]
    return lines + ["| " + " | ".join(str(cell).replace("|", "/") for cell in row) + " |" for row in rows]


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 100 else f"{ms:.0f}"


def _ratio(value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "-"
    return f"{value:.2f}x"


def _cell(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    if row.get("median_s") is None:
        return "skip"
    spread = ""
    if row.get("p20_s") is not None and row.get("p80_s") is not None:
        spread = f" [{_ms(row['p20_s'])}-{_ms(row['p80_s'])}]"
    return f"{_ms(row['median_s'])}{spread} ({row['x_floor']:.2f}x){' NOISY' if _noisy(row) else ''}"


def _noisy(row: dict[str, Any]) -> bool:
    """The reports' noise rule (:class:`moe_gmm.report.timing.Spread`) on a benchmark row's repeats."""
    if any(row.get(k) is None for k in ("median_s", "p20_s", "p80_s", "min_s")):
        return False
    s = {k: row[f"{k}_s"] for k in ("median", "p20", "p80", "min")}
    # Rows written before max_s was recorded judge by their middle alone.
    return Spread(**s, max=row.get("max_s", s["min"]), repeats=row.get("repeats", 0)).noisy


def _repeats_note(report: BenchReport) -> str:
    counts = [r["repeats"] for r in report.rows if r.get("repeats")]
    if not counts:
        return ""
    few, many = min(counts), max(counts)
    n = str(few) if few == many else f"{few}-{many}"
    return (
        f"cell: median [p20-p80] ms of {n} interleaved repeats (time / roofline floor); NOISY: "
        f"p80/p20 > {NOISY_P80_OVER_P20:g} or max/min > {NOISY_MAX_OVER_MIN:g}"
    )


def _grouped(report: BenchReport) -> list[tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
    """Rows grouped by (case, label, dtype, mode), in run order: ``(first_row, {impl: row})``."""
    groups: dict[tuple, tuple[dict[str, Any], dict[str, dict[str, Any]]]] = {}
    for row in report.rows:
        key = (row["case"], row.get("label", ""), row["dtype"], row["mode"])
        groups.setdefault(key, (row, {}))[1][row["impl"]] = row
    return list(groups.values())


def _speedup(primary: dict[str, Any] | None, other: dict[str, Any] | None) -> float | None:
    if not primary or not other or primary.get("median_s") is None or other.get("median_s") is None:
        return None
    return other["median_s"] / primary["median_s"]


def _case_rate(row: dict[str, Any], report: BenchReport) -> str:
    """The GEMM rate measured in the row's timing rounds, and its share of the run's peak."""
    rate = row.get("case_gemm_rate")
    if rate is None:
        return "-"
    return f"{rate / 1e9:.0f} ({rate / report.limits.peak_flops[row['dtype']]:.0%})"


def _table_data(report: BenchReport) -> tuple[list[str], list[list[str]]]:
    label_keys = [k for k in ("label", "shape") if any(k in r for r in report.rows)]
    case_rates = any("case_gemm_rate" in r for r in report.rows)
    header = ["case", *label_keys, "dtype", "mode", "floor ms"]
    if case_rates:
        header.append("GEMM here GFLOP/s (of peak)")
    header += [f"{name} ms (x floor)" for name in report.impls]
    if case_rates and report.primary:
        header.append(f"{report.primary} x floor at the rate here")
    others = [n for n in report.impls if n != report.primary] if report.primary else []
    header += [f"{report.primary} vs {n}" for n in others]
    header.append("max rel err")
    lines = []
    for first, by_impl in _grouped(report):
        line = [first["case"], *(str(first.get(k, "")) for k in label_keys), first["dtype"], first["mode"]]
        line.append(f"{_ms(first['floor_s'])} {first['bound'][0]}")
        if case_rates:
            line.append(_case_rate(first, report))
        line += [_cell(by_impl.get(name)) for name in report.impls]
        if case_rates and report.primary:
            line.append(_ratio((by_impl.get(report.primary) or {}).get("x_case_floor")))
        line += [_ratio(_speedup(by_impl.get(report.primary), by_impl.get(n))) for n in others]
        errs = [r["rel_err"] for r in by_impl.values() if r.get("rel_err") is not None]
        line.append(f"{max(errs):.1e}" if errs else "-")
        lines.append(line)
    return header, lines


def _summary_data(report: BenchReport) -> tuple[list[str], list[list[str]]]:
    header = [
        "dtype",
        "mode",
        "impl",
        "cases",
        "geomean x floor",
        "worst x floor",
        "worst case",
        f"vs {report.reference}",
    ]
    summary = summarize(report.rows, report.reference)
    case_rates = any("geomean_x_case_floor" in s for s in summary)
    if case_rates:
        header.append("geomean / worst x floor at the rate here")
    lines = []
    for s in summary:
        line = [
            s["dtype"],
            s["mode"],
            s["impl"],
            str(s["cases"]),
            f"{s['geomean_x_floor']:.2f}",
            f"{s['worst_x_floor']:.2f}",
            s["worst_case"],
            _ratio(s["geomean_speedup_vs_reference"]),
        ]
        if case_rates:
            at_case = ("geomean_x_case_floor", "worst_x_case_floor")
            line.append(" / ".join(f"{s[k]:.2f}" for k in at_case) if at_case[0] in s else "-")
        lines.append(line)
    return header, lines


def _header_lines(report: BenchReport) -> list[str]:
    lim = report.limits
    peaks = ", ".join(
        f"{k} {v / 1e9:.0f} GFLOP/s" + (f" ({lim.peak_sources[k]})" if k in lim.peak_sources else "")
        for k, v in lim.peak_flops.items()
    )
    end = report.load_average_end
    lines = [
        f"machine: {report.machine.one_line()}",
        f"limits (measured this run): peak GEMM {peaks}; copy bandwidth {lim.copy_bandwidth / 1e9:.1f} GB/s",
        f"started {report.started_utc} UTC, wall {report.wall_s:.0f} s"
        + (f", load average at end {', '.join(f'{v:.2f}' for v in end)}" if end else ""),
    ]
    if report.command:
        lines.append(f"command: {report.command}")
    lines += report.notes
    return lines


def print_report(report: BenchReport, console=None) -> None:
    """Print the header, the per-case table and the summary with ``rich``."""
    from rich.table import Table

    from moe_gmm.report.render import wide_console

    console = console or wide_console()
    console.print(f"[bold]{report.title}[/bold]")
    for line in _header_lines(report):
        console.print(line, highlight=False)
    header, lines = _table_data(report)
    caption = (_repeats_note(report) or "cell: median ms (time / roofline floor)") + (
        "; floor c = compute-bound, m = memory-bound"
    )
    if any("case_gemm_rate" in r for r in report.rows):
        caption += "; the rate here: a square GEMM timed in the case's rounds, the compute floor from its median"
    table = Table(show_lines=False, header_style="bold", caption=caption)
    for i, name in enumerate(header):
        table.add_column(name, justify="left" if i < 2 else "right", overflow="fold")
    for line in lines:
        table.add_row(*line)
    console.print(table)
    header, lines = _summary_data(report)
    summary = Table(title="summary (geometric means over cases)", header_style="bold")
    for name in header:
        summary.add_column(name, overflow="fold")
    for line in lines:
        summary.add_row(*line)
    console.print(summary)


def markdown_report(report: BenchReport) -> str:
    """The same tables as Markdown."""
    out = [f"### {report.title}", ""]
    out += [f"- {line}" for line in _header_lines(report)]
    if _repeats_note(report):
        out.append(f"- {_repeats_note(report)}")
    for header, lines in (_table_data(report), _summary_data(report)):
        out += ["", *markdown_table(header, lines)]
    return "\n".join(out) + "\n"


def write_outputs(report: dict[str, Any], text: str, out: Path, markdown: Path | None = None) -> None:
    """Write ``report`` as JSON to ``out`` and, when ``markdown`` is given, ``text`` there (folders created)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if markdown is not None:
        markdown.parent.mkdir(parents=True, exist_ok=True)
        markdown.write_text(text)
    print(f"wrote {out}")
