import time

import pytest
import torch

from moe_gmm.bench import machine
from moe_gmm.bench.machine import CPU_BACKEND, TORCH_MM, Limits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_every_peak_candidate_computes_the_product(dtype):
    a = torch.randn(96, 96).to(dtype)
    b = torch.randn(96, 96).to(dtype)
    gemms = machine._square_gemms(a, b)
    assert set(gemms) == {TORCH_MM, CPU_BACKEND}
    want = a.double() @ b.double()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for name, gemm in gemms.items():
        got = gemm()  # torch.mm returns its preallocated output, the backend a new tensor
        err = (got.double() - want).abs().max() / want.abs().max()
        assert err < tol, (name, float(err))


def test_peak_is_the_fastest_gemm_and_names_it(monkeypatch):
    def gemms(a, b):
        return {"slow": lambda: time.sleep(0.02), "fast": lambda: time.sleep(0.002)}

    monkeypatch.setattr(machine, "_square_gemms", gemms)
    rate, source = machine.measure_peak_gemm(torch.float32, sizes=(8,), repeats=2)
    assert source == "fast"
    assert 2 * 8**3 / 0.02 < rate <= 2 * 8**3 / 0.002


def test_merged_limits_keep_the_source_of_the_higher_peak():
    before = Limits({"fp32": 2e11, "bf16": 9e11}, 4e10, (64,), 1, peak_sources={"fp32": TORCH_MM, "bf16": TORCH_MM})
    after = Limits(
        {"fp32": 4e11, "bf16": 8e11}, 5e10, (64,), 1, peak_sources={"fp32": CPU_BACKEND, "bf16": CPU_BACKEND}
    )
    merged = before.merged(after)
    assert merged.peak_flops == {"fp32": 4e11, "bf16": 9e11}
    assert merged.peak_sources == {"fp32": CPU_BACKEND, "bf16": TORCH_MM}


def test_measured_limits_name_a_source_for_every_dtype():
    limits = machine.measure_limits((torch.float32, torch.bfloat16), quick=True)
    assert set(limits.peak_sources) == {"fp32", "bf16"}
    assert set(limits.peak_sources.values()) <= {TORCH_MM, CPU_BACKEND}
    assert all(rate > 0 for rate in limits.peak_flops.values())
