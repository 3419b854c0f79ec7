"""The A/B pass benchmark: real timings on a small case set, and the comparison's arithmetic."""

import json
import math

import pytest
import torch

from moe_gmm.bench.passes import PASSES, compare_runs, comparison_markdown, main, time_passes


def _run(dtype, **cases):
    return {"dtype": dtype, "cases": {name: dict(zip(PASSES, times, strict=True)) for name, times in cases.items()}}


def test_time_passes_times_every_pass_of_every_case():
    result = time_passes("quick", torch.float32, repeats=1, name_filter="E8")
    assert result["dtype"] == "fp32" and result["cases"]
    for passes in result["cases"].values():
        assert set(passes) == set(PASSES)
        assert all(0 < s < 60 for s in passes.values())


def test_compare_keeps_each_sides_best_time_over_its_runs():
    base = [_run("bf16", a=(4.0, 2.0, 1.0)), _run("bf16", a=(2.0, 3.0, 1.0))]
    new = [_run("bf16", a=(1.0, 1.0, 2.0))]
    result = compare_runs(base, new)
    (row,) = result["rows"]
    assert row["forward"]["speedup"] == pytest.approx(2.0)  # best base 2.0 against 1.0
    assert row["grad_input"]["speedup"] == pytest.approx(2.0)
    assert row["grad_weight"]["speedup"] == pytest.approx(0.5)
    assert row["total"]["speedup"] == pytest.approx(5.0 / 4.0)  # sums of the best per pass: 2+2+1 over 1+1+2
    assert result["geomean"]["forward"] == pytest.approx(2.0)
    assert "| a | 2000.0 -> 1000.0 (2.00x)" in comparison_markdown(result)


def test_compare_geomean_over_cases_and_only_shared_cases():
    base = [_run("fp32", a=(4.0, 1.0, 1.0), b=(1.0, 1.0, 1.0), only_base=(1.0, 1.0, 1.0))]
    new = [_run("fp32", a=(1.0, 1.0, 1.0), b=(4.0, 1.0, 1.0))]
    result = compare_runs(base, new)
    assert [r["case"] for r in result["rows"]] == ["a", "b"]
    assert result["geomean"]["forward"] == pytest.approx(math.sqrt(4.0 * 0.25))


@pytest.mark.parametrize(
    ("base", "new", "message"),
    [
        ([], [_run("bf16", a=(1, 1, 1))], "at least one run"),
        ([_run("bf16", a=(1, 1, 1))], [_run("fp32", a=(1, 1, 1))], "different dtypes"),
        ([_run("bf16", a=(1, 1, 1))], [_run("bf16", b=(1, 1, 1))], "no case"),
    ],
)
def test_compare_rejects_runs_that_do_not_compare(base, new, message):
    with pytest.raises(ValueError, match=message):
        compare_runs(base, new)


def test_command_line_times_and_compares(tmp_path, capsys):
    runs = []
    for side in ("base", "new"):
        out = tmp_path / f"{side}.json"
        assert (
            main(["time", "--cases", "quick", "--filter", "E8", "--dtype", "fp32", "--repeats", "1", "--out", str(out)])
            == 0
        )
        runs.append(str(out))
        assert json.loads(out.read_text())["cases"]
    md = tmp_path / "ab.md"
    assert main(["compare", "--base", runs[0], "--new", runs[1], "--markdown", str(md)]) == 0
    assert "geomean" in md.read_text() and "geomean" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["compare", "--base", runs[0]])  # no new runs
