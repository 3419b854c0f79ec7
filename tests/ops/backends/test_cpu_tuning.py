"""The ``cpu`` backend's thresholds as one value (``tuning``): defaults, validation, and the tuning
in force for a block."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from moe_gmm.ops.backends import cpu
from moe_gmm.ops.backends.cpu import tuning
from moe_gmm.testing import gmm_inputs


def test_default_follows_the_cpu_vendor():
    assert tuning.DEFAULT_TUNING == cpu.CpuTuning.for_cpu(tuning.MKL_GENERIC_CODE)
    assert cpu.current_tuning() == tuning.DEFAULT_TUNING
    intel, amd = cpu.CpuTuning.for_cpu(False), cpu.CpuTuning.for_cpu(True)
    # Where MKL runs its generic code the float32 kernels take every expert size; nothing else differs.
    assert (amd.avx512_grad_weight_max_rows, amd.avx512_nn_max_rows, amd.avx512_nt_max_rows) == (4096,) * 3
    assert intel.avx512_nt_max_rows < intel.avx512_nn_max_rows
    differing = {f.name for f in dataclasses.fields(cpu.CpuTuning) if getattr(intel, f.name) != getattr(amd, f.name)}
    assert differing == {"avx512_grad_weight_max_rows", "avx512_nn_max_rows", "avx512_nt_max_rows"}


def test_use_tuning_is_in_force_for_the_block_only():
    before = cpu.current_tuning()
    with cpu.use_tuning(min_threads=1) as outer:
        assert cpu.current_tuning() is outer and outer.min_threads == 1
        with cpu.use_tuning(cpu.CpuTuning.for_cpu(True), use_amx=False) as inner:
            assert cpu.current_tuning() is inner
            assert inner.min_threads == cpu.CpuTuning().min_threads and not inner.use_amx
        assert cpu.current_tuning() is outer
        with pytest.raises(RuntimeError, match="inside"), cpu.use_tuning(padded_chunk_bytes=1):
            raise RuntimeError("inside")
        assert cpu.current_tuning() is outer
    assert cpu.current_tuning() is before


def test_use_tuning_reaches_other_threads():
    # autograd may run a pass on another thread than the one that entered the block
    seen = []
    with cpu.use_tuning(use_experts_mm=False) as chosen:
        worker = threading.Thread(target=lambda: seen.append(cpu.current_tuning()))
        worker.start()
        worker.join()
    assert seen == [chosen]


def test_the_backend_reads_the_tuning_at_every_call():
    # the same call, one GEMM per expert in one native call or not, by the tuning in force alone
    from moe_gmm.ops.backends.cpu import kernels

    x, w, _ = gmm_inputs([30] * 8, 32, 64, torch.bfloat16)
    ends = torch.tensor([30] * 8).cumsum(0)
    off = {"use_amx": False, "use_avx512_bf16": False}
    with cpu.use_tuning(**off):
        native_result = kernels.experts_product(x, w, ends)
    with cpu.use_tuning(**off, use_experts_mm=False):
        assert kernels.experts_product(x, w, ends) is None
        looped = cpu.forward(x, w, ends)
    if native_result is not None:
        torch.testing.assert_close(native_result, looped)


def test_tuning_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        cpu.current_tuning().min_threads = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("changes", "error", "message"),
    [
        ({"min_threads": 1.5}, TypeError, r"CpuTuning.min_threads: expected int, got float 1.5"),
        ({"use_amx": 1}, TypeError, r"CpuTuning.use_amx: expected bool, got int 1"),
        ({"max_rows": True}, TypeError, r"CpuTuning.max_rows: expected int, got bool True"),
        ({"max_pad_waste": "1.5"}, TypeError, r"CpuTuning.max_pad_waste: expected float, got str"),
        ({"max_pad_waste": float("nan")}, ValueError, r"CpuTuning.max_pad_waste: expected a number, got nan"),
        ({"grad_weight_row_multiple": 0}, ValueError, r"grad_weight_row_multiple: expected >= 1, got 0"),
    ],
)
def test_bad_fields_are_refused(changes, error, message):
    with pytest.raises(error, match=message):
        cpu.CpuTuning(**changes)
    with pytest.raises(error, match=message), cpu.use_tuning(**changes):
        pass
    assert cpu.current_tuning() == tuning.DEFAULT_TUNING


def test_bad_use_tuning_and_plan_arguments_are_refused():
    with pytest.raises(TypeError, match=r"unknown CpuTuning fields \['MIN_THREADS'\]"), cpu.use_tuning(MIN_THREADS=1):
        pass
    with pytest.raises(TypeError, match="base must be a CpuTuning or None, got dict"), cpu.use_tuning({}):
        pass
    with pytest.raises(TypeError, match="plan: tuning must be a CpuTuning or None, got str"):
        cpu.plan([0, 4], tuning="fast")  # type: ignore[arg-type]
    assert cpu.current_tuning() == tuning.DEFAULT_TUNING
