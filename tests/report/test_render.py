"""The report model and its renderers: Markdown, strict JSON, terminal, PNG."""

from __future__ import annotations

import io
import json

import pytest

from moe_gmm.report.model import Report, Row, format_value
from moe_gmm.report.render import render_terminal, to_json, to_markdown, wide_console, write_report
from moe_gmm.report.timing import Spread
from tests.helpers.bench_runs import tiny_gmm_run


def _report() -> Report:
    r = Report("demo", meta={"device": "cpu", "dtype": "bfloat16"})
    r.add(Row("gmm", "forward, uniform", "rel err vs float64", 1.5e-3, 1.6e-3, 1e-2, True))
    r.add(
        Row(
            "gmm",
            "forward | pipe",
            "max abs diff fused-eager",
            None,
            0.5,
            "rtol=0.01 atol=0.01",
            False,
            "worst expert 3",
        )
    )
    r.add(Row("perf", "GMM time", "ms", 4.0, float("nan"), None, None, details={"per_expert": [0.0, 1.0]}))
    return r


def test_status_and_summary():
    r = _report()
    assert [row.status for row in r.rows] == ["PASS", "FAIL", "info"]
    assert not r.ok and [row.check for row in r.failures] == ["forward | pipe"]
    assert r.to_dict()["summary"] == {"ok": False, "pass": 1, "fail": 1, "info": 1, "noisy": 0}
    assert r.sections() == ["gmm", "perf"]


def test_markdown_has_one_table_per_section_and_escapes_pipes():
    md = to_markdown(_report())
    assert md.startswith("# demo\n")
    assert "## gmm" in md and "## perf" in md
    assert (
        "| forward \\| pipe | max abs diff fused-eager | - | 0.5 | rtol=0.01 atol=0.01 | **FAIL** | worst expert 3 |"
        in md
    )
    assert "**1 check(s) FAILED** (1 pass, 1 fail, 1 info)" in md


def test_json_is_strict_and_keeps_details():
    data = json.loads(to_json(_report()))  # would raise on a bare NaN
    assert data["rows"][2]["fused"] == "nan"
    assert data["rows"][2]["details"] == {"per_expert": [0.0, 1.0]}
    assert data["rows"][1]["status"] == "FAIL"
    assert data["meta"]["dtype"] == "bfloat16"


def test_terminal_lists_failures():
    from rich.console import Console

    buf = io.StringIO()
    render_terminal(_report(), Console(file=buf, width=200))
    text = buf.getvalue()
    assert "forward, uniform" in text and "FAIL" in text
    assert "1 check(s) FAILED: forward | pipe" in text


def test_a_noisy_timing_is_info_and_says_noisy():
    from rich.console import Console

    r = Report("times")
    quiet, wide = Spread.of([10.0, 10.5, 11.0]), Spread.of([10.0, 11.0, 40.0])
    r.add(Row("perf", "step", "ms, median of 3 steps", 10.5, 11.0, None, None, "q", {"eager": quiet.as_dict()}))
    r.add(Row("perf", "gmm", "ms, median of 3 steps", 10.5, 11.0, None, None, "w", {"fused": wide.as_dict()}))
    assert [row.noisy for row in r.rows] == [False, True] and r.ok
    assert r.to_dict()["summary"] == {"ok": True, "pass": 0, "fail": 0, "info": 2, "noisy": 1}
    assert [row["noisy"] for row in json.loads(to_json(r))["rows"]] == [False, True]
    md = to_markdown(r)
    assert "| step | ms, median of 3 steps | 10.5 | 11 | - | info | q |" in md
    assert "| gmm | ms, median of 3 steps | 10.5 | 11 | - | info, NOISY | w |" in md
    assert "**all checks pass** (0 pass, 0 fail, 2 info, 1 noisy timing(s))" in md
    buf = io.StringIO()
    render_terminal(r, Console(file=buf, width=200))
    assert "info, NOISY" in buf.getvalue() and "1 noisy timing(s)" in buf.getvalue()


def test_piped_report_tables_never_fold_a_cell():
    report = _report()
    long_note = "worst expert 3 of 8; " * 20  # 420 characters, far past any terminal
    report.add(Row("gmm", "a check named at length, " * 4, "rel err vs float64", 1.0, 1.0, 1e-2, True, long_note))
    buf = io.StringIO()  # not a terminal, as when the output is piped into a file or a CI log
    render_terminal(report, wide_console(file=buf))
    lines = buf.getvalue().splitlines()
    assert sum(long_note.strip() in line and "a check named at length, " * 4 in line for line in lines) == 1
    body = [line for line in lines if line.startswith("│")]
    assert len(body) == len(report.rows)  # one line per row: nothing wrapped onto a second line


def test_piped_bench_tables_never_fold_a_cell(monkeypatch, tmp_path, capsys):
    code, data = tiny_gmm_run(monkeypatch, tmp_path)
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    headers = [line for line in lines if line.startswith("┃")]
    body = [line for line in lines if line.startswith("│")]
    groups = {(r["case"], r.get("label"), r["dtype"], r["mode"]) for r in data["rows"]}
    summary = {(r["impl"], r["dtype"], r["mode"]) for r in data["rows"]}
    assert len(headers) == 2, headers  # the per-case table and the summary, each header on one line
    assert len(body) == len(groups) + len(summary), body
    for name in ("case", "floor ms", "eager ms (x floor)", "max rel err"):
        assert name in headers[0]
    for case in {r["case"] for r in data["rows"]}:
        assert any(case in line for line in body), case


@pytest.mark.parametrize(
    ("value", "text"),
    [(None, "-"), (0.0, "0"), (3, "3"), (0.0123456, "0.01235"), (1.5e-7, "1.500e-07"), ("x", "x"), (True, "True")],
)
def test_format_value(value, text):
    assert format_value(value) == text


def test_write_report_and_plots(tmp_path):
    from moe_gmm.report import plots

    paths = write_report(_report(), tmp_path)
    assert paths["markdown"].read_text().startswith("# demo")
    assert json.loads(paths["json"].read_text())["title"] == "demo"
    pngs = [
        plots.plot_grad_weight_errors({"gate_up": [0.0, 1e-3, 2e-3]}, [0, 4, 5], 1e-2, tmp_path / "a.png"),
        plots.plot_time_breakdown(
            {"eager": {"gmm": 2.0, "step": 5.0}, "fused": {"gmm": 1.0, "step": 4.0}}, tmp_path / "b.png"
        ),
        plots.plot_tokens_per_expert([3, 0, 5], tmp_path / "c.png"),
        plots.plot_loss_curves({"fused": [3.0, 2.0], "eager": [3.0, 2.1]}, tmp_path / "d.png"),
    ]
    for p in pngs:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
