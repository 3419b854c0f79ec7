"""Peak-memory measurement: saved-activation counting, budget parts, the runner's --memory (a real subprocess)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

pytest.importorskip("transformers")

from moe_gmm.bench import memory, moe_layer
from moe_gmm.bench.harness import Workload
from moe_gmm.bench.layer_cases import case_set, layer_impls
from moe_gmm.bench.machine import Limits
from moe_gmm.bench.memory import (
    layer_budget,
    measure_in_subprocess,
    measure_workload,
    memory_markdown,
    moe_layer_job,
    saved_activation_bytes,
    unique_storage_bytes,
)
from moe_gmm.ops import host_cache

LIMITS = Limits(peak_flops={"fp32": 1e11, "bf16": 2e11}, copy_bandwidth=1e10, gemm_sizes=(64,), copy_mib=1)


def linear_job(m: int, k: int, n: int):
    """``sigmoid(x_MK @ w_KN)``: a layer with nothing to hide, and its upstream gradient."""
    g = torch.Generator().manual_seed(0)
    grad_out = torch.randn(m, n, generator=g)

    def build() -> Workload:
        x_MK = torch.randn(m, k, generator=g).requires_grad_(True)
        w_KN = (torch.randn(k, n, generator=g) * k**-0.5).requires_grad_(True)
        return Workload(forward=lambda: torch.sigmoid(x_MK @ w_KN), leaves=(x_MK, w_KN))

    return build, grad_out


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


def test_measure_peak_runs_warmup_then_measured_steps():
    calls = []
    # Big enough that the layer's own pages (3 MiB of leaves and grads) dwarf what the rest of the
    # test process frees meanwhile: with an 8 x 8 layer a page handed back elsewhere read as -4 KiB.
    build, grad_out = linear_job(256, 512, 512)

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
    build, grad_out = linear_job(4, 4, 4)
    with pytest.raises(error, match=match):
        memory.measure_peak(build, grad_out, **kwargs)


def test_priming_returns_the_host_cache_memory():
    # A priming step's cached outputs would otherwise be handed to the measured step, unseen.
    case = case_set("tiny")[0]
    spec = {"case": {**case.params(), "num_tokens": 512, "hidden": 1024}, "dtype": "fp32", "impl": "moe_gmm"}
    host_cache.clear()
    memory._prime(moe_layer_job(spec))
    assert host_cache.stats().storages == 0


def test_unavailable_reset_reports_no_peak(monkeypatch):
    monkeypatch.setattr(memory, "_reset_high_water_mark", lambda: "peak unavailable: test")
    record = measure_workload(linear_job(4, 4, 4))
    assert record["peak_bytes"] is None and record["ratio"] is None
    assert record["note"] == "peak unavailable: test"
    text = memory_markdown([{"case": "c", "dtype": "fp32", "impl": "i", **record}])
    assert "| - | - |" in text and "peak unavailable: test" in text


def test_bad_impl_and_dtype_fail_before_a_process_starts():
    params = case_set("tiny")[0].params()
    with pytest.raises(ValueError, match="impl must be one of"):
        measure_in_subprocess({"case": params, "dtype": "fp32", "impl": "nope"})
    with pytest.raises(ValueError, match="dtype must be one of"):
        moe_layer_job({"case": params, "dtype": "fp8", "impl": "moe_gmm"})
    text = memory_markdown([{"case": "c", "dtype": "fp32", "impl": "i", "error": "boom"}])
    assert "error" in text and "boom" in text


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
