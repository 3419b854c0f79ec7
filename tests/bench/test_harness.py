"""The benchmark harness's logic on tiny cases: statistics, rows, errors, JSON, tables. No timing asserts."""

from __future__ import annotations

import json
import math

import pytest
import torch

from moe_gmm.bench.gmm import GmmCase, gmm_impls
from moe_gmm.bench.harness import (
    Impl,
    TimingSettings,
    Unsupported,
    Workload,
    case_rate_note,
    run_benchmark,
    summarize,
    time_interleaved,
    timing_from_samples,
)
from moe_gmm.bench.runner import restores_threads, set_threads
from moe_gmm.bench.machine import (
    CPU_BACKEND,
    TORCH_MM,
    CopyBandwidthProbe,
    GemmRateProbe,
    Limits,
    describe_machine,
    gemm_rate_probes,
    roofline_floor,
)
from moe_gmm.bench.table import markdown_report, print_report

FAST = TimingSettings(warmup=1, min_repeats=2, max_repeats=2, min_seconds=0.0)
# Made-up limits: the harness logic does not depend on their values.
LIMITS = Limits(peak_flops={"fp32": 1e11, "bf16": 2e11}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)
TINY = GmmCase(num_experts=4, top_k=2, num_tokens=6, hidden=8, intermediate=4, projection="gate_up")


def test_timing_statistics_median_and_percentiles():
    t = timing_from_samples([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (t.median_s, t.repeats) == (3.0, 5)
    assert t.p20_s == pytest.approx(1.8)  # linear interpolation between 1.0 and 2.0
    assert t.p80_s == pytest.approx(4.2)
    assert timing_from_samples([2.0]).p20_s == 2.0
    with pytest.raises(ValueError, match="samples"):
        timing_from_samples([])


def test_time_interleaved_runs_every_callable_warmup_plus_repeats():
    calls = {"a": 0, "b": 0}
    order = []

    def make(name):
        def fn():
            calls[name] += 1
            order.append(name)

        return fn

    settings = TimingSettings(warmup=2, min_repeats=3, max_repeats=3, min_seconds=0.0)
    timings = time_interleaved({"a": make("a"), "b": make("b")}, settings)
    assert calls == {"a": 5, "b": 5}
    assert timings["a"].repeats == timings["b"].repeats == 3
    # Warm-up a a b b, then rounds rotate the starting implementation: a b, b a, a b.
    assert order[4:] == ["a", "b", "b", "a", "a", "b"]


def test_roofline_floor_picks_the_binding_limit():
    s, bound = roofline_floor(1e11, 1.0, torch.float32, LIMITS)
    assert (s, bound) == (1.0, "compute")
    s, bound = roofline_floor(1.0, 1e10, torch.float32, LIMITS)
    assert (s, bound) == (1.0, "memory")
    with pytest.raises(KeyError, match="fp16"):
        roofline_floor(1.0, 1.0, torch.float16, LIMITS)


def _report(impls, dtypes=(torch.float32,), modes=("fwd", "bwd", "fwdbwd"), **probes):
    return run_benchmark(
        [TINY],
        impls,
        dtypes=list(dtypes),
        modes=list(modes),
        limits=LIMITS,
        machine=describe_machine(),
        settings=FAST,
        reference="eager",
        primary="torch",
        title="tiny",
        **probes,
    )


def test_run_benchmark_rows_errors_and_speedups():
    report = _report(gmm_impls(), dtypes=(torch.float32, torch.bfloat16))
    names = [i.name for i in gmm_impls()]
    assert len(report.rows) == 2 * 3 * len(names)
    for row in report.rows:
        assert row["median_s"] > 0 and row["p20_s"] <= row["median_s"] <= row["p80_s"]
        assert row["x_floor"] == pytest.approx(row["median_s"] / row["floor_s"])
        if row["impl"] == "eager":
            assert row["speedup_vs_reference"] == 1.0
            assert row["rel_err"] == 0.0
        elif row["impl"] == "dense":
            assert row["rel_err"] is None  # a stand-in with other outputs: not compared
        else:
            limit = 1e-5 if row["dtype"] == "fp32" else 1e-2
            assert row["rel_err"] < limit
        # fwd rows compare the output only; bwd and fwdbwd also the two gradients.
        if row["rel_err_parts"] is not None:
            expected = {"out"} if row["mode"] == "fwd" else {"out", "grad0", "grad1"}
            assert set(row["rel_err_parts"]) == expected


def test_wrong_implementation_shows_in_the_error_column():
    def prepare(inp):
        return Workload(
            # Right shape, differentiable in both leaves, wrong values.
            forward=lambda: torch.ones(inp.x_MK.shape[0], inp.w_EKN.shape[2]) * inp.x_MK.sum() * inp.w_EKN.sum(),
            leaves=(inp.x_MK, inp.w_EKN),
        )

    report = _report([*gmm_impls(["torch"]), Impl(name="broken", prepare=prepare)], modes=("fwd",))
    broken = [r for r in report.rows if r["impl"] == "broken"]
    assert broken and all(r["rel_err"] > 0.1 for r in broken)


def test_unsupported_impl_is_skipped_with_reason():
    def prepare(inp):
        raise Unsupported("needs a GPU")

    report = _report([*gmm_impls(["torch"]), Impl(name="gpu_only", prepare=prepare)], modes=("fwd",))
    row = next(r for r in report.rows if r["impl"] == "gpu_only")
    assert row["median_s"] is None and row["skipped"] == "needs a GPU"
    assert all(s["impl"] != "gpu_only" for s in summarize(report.rows, "eager"))


def test_run_benchmark_rejects_bad_arguments():
    with pytest.raises(ValueError, match="modes"):
        _report(gmm_impls(), modes=("forward",))
    with pytest.raises(ValueError, match="impls may not be named"):
        _report([*gmm_impls(), Impl(name="(gemm rate probe)", prepare=lambda inputs: None)])
    with pytest.raises(ValueError, match="reference"):
        _report(gmm_impls(["torch"])[1:])


def test_summary_json_and_tables(tmp_path):
    report = _report(gmm_impls(), modes=("fwd", "fwdbwd"))
    summary = summarize(report.rows, "eager")
    assert {(s["mode"], s["impl"]) for s in summary} >= {("fwd", "eager"), ("fwdbwd", "torch")}
    for s in summary:
        assert s["worst_x_floor"] >= s["geomean_x_floor"] * (1 - 1e-9)
        assert math.isfinite(s["geomean_speedup_vs_reference"])
    path = report.write_json(tmp_path / "out" / "r.json")
    data = json.loads(path.read_text())
    assert data["machine"]["torch_version"] == torch.__version__
    assert data["limits"]["copy_bandwidth"] == 1e10
    assert len(data["rows"]) == len(report.rows) and data["summary"]
    md = markdown_report(report)
    assert "| case |" in md and "torch vs eager" in md and "E4 k2 T6" in md
    from rich.console import Console

    console = Console(record=True, width=200)
    print_report(report, console)
    assert "summary" in console.export_text()


def test_set_limits_recomputes_floors_and_merge_takes_the_better():
    report = _report(gmm_impls(["torch"]), modes=("fwd",))
    faster = Limits(peak_flops={"fp32": 1e12, "bf16": 2e12}, copy_bandwidth=1e11, gemm_sizes=(64,), copy_mib=1)
    merged = LIMITS.merged(faster)
    assert merged.peak_flops == {"fp32": 1e12, "bf16": 2e12} and merged.copy_bandwidth == 1e11
    before = {r["impl"]: r["x_floor"] for r in report.rows}
    report.set_limits(merged)
    for row in report.rows:
        assert row["x_floor"] == pytest.approx(before[row["impl"]] * 10)  # both limits 10x higher


def test_bandwidth_measured_next_to_each_case_sets_its_memory_floor():
    report = _report(gmm_impls(["torch"]), modes=("fwd", "fwdbwd"), bandwidth_probe=CopyBandwidthProbe(mib=4))
    for row in report.rows:
        assert row["copy_bandwidth"] > 0 and row["copy_bandwidth"] != LIMITS.copy_bandwidth
        compute_s = row["flops"] / LIMITS.peak_flops["fp32"]
        memory_s = row["min_bytes"] / row["copy_bandwidth"]
        assert row["floor_s"] == pytest.approx(max(compute_s, memory_s))
        assert row["bound"] == ("compute" if compute_s >= memory_s else "memory")
    own = {(r["mode"], r["impl"]): r["copy_bandwidth"] for r in report.rows}
    faster = Limits(peak_flops={"fp32": 1e12, "bf16": 2e12}, copy_bandwidth=1e15, gemm_sizes=(64,), copy_mib=1)
    report.set_limits(faster)  # the run's limits change the compute floor, not a row's own bandwidth
    for row in report.rows:
        assert row["copy_bandwidth"] == own[(row["mode"], row["impl"])]
        compute_s = row["flops"] / 1e12
        assert row["floor_s"] == pytest.approx(max(compute_s, row["min_bytes"] / row["copy_bandwidth"]))


def test_gemm_rate_probe_measures_its_named_gemm():
    for source in (TORCH_MM, CPU_BACKEND):
        probe = GemmRateProbe(torch.float32, source, n=64)
        assert math.isfinite(probe.measure(repeats=1)) and probe.measure() > 0
    with pytest.raises(ValueError, match="source"):
        GemmRateProbe(torch.float32, "numpy", n=64)


def test_rate_measured_in_each_case_s_rounds_gives_a_second_ratio():
    probe = GemmRateProbe(torch.float32, n=64)
    calls = []
    gemm = probe.run
    probe.run = lambda: calls.append(gemm())
    report = _report(
        gmm_impls(["torch"]),
        dtypes=(torch.float32, torch.bfloat16),
        modes=("fwd", "fwdbwd"),
        rate_probes={"fp32": probe},  # none for bf16: its rows keep the run's floor alone
    )
    assert len(calls) == 2 * (FAST.warmup + FAST.max_repeats)  # in every round of both fp32 modes
    fp32 = [r for r in report.rows if r["dtype"] == "fp32"]
    for row in fp32:
        assert row["case_gemm_rate"] > 0
        memory_s = row["min_bytes"] / LIMITS.copy_bandwidth
        assert row["case_floor_s"] == pytest.approx(max(row["flops"] / row["case_gemm_rate"], memory_s))
        assert row["x_case_floor"] == pytest.approx(row["median_s"] / row["case_floor_s"])
        # The run's ratio still uses the run's peak.
        assert row["floor_s"] == pytest.approx(max(row["flops"] / LIMITS.peak_flops["fp32"], memory_s))
    rates = {(r["mode"], r["impl"]): r["case_gemm_rate"] for r in fp32}
    assert len({rates[("fwd", i)] for i in ("eager", "torch")}) == 1  # one measurement per case and mode
    for row in report.rows:
        if row["dtype"] == "bf16":
            assert "case_gemm_rate" not in row and "x_case_floor" not in row
    before = {(r["mode"], r["impl"]): r["x_case_floor"] for r in fp32}
    faster = Limits(peak_flops={"fp32": 1e13, "bf16": 2e13}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)
    report.set_limits(faster)  # the run's peak moves x_floor, not the ratio at the case's own rate
    for row in fp32:
        assert row["x_case_floor"] == pytest.approx(before[(row["mode"], row["impl"])])
        assert row["floor_s"] == pytest.approx(max(row["flops"] / 1e13, row["min_bytes"] / 1e10))
    summary = {(s["dtype"], s["mode"], s["impl"]): s for s in summarize(report.rows, "eager")}
    cpu_fwd = summary[("fp32", "fwd", "torch")]
    assert cpu_fwd["worst_x_case_floor"] == pytest.approx(before[("fwd", "torch")])
    assert "geomean_x_case_floor" not in summary[("bf16", "fwd", "torch")]
    md = markdown_report(report)
    assert "GEMM here GFLOP/s (of peak)" in md and "torch x floor at the rate here" in md
    assert f"{before[('fwd', 'torch')]:.2f}x" in md


def test_probes_time_the_gemm_that_set_each_peak():
    limits = Limits(
        peak_flops={"fp32": 1e11, "bf16": 2e11},
        copy_bandwidth=1e10,
        gemm_sizes=(32, 48),
        copy_mib=1,
        peak_sources={"fp32": CPU_BACKEND},
    )
    probes = gemm_rate_probes([torch.float32, torch.bfloat16], limits)
    assert (probes["fp32"].source, probes["bf16"].source) == (CPU_BACKEND, TORCH_MM)
    assert probes["fp32"].n == probes["bf16"].n == 32
    rows = [{"dtype": "fp32", "case_gemm_rate": 5e10}, {"dtype": "fp32", "case_gemm_rate": 1e11}, {"dtype": "bf16"}]
    assert "fp32 50%-100% of the peak" in case_rate_note(rows, limits)
    assert case_rate_note([{"dtype": "bf16"}], limits) == "compute floors: the run's peak GEMM rate"


def test_runner_entry_points_hand_back_the_thread_count():
    """A runner called in-process restores the caller's thread count, on return and on error alike."""
    before = torch.get_num_threads()
    other = 2 if before == 1 else 1

    @restores_threads
    def main(fail: bool) -> int:
        set_threads(other)
        assert torch.get_num_threads() == other
        if fail:
            raise SystemExit("failed after --threads")
        return 0

    assert main(False) == 0
    assert torch.get_num_threads() == before
    with pytest.raises(SystemExit, match="failed after"):
        main(True)
    assert torch.get_num_threads() == before
    with pytest.raises(SystemExit, match="--threads must be >= 1, got 0"):
        set_threads(0)
    assert torch.get_num_threads() == before
