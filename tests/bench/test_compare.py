"""A real tiny run judged against a baseline with rows made faster, slower, missing and extra."""

from __future__ import annotations

import copy
import json

import pytest

from moe_gmm.bench.baseline import load_baseline, row_key, summary_rows
from moe_gmm.bench.compare import RowChange, compare_rows, comparison_text, regressed
from tests.helpers.bench_runs import tiny_gmm_run


def _doctored(rows: list[dict]) -> tuple[list[dict], dict[str, tuple]]:
    """The rows with one made 10^4 x slower in the baseline (the run improved), one 10^4 x faster (the
    run regressed), one dropped (new in the run) and one invented (missing in the run). 10^4: a
    second run's row on a loaded machine cannot move that far."""
    rows = copy.deepcopy(sorted(rows, key=row_key))
    slow, fast, dropped = rows[0], rows[1], rows[2]
    for row, factor in ((slow, 1e4), (fast, 1e-4)):
        for k in ("median_ms", "p20_ms", "p80_ms", "min_ms"):
            row[k] *= factor
    rows.remove(dropped)
    ghost = {**rows[-1], "case": "E1 k1 T1 H1 I1 gate_up"}
    rows.append(ghost)
    keys = {"improved": row_key(slow), "regressed": row_key(fast), "new in run": row_key(dropped)}
    return rows, {**keys, "missing in run": row_key(ghost)}


def test_the_same_run_against_its_doctored_rows(tmp_path, monkeypatch):
    _, run = tiny_gmm_run(monkeypatch, tmp_path)
    rows = summary_rows(run, "gmm")
    base, keys = _doctored(rows)
    changes = compare_rows(base, rows)
    verdicts = {c.key: c.verdict for c in changes}
    for verdict, key in keys.items():
        assert verdicts.pop(key) == verdict
    assert set(verdicts.values()) == {"unchanged"}  # the same measurement on both sides
    assert regressed(changes)
    by_key = {c.key: c for c in changes}
    assert by_key[keys["improved"]].ratio == pytest.approx(1e-4)
    assert by_key[keys["regressed"]].ratio == pytest.approx(1e4)
    assert by_key[keys["missing in run"]].run_ms is None and by_key[keys["new in run"]].baseline_ms is None
    text = comparison_text(changes)
    assert text.startswith("against the baseline: 1 regressed, 1 improved, 1 missing in run, 1 new in run, ")
    assert "| unchanged |" not in text and "| unchanged |" in comparison_text(changes, show_unchanged=True)


def test_runner_compare_classifies_a_second_run(tmp_path, monkeypatch, capsys):
    path = tmp_path / "base.json"
    tiny_gmm_run(monkeypatch, tmp_path, "--baseline-out", str(path))
    data = load_baseline(path)
    data["rows"], keys = _doctored(data["rows"])
    path.write_text(json.dumps(data))
    capsys.readouterr()
    code, _ = tiny_gmm_run(monkeypatch, tmp_path, "--compare", str(path))
    out = capsys.readouterr().out
    assert code == 1  # a regressed row fails the run
    for verdict, key in keys.items():
        assert f"| {verdict} | {' | '.join(key)} |" in out


def test_noise_decides_whether_a_row_changed():
    base = {"suite": "gmm", "case": "c", "impl": "cpu", "dtype": "fp32", "mode": "fwd"}
    b = {**base, "median_ms": 10.0, "p20_ms": 9.0, "p80_ms": 11.0}

    def verdict(median, lo, hi, **kw):
        (change,) = compare_rows([b], [{**base, "median_ms": median, "p20_ms": lo, "p80_ms": hi}], **kw)
        return change.verdict

    assert verdict(12.0, 11.5, 12.5) == "regressed"
    assert verdict(12.0, 10.5, 12.5) == "unchanged"  # the ranges overlap: within the noise
    assert verdict(8.0, 7.5, 8.5) == "improved"
    assert verdict(8.0, 7.5, 9.5) == "unchanged"
    # Without ranges (one repeat each) the medians must differ by more than min_change.
    b.update(p20_ms=10.0, p80_ms=10.0)
    assert verdict(10.3, 10.3, 10.3) == "unchanged"
    assert verdict(10.3, 10.3, 10.3, min_change=0.01) == "regressed"
    with pytest.raises(ValueError, match="min_change must be a number in \\[0, 1\\), got 2"):
        compare_rows([b], [b], min_change=2)


def test_ratio_of_a_one_sided_row_is_none():
    assert RowChange(("gmm", "c", "cpu", "fp32", "fwd"), "missing in run", 1.0, None).ratio is None
