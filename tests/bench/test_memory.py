"""Peak-memory measurement: saved-activation counting, budget parts, a real subprocess, the CLI path."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from moe_gmm.bench import memory, moe_layer
from moe_gmm.bench.machine import Limits
from moe_gmm.bench.memory import (
    layer_budget,
    live_tensor_peak_bytes,
    measure_in_subprocess,
    measure_workload,
    memory_markdown,
    saved_activation_bytes,
    unique_storage_bytes,
)
from moe_gmm.bench.moe_layer import case_set, layer_impls
from moe_gmm.ops import host_cache

LIMITS = Limits(peak_flops={"fp32": 1e11, "bf16": 2e11}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)


def test_saved_activation_bytes_of_sigmoid_matmul():
    x_MK = torch.randn(8, 16, requires_grad=True)
    w_KN = torch.randn(16, 4, requires_grad=True)
    # mm saves x and w (both excluded as params); sigmoid saves its output [8, 4] fp32.
    assert saved_activation_bytes(lambda: torch.sigmoid(x_MK @ w_KN), [x_MK, w_KN]) == 8 * 4 * 4
    # x is not a param here, so its storage counts as a saved activation.
    assert saved_activation_bytes(lambda: torch.sigmoid(x_MK @ w_KN), [w_KN]) == 8 * 4 * 4 + 8 * 16 * 4
    # A transposed view of a param shares its storage: still excluded.
    w_NK = torch.randn(4, 16, requires_grad=True)
    assert saved_activation_bytes(lambda: torch.sigmoid(x_MK @ w_NK.t()), [x_MK, w_NK]) == 8 * 4 * 4


def test_saved_activation_bytes_ignores_a_dropped_branch():
    x = torch.randn(32, requires_grad=True)

    def forward():
        torch.sigmoid(x * 3.0)  # graph branch dropped at once: holds nothing when the forward returns
        return torch.sigmoid(x)

    assert saved_activation_bytes(forward, [x]) == 32 * 4


def test_unique_storage_bytes_counts_views_once_in_full():
    base = torch.zeros(10, 6)
    assert unique_storage_bytes([base, base.t(), base[:2]]) == 10 * 6 * 4
    assert unique_storage_bytes([base[:2]]) == 10 * 6 * 4  # a slice holds its whole storage


@pytest.mark.parametrize("impl_name", ["moe_gmm", "hf_grouped_mm"])
def test_moe_layer_budget_parts_add_up(impl_name):
    (case,) = case_set("tiny")
    (impl,) = [i for i in layer_impls([impl_name]) if i.name == impl_name]
    budget = layer_budget(impl.prepare(case.make_inputs(torch.float32)))
    # moe_gmm hands over transposed views of its expert weights: counted by storage, the same bytes.
    assert budget.weights == case._param_numel() * 4
    assert budget.grads == budget.weights
    assert budget.inputs == 2 * case.num_tokens * case.hidden * 4
    # At least the expert MLP's hidden rows [T k, 2I] are saved (for the down projection's grad).
    assert budget.saved >= case.num_tokens * case.top_k * 2 * case.intermediate * 4
    assert budget.total == budget.weights + budget.grads + budget.saved + budget.inputs


def test_linear_in_a_fresh_process_sees_its_weights():
    m, k, n = 256, 1024, 1024  # w: 4 MiB fp32, well above page noise
    record = measure_in_subprocess("linear", {"rows": m, "inner": k, "cols": n, "dtype": "fp32"}, threads=1)
    assert record["note"] == ""
    assert record["weights_bytes"] == k * n * 4 == record["grads_bytes"]
    assert record["saved_bytes"] == m * n * 4  # sigmoid's output
    assert record["inputs_bytes"] == 2 * m * k * 4
    assert record["peak_bytes"] >= record["weights_bytes"]
    assert record["held_bytes"] > 0 and record["baseline_rss_bytes"] > 0
    assert math.isfinite(record["ratio"]) and record["ratio"] > 0
    assert record["threads"] == 1 and isinstance(record["malloc_env"], dict)
    assert (record["warmup_steps"], record["measured_steps"]) == (memory.WARMUP_STEPS, memory.MEASURED_STEPS)
    # A plain linear layer reaches its steady state in the warm-up: nothing grows after it.
    assert abs(record["drift_bytes"]) < 4 * 1024 * 1024
    # At the end of the backward w, x, dw and dx are alive; at most one [m, n] gradient beside them
    # (sigmoid's output is saved, its gradient transient).
    grads_and_leaves = record["budget_bytes"] - record["saved_bytes"]
    assert grads_and_leaves <= record["tensor_peak_bytes"] <= record["budget_bytes"] + m * n * 4
    assert record["tensor_ratio"] == record["tensor_peak_bytes"] / record["budget_bytes"]


def test_live_tensor_peak_sees_each_tensor_of_a_hand_counted_step():
    m, k, n = 64, 128, 256
    make_job, _ = memory.KINDS["linear"]
    build, grad_out = make_job({"rows": m, "inner": k, "cols": n, "dtype": "fp32"})
    workload = build()
    # Held: w and x. Allocated: the forward's output (saved), sigmoid's input gradient, then dx and
    # dw while that gradient is still referenced: all four at once at the end of mm's backward.
    expected = (k * n + m * k) + (m * n + m * n + m * k + k * n)
    assert live_tensor_peak_bytes(workload, grad_out) // 4 in range(expected - 64, expected + 1)


def test_live_tensor_peak_counts_host_cached_outputs_and_restores_the_cache():
    # Warmed up with the cache on, the layer's weight gradients come from cached storages, which
    # are no allocation: the measure has to see them all the same.
    case = case_set("tiny")[0]
    params = {**case.params(), "num_tokens": 256, "hidden": 512, "intermediate": 256}
    make_job, _ = memory.KINDS["moe_layer"]
    build, grad_out = make_job({"case": params, "dtype": "fp32", "impl": "moe_gmm"})
    workload = build()
    limit = host_cache.limit_bytes()
    step = memory._timed_callable(workload, "fwdbwd", grad_out)
    memory._run_steps(step, 2)
    assert host_cache.stats().storages > 0
    peak = live_tensor_peak_bytes(workload, grad_out)
    budget = layer_budget(workload)
    assert peak >= budget.total - budget.saved
    assert host_cache.limit_bytes() == limit
    memory._run_steps(step, 2)
    assert host_cache.stats().hits > 0  # caching is back on
    host_cache.clear()


def test_step_counts_reach_the_subprocess_and_the_table():
    spec = {"rows": 64, "inner": 64, "cols": 64, "dtype": "fp32"}
    record = measure_in_subprocess("linear", spec, threads=1, warmup_steps=2, measured_steps=1)
    assert (record["warmup_steps"], record["measured_steps"]) == (2, 1)
    text = memory_markdown([{"case": "c", "dtype": "fp32", "impl": "i", **record}])
    assert "1 steps measured after 2" in text and "| drift |" in text


def test_measure_peak_runs_warmup_then_measured_steps():
    calls = []
    make_job, _ = memory.KINDS["linear"]
    # Big enough that the layer's own pages (3 MiB of leaves and grads) dwarf what the rest of the
    # test process frees meanwhile: with an 8 x 8 layer a page handed back elsewhere read as -4 KiB.
    build, grad_out = make_job({"rows": 256, "inner": 512, "cols": 512, "dtype": "fp32"})

    def counting_build():
        workload = build()
        forward = workload.forward
        return dataclasses.replace(workload, forward=lambda: calls.append(1) or forward())

    peak, workload = memory.measure_peak(counting_build, grad_out, warmup_steps=3, measured_steps=2)
    assert len(calls) == 5
    if peak.peak is not None:
        leaves_and_grads = 2 * sum(t.numel() * t.element_size() for t in workload.leaves)
        slack = leaves_and_grads // 2  # allocator and page noise, well under the layer's own bytes
        assert peak.held >= leaves_and_grads - slack  # the grads stay between steps
        assert peak.peak >= peak.held - slack


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup_steps": 0}, ValueError, "warmup_steps must be >= 1"),
        ({"measured_steps": 0}, ValueError, "measured_steps must be >= 1"),
        ({"measured_steps": 1.5}, TypeError, "measured_steps must be an int"),
        ({"warmup_steps": True}, TypeError, "warmup_steps must be an int"),
    ],
)
def test_measure_peak_rejects_bad_step_counts(kwargs, error, match):
    make_job, _ = memory.KINDS["linear"]
    build, grad_out = make_job({"rows": 4, "inner": 4, "cols": 4, "dtype": "fp32"})
    with pytest.raises(error, match=match):
        memory.measure_peak(build, grad_out, **kwargs)


def test_cli_rejects_a_zero_step_count(capsys):
    with pytest.raises(SystemExit):
        memory.main(["linear", '{"rows": 4, "inner": 4, "cols": 4, "dtype": "fp32"}', "--measured-steps", "0"])
    assert "--measured-steps" in capsys.readouterr().err


def test_full_priming_runs_the_same_layer_and_says_so():
    spec = {"rows": 256, "inner": 1024, "cols": 1024, "dtype": "fp32"}
    record = measure_in_subprocess("linear", spec, threads=1, prime="full")
    assert record["prime"] == "full" and record["note"] == ""
    assert record["weights_bytes"] == 1024 * 1024 * 4 and record["peak_bytes"] >= record["weights_bytes"]
    with pytest.raises(ValueError, match="prime"):
        measure_in_subprocess("linear", spec, prime="half")


def test_priming_returns_the_host_cache_memory():
    # A priming step's cached outputs would otherwise be handed to the measured step, unseen.
    case = case_set("tiny")[0]
    spec = {"case": {**case.params(), "num_tokens": 512, "hidden": 1024}, "dtype": "fp32", "impl": "moe_gmm"}
    make_job, _ = memory.KINDS["moe_layer"]
    host_cache.clear()
    memory._prime(make_job(spec))
    assert host_cache.stats().storages == 0


def test_unavailable_reset_reports_no_peak(monkeypatch):
    monkeypatch.setattr(memory, "_reset_high_water_mark", lambda: "peak unavailable: test")
    make_job, _ = memory.KINDS["linear"]
    record = measure_workload(make_job({"rows": 4, "inner": 4, "cols": 4, "dtype": "fp32"}))
    assert record["peak_bytes"] is None and record["ratio"] is None
    assert record["note"] == "peak unavailable: test"
    text = memory_markdown([{"case": "c", "dtype": "fp32", "impl": "i", **record}])
    assert "| - | - |" in text and "peak unavailable: test" in text


def test_bad_kind_and_impl():
    with pytest.raises(ValueError, match="kind"):
        measure_in_subprocess("nope", {})
    make_job, _ = memory.KINDS["moe_layer"]
    with pytest.raises(ValueError, match="impl"):
        make_job({"case": case_set("tiny")[0].params(), "dtype": "fp32", "impl": "nope"})
    with pytest.raises(ValueError, match="dtype"):
        make_job({"case": case_set("tiny")[0].params(), "dtype": "fp8", "impl": "moe_gmm"})
    text = memory_markdown([{"case": "c", "dtype": "fp32", "impl": "i", "error": "boom"}])
    assert "error" in text and "boom" in text


def test_table_of_a_record_from_before_the_tensor_peak():
    record = {"case": "c", "dtype": "fp32", "impl": "i", "ratio": 1.5, "peak_bytes": 3 << 20, "budget_bytes": 2 << 20}
    text = memory_markdown([record])
    assert "| tensor peak | tensor/budget |" in text and "| 1.50 | - | - |" in text


def test_runner_memory_option_writes_json_and_markdown(tmp_path, monkeypatch):
    monkeypatch.setattr(moe_layer, "measure_limits", lambda dtypes, quick=False: LIMITS)  # skip the calibration
    out, md = tmp_path / "moe_layer.json", tmp_path / "moe_layer.md"
    argv = ["--cases", "tiny", "--dtype", "fp32", "--modes", "fwd", "--repeats", "1", "--breakdown-steps", "0"]
    argv += ["--impls", "moe_gmm", "--threads", "1", "--memory", "--no-progress", "--out", str(out)]
    assert moe_layer.main([*argv, "--markdown", str(md)]) == 0
    (record,) = json.loads(out.read_text())["memory"]
    assert (record["case"], record["dtype"], record["impl"]) == ("E4-k2-T8", "fp32", "moe_gmm")
    assert "error" not in record and record["note"] == ""
    parts = ("weights", "grads", "saved", "inputs")
    assert record["budget_bytes"] == sum(record[f"{p}_bytes"] for p in parts) > 0
    assert isinstance(record["peak_bytes"], int) and record["threads"] == 1
    text = md.read_text()
    assert "peak memory of one fwd+bwd step" in text and "peak/budget" in text and "| moe_gmm |" in text
