import json

import pytest
import torch

from moe_gmm.bench import row_stride
from moe_gmm.bench.gmm import GmmCase
from moe_gmm.bench.harness import TimingSettings

CASE = GmmCase(num_experts=4, top_k=2, num_tokens=24, hidden=64, intermediate=32, projection="down")
ONCE = TimingSettings(warmup=0, min_repeats=1, max_repeats=1, min_seconds=0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["EKN", "ENK"])
def test_both_layouts_give_identical_results(dtype, layout):
    case = GmmCase(**{**CASE.__dict__, "weight_layout": layout})
    rows = row_stride.compare_case(case, dtype, ["fwd", "fwdbwd"], pads=[8, 32], backend="cpu", settings=ONCE)
    assert [(r["mode"], r["pad"]) for r in rows] == [("fwd", 8), ("fwd", 32), ("fwdbwd", 8), ("fwdbwd", 32)]
    size = torch.tensor([], dtype=dtype).element_size()
    row_len = 64 if layout == "EKN" else 32  # down: K = intermediate, N = hidden
    for r in rows:
        assert r["identical"] and r["speedup"] > 0 and r["repeats"] == 1
        assert r["weight_row_stride_bytes"] == [row_len * size, (row_len + r["pad"]) * size]
    # one contiguous timing per mode, shared by its pads
    assert rows[0]["contiguous_median_s"] == rows[1]["contiguous_median_s"]


@pytest.mark.parametrize("pads", [[0], [], [8, 8], [True]])
def test_pads_must_be_distinct_positive_ints(pads):
    with pytest.raises(ValueError, match="pads"):
        row_stride.compare_case(CASE, torch.float32, ["fwd"], pads=pads, backend="cpu", settings=ONCE)


def test_main_writes_the_table_and_json(tmp_path, capsys):
    out, md = tmp_path / "rs.json", tmp_path / "rs.md"
    argv = ["--cases", "quick", "--filter", "E256", "--projection", "down", "--dtype", "fp32", "--modes", "fwd"]
    assert row_stride.main([*argv, "--repeats", "1", "--threads", "1", "--out", str(out), "--markdown", str(md)]) == 0
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert row["case"].startswith("E256") and row["identical"] and report["command"].startswith("python -m")
    assert "| E256" in md.read_text() and "speed-up" in capsys.readouterr().out


def test_main_fails_when_the_layouts_disagree(tmp_path, monkeypatch):
    real = row_stride.compare_case

    def disagreeing(*args, **kwargs):
        return [{**r, "identical": False} for r in real(*args, **kwargs)]

    monkeypatch.setattr(row_stride, "compare_case", disagreeing)
    argv = ["--cases", "quick", "--filter", "E256", "--projection", "down", "--dtype", "fp32", "--modes", "fwd"]
    assert row_stride.main([*argv, "--repeats", "1", "--out", str(tmp_path / "rs.json")]) == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pad", "0"], "--pad"),
        (["--pad", "16,x"], "--pad"),
        (["--pad", "16,16"], "--pad"),
        (["--repeats", "0"], "--repeats"),
        (["--filter", "no-such-case"], "no case"),
        (["--backend", "nope"], "--backend"),
    ],
)
def test_bad_arguments_are_named(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        row_stride.main([*argv, "--out", str(tmp_path / "rs.json")])
    assert message in capsys.readouterr().err
