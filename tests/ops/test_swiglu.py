"""swiglu vs the float64 reference, its gate-first convention, backward and bad inputs."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm import swiglu
from moe_gmm.testing import assert_rel_close, reference_swiglu, tolerance_for

# Every test runs on the native CPU kernels and on the composed torch ops (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("glue_path")


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16), ids=str)
@pytest.mark.parametrize("shape", [(7, 12), (2, 3, 10), (0, 6)])
def test_forward_backward_vs_reference(shape, dtype):
    g = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_(True)
    y = swiglu(x)
    assert y.shape == (*shape[:-1], shape[-1] // 2) and y.dtype == dtype
    x64 = x.detach().double().requires_grad_(True)
    ref = reference_swiglu(x64)
    limit = tolerance_for(dtype).rel
    assert_rel_close(y, ref, limit, "swiglu")
    dy = torch.randn(y.shape, generator=g).to(dtype)
    y.backward(dy)
    ref.backward(dy.double())
    assert x.grad.dtype == dtype
    assert_rel_close(x.grad, x64.grad, limit, "d x")


def test_gate_is_first_half_matching_hf_chunk():
    # Hugging Face experts: gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1), with
    # gate_up_proj [E, 2I, H]; our [E, H, 2I] is its transpose, so both feed the same [.., 2I].
    g = torch.Generator().manual_seed(1)
    hidden, inter = 6, 4
    x = torch.randn(5, hidden, generator=g)
    w_hf_2IH = torch.randn(2 * inter, hidden, generator=g)
    gate, up = F.linear(x, w_hf_2IH).chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = swiglu(x @ w_hf_2IH.transpose(0, 1))
    assert_rel_close(got, expected, 1e-6, "hf convention")
    swapped = F.silu(up) * gate
    assert (got - swapped).abs().max() > 1e-2  # the halves are not interchangeable


def test_gradcheck_and_opcheck():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(swiglu, (x,))
    torch.library.opcheck(torch.ops.moe_gmm.swiglu.default, (torch.randn(3, 8, requires_grad=True),))


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(0, 9), inter=st.integers(1, 9), seed=st.integers(0, 100))
def test_random_shapes(rows, inter, seed):
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(seed))
    assert_rel_close(swiglu(x), reference_swiglu(x), 1e-6, "swiglu")


def test_bad_inputs():
    with pytest.raises(ValueError, match="even last dimension"):
        swiglu(torch.randn(3, 5))
    with pytest.raises(ValueError, match="x must"):
        swiglu(torch.tensor(1.0))
    with pytest.raises(TypeError, match="floating"):
        swiglu(torch.ones(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        swiglu([1.0, 2.0])


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("shape", [(23, 8), (3, 5, 8), (8,)])
def test_chunked_rows_match_reference(monkeypatch, shape, dtype):
    # Real activations span many chunks; shrink the chunk to 3 rows so these small ones do too,
    # with a shorter last chunk.
    swiglu_module = importlib.import_module("moe_gmm.ops.swiglu")  # the package exports the function
    monkeypatch.setattr(swiglu_module, "_CHUNK_BYTES", 3 * 4 * shape[-1])
    g = torch.Generator().manual_seed(2)
    x = (3 * torch.randn(shape, generator=g)).to(dtype).requires_grad_(True)
    y = swiglu(x)
    x64 = x.detach().double().requires_grad_(True)
    ref = reference_swiglu(x64)
    limit = tolerance_for(dtype).rel
    assert_rel_close(y, ref, limit, "swiglu")
    dy = torch.randn((*y.shape[:-1], 1), generator=g).to(dtype).expand_as(y)  # zero-stride gradient
    y.backward(dy)
    ref.backward(dy.double())
    assert_rel_close(x.grad, x64.grad, limit, "d x")


def test_double_backward_matches_the_float64_reference():
    # A backward with create_graph=True (gradient penalties, Hessian-vector products) must build a
    # graph of its own instead of failing inside autograd.
    g = torch.Generator().manual_seed(3)
    x64 = torch.randn(5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(swiglu, (x64,))
    x = x64.detach().float().requires_grad_(True)
    (dx,) = torch.autograd.grad(swiglu(x).square().sum(), x, create_graph=True)
    (hvp,) = torch.autograd.grad(dx.sum(), x)
    (dx_ref,) = torch.autograd.grad(reference_swiglu(x64).square().sum(), x64, create_graph=True)
    (hvp_ref,) = torch.autograd.grad(dx_ref.sum(), x64)
    assert_rel_close(hvp, hvp_ref, tolerance_for(torch.float32).rel, "second derivative")
