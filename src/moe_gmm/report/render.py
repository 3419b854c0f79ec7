"""Render a :class:`~moe_gmm.report.model.Report` to the terminal (rich), Markdown and JSON."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from moe_gmm.report.model import Report, format_value

__all__ = ["render_terminal", "to_json", "to_markdown", "wide_console", "write_report"]

_COLUMNS = ("check", "metric", "eager", "fused", "tolerance", "result", "notes")


def _result(row) -> str:
    # A time is never pass/fail; a noisy one says so where the eye looks for a verdict.
    return "info, NOISY" if row.noisy else row.status


def _cells(row) -> list[str]:
    return [
        row.check,
        row.metric,
        format_value(row.eager),
        format_value(row.fused),
        format_value(row.tolerance),
        _result(row),
        row.notes,
    ]


def _counts(summary: dict) -> str:
    noisy = f", {summary['noisy']} noisy timing(s)" if summary["noisy"] else ""
    return f"{summary['pass']} pass, {summary['fail']} fail, {summary['info']} info{noisy}"


def _meta_line(report: Report) -> str:
    return ", ".join(f"{k}={v}" for k, v in report.meta.items() if not isinstance(v, (dict, list)))


def to_markdown(report: Report) -> str:
    """A Markdown document: header, one table per section, and a summary line."""
    lines = [f"# {report.title}", "", _meta_line(report), ""]
    for note in report.notes:
        lines += [f"> {note}", ""]
    for section in report.sections():
        lines += [f"## {section}", "", "| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
        for row in report.rows:
            if row.section == section:
                cells = [c.replace("|", "\\|") for c in _cells(row)]
                if row.passed is False:
                    cells[5] = "**FAIL**"
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    summary = report.to_dict()["summary"]
    verdict = "all checks pass" if report.ok else f"{summary['fail']} check(s) FAILED"
    lines.append(f"**{verdict}** ({_counts(summary)})")
    return "\n".join(lines) + "\n"


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/Inf; write them as strings so the file stays strict JSON.
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def to_json(report: Report) -> str:
    return json.dumps(_jsonable(report.to_dict()), indent=2, allow_nan=False) + "\n"


# Piped output (CI logs, files) is read in an editor or a browser that scrolls sideways: rich's
# 80-column default would fold every wide table, so lines there are as long as their content.
_PIPED_WIDTH = 10_000


def wide_console(**kwargs: Any):
    """A rich console (``kwargs`` go to ``rich.console.Console``): the terminal's width on a terminal,
    else wide enough that no table folds a cell."""
    from rich.console import Console

    console = Console(**kwargs)
    if console.is_terminal or "width" in kwargs:
        return console
    return Console(width=_PIPED_WIDTH, **kwargs)


def render_terminal(report: Report, console=None) -> None:
    """Print one rich table per section, then a verdict line."""
    from rich.table import Table

    console = console or wide_console()
    console.print(f"[bold]{report.title}[/bold]  [dim]{_meta_line(report)}[/dim]")
    for note in report.notes:
        console.print(f"[italic]{note}[/italic]")
    style = {"PASS": "green", "FAIL": "bold red", "info": "dim"}
    for section in report.sections():
        table = Table(title=section, title_justify="left", title_style="bold")
        for name in _COLUMNS:
            wide = name in ("check", "notes")
            table.add_column(name, overflow="fold", no_wrap=not wide, min_width=28 if name == "check" else None)
        for row in report.rows:
            if row.section == section:
                cells = _cells(row)
                cells[5] = f"[{'yellow' if row.noisy else style[row.status]}]{cells[5]}[/]"
                table.add_row(*cells)
        console.print(table)
    summary = report.to_dict()["summary"]
    if report.ok:
        console.print(f"[green]all checks pass[/] ({_counts(summary)})")
    else:
        console.print(f"[bold red]{summary['fail']} check(s) FAILED[/]: " + "; ".join(r.check for r in report.failures))


def write_report(report: Report, out_dir: str | Path) -> dict[str, Path]:
    """Write ``report.md`` and ``report.json`` into ``out_dir``; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "report.md", "json": out / "report.json"}
    paths["markdown"].write_text(to_markdown(report))
    paths["json"].write_text(to_json(report))
    return paths
