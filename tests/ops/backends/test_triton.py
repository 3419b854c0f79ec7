"""The triton backend vs the float64 reference and the eager backend.

Without CUDA these run in Triton's CPU interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``); each program costs milliseconds there, so shapes are tiny and tiles are
32 wide where a test needs several tiles per expert. With CUDA the same tests run compiled.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed: the triton backend cannot be tested")

from moe_gmm import grouped_matmul  # noqa: E402
from moe_gmm.ops.backends import get_backend, select_backend  # noqa: E402
from moe_gmm.ops.backends import triton as triton_backend  # noqa: E402
from moe_gmm.testing import (  # noqa: E402
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)

HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
SMALL_TILES = triton_backend.TileConfig(block_m=32, block_n=32, block_k=32)
if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)


def _run(counts, k, n, dtype, *, transposed=False, seed=0):
    """Forward and backward through the public op with backend='triton'; returns everything."""
    x, w, group_list = gmm_inputs(counts, k, n, dtype, device=DEVICE, transposed_weight=transposed, seed=seed)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = grouped_matmul(x, w, group_list, backend="triton")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64).to(y)
    y.backward(dy)
    return x, w, dy, y, x.grad, w.grad


def _check_against_reference(counts, x, w, dy, y, dx, dw):
    limit = tolerance_for(x.dtype).rel
    ref_y = reference_grouped_matmul(x, w, counts)
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, counts, dy)
    assert_rel_close(y.cpu(), ref_y, limit, "y")
    assert_rel_close(dx.cpu(), ref_dx, limit, "dx")
    assert_rel_close(dw.cpu(), ref_dw, limit, "dw")
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.equal(dw[e], torch.zeros_like(dw[e])), f"expert {e} has no rows but a non-zero grad_weight"


# Cases: (counts, K, N). Empty experts first, middle and last; tails of K and N that no tile divides.
CASES = [
    pytest.param([17, 0, 40, 3], 40, 24, id="empty-middle"),
    pytest.param([0, 0, 30, 11, 0], 16, 33, id="empty-ends"),
    pytest.param([64], 64, 16, id="one-expert"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("counts,k,n", CASES)
def test_matches_float64_reference(counts, k, n, dtype):
    x, w, dy, y, dx, dw = _run(counts, k, n, dtype)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    _check_against_reference(counts, x, w, dy, y, dx, dw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_matches_eager_with_transposed_weight(dtype):
    counts, k, n = [9, 0, 26, 5], 24, 40
    x, w, dy, y, dx, dw = _run(counts, k, n, dtype, transposed=True)
    assert w.stride(1) == 1, "the weight under test must be a transposed view"
    x_e, w_e = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y_e = grouped_matmul(x_e, w_e, counts, backend="eager")
    y_e.backward(dy)
    tol = tolerance_for(dtype)
    torch.testing.assert_close(y, y_e, rtol=tol.rtol, atol=tol.atol)
    torch.testing.assert_close(dx, x_e.grad, rtol=tol.rtol, atol=tol.atol)
    torch.testing.assert_close(dw, w_e.grad, rtol=tol.rtol, atol=tol.atol)
    _check_against_reference(counts, x, w, dy, y, dx, dw)


def test_many_tiles_per_expert_every_element_written():
    """Small tiles: several row tiles per expert, ragged last tiles, poisoned output buffers."""
    counts, k, n = [70, 0, 33, 1], 40, 50
    x, w, _ = gmm_inputs(counts, k, n, torch.float32, device=DEVICE, seed=3)
    ends = torch.cumsum(torch.tensor(counts, device=DEVICE), 0)
    y = triton_backend.launch_gmm(x, w, ends, x.new_full((x.shape[0], n), float("nan")), config=SMALL_TILES)
    assert_rel_close(y.cpu(), reference_grouped_matmul(x, w, counts), 1e-5, "y")
    dy = torch.randn(y.shape, dtype=y.dtype, device=DEVICE)
    dx = triton_backend.launch_gmm(dy, w.transpose(1, 2), ends, x.new_full(x.shape, float("nan")), config=SMALL_TILES)
    dw = triton_backend.launch_gmm_wgrad(x, dy, ends, config=SMALL_TILES)
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, counts, dy)
    assert_rel_close(dx.cpu(), ref_dx, 1e-5, "dx")
    assert_rel_close(dw.cpu(), ref_dw, 1e-5, "dw")
    assert torch.equal(dw[1], torch.zeros_like(dw[1]))


def test_strided_operands_and_expanded_grad_output():
    """x a column slice, grad_output an expanded (zero-stride) tensor from ``y.sum()``."""
    counts, k, n = [5, 12, 0, 7], 16, 20
    x_wide, w, _ = gmm_inputs(counts, 2 * k, n, torch.float32, device=DEVICE, seed=4)
    x = x_wide[:, ::2].detach().requires_grad_(True)
    w = w[:, :k].detach().requires_grad_(True)
    grouped_matmul(x, w, counts, backend="triton").sum().backward()
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, counts, torch.ones(x.shape[0], n, dtype=torch.float64))
    assert_rel_close(x.grad.cpu(), ref_dx, 1e-5, "dx")
    assert_rel_close(w.grad.cpu(), ref_dw, 1e-5, "dw")


def test_zero_rows_and_cumsum_group_list():
    x, w, _ = gmm_inputs([0, 0], 16, 16, torch.float32, device=DEVICE)
    w.requires_grad_(True)
    y = grouped_matmul(x, w, [0, 0], backend="triton")
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros_like(w))
    x, w, _ = gmm_inputs([3, 0, 5], 16, 16, torch.float32, device=DEVICE)
    ends = torch.tensor([3, 3, 8], dtype=torch.int32, device=DEVICE)
    y = grouped_matmul(x, w, ends, group_list_type="cumsum", backend="triton")
    assert_rel_close(y.cpu(), reference_grouped_matmul(x, w, [3, 0, 5]), 1e-5, "y")


@settings(max_examples=6, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    k=st.integers(1, 48),
    n=st.integers(1, 48),
    transposed=st.booleans(),
)
def test_random_shapes(counts, k, n, transposed):
    x, w, dy, y, dx, dw = _run(counts, k, n, torch.float32, transposed=transposed)
    _check_against_reference(counts, x, w, dy, y, dx, dw)


def test_backend_declaration_and_selection():
    backend = get_backend("triton")
    assert backend.unavailable_reason() is None
    assert "cuda" in backend.devices
    x, w, _ = gmm_inputs([2, 2], 16, 16, torch.float32, device=DEVICE)
    assert select_backend(x, w, "triton") is backend
    if not HAS_CUDA:
        assert backend.devices == {"cpu", "cuda"}, "CPU is declared only under the interpreter"
        assert select_backend(x, w, "auto").name != "triton", "auto must never pick the interpreter"


def test_unavailable_reason_without_interpreter_or_cuda(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = triton_backend._unavailable_reason()
    assert reason is not None and "TRITON_INTERPRET" in reason


@pytest.mark.skipif(not HAS_CUDA, reason="native bf16 tl.dot needs a CUDA device (the interpreter upcasts bf16)")
@pytest.mark.parametrize("transposed", [False, True])
def test_bf16_native_on_gpu(transposed):
    counts = [300, 0, 129, 1000, 7]
    x, w, dy, y, dx, dw = _run(counts, 512, 384, torch.bfloat16, transposed=transposed)
    _check_against_reference(counts, x, w, dy, y, dx, dw)
    x_e, w_e = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    y_e = grouped_matmul(x_e, w_e, counts, backend="eager")
    torch.testing.assert_close(y, y_e, rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not HAS_CUDA, reason="host-sync detection needs a CUDA device")
def test_no_host_sync_forward_and_backward():
    """Work items come from the device-side group ends: no device-to-host copy anywhere."""
    x, w, group_list = gmm_inputs([40, 0, 17, 64], 64, 48, torch.bfloat16, device="cuda")
    ends = torch.cumsum(group_list.cuda(), 0)
    x.requires_grad_(True)
    w.requires_grad_(True)
    dy = torch.randn(x.shape[0], 48, device="cuda", dtype=torch.bfloat16)
    grouped_matmul(x, w, ends, group_list_type="cumsum", backend="triton", validate=False)  # compile first
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = grouped_matmul(x, w, ends, group_list_type="cumsum", backend="triton", validate=False)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
