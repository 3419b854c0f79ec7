"""The backend interface's run_* wrappers: empty problems answered without a kernel, results checked."""

from __future__ import annotations

import pytest
import torch

import moe_gmm
from moe_gmm.ops.backends import (
    GmmBackend,
    available_backends,
    eager,
    get_backend,
    register_backend,
    unregister_backend,
)
from moe_gmm.testing import gmm_inputs, reference_grouped_matmul, reference_grouped_matmul_grads

# None is the default choice (auto); every backend that runs on CPU here is named too.
CPU_BACKENDS = (None, *(n for n in available_backends() if "cpu" in get_backend(n).devices))

# (counts per expert, K, N): every dimension of the product that can be 0, with empty experts.
EMPTY_SHAPES = {
    "N0": ([2, 0, 3], 8, 0),
    "K0": ([2, 0, 3], 0, 4),
    "M0": ([0, 0, 0], 8, 4),
    "all0": ([0, 0], 0, 0),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", sorted(EMPTY_SHAPES))
def test_empty_problems_forward_and_backward(backend, dtype, shape):
    counts, k, n = EMPTY_SHAPES[shape]
    x, w, group_list = gmm_inputs(counts, k, n, dtype)
    if backend is not None and dtype not in get_backend(backend).dtypes:
        pytest.skip(f"backend {backend} does not declare {dtype}")
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = moe_gmm.grouped_matmul(x, w, group_list, backend=backend)
    assert y.shape == (sum(counts), n) and y.dtype == dtype
    assert torch.equal(y.double(), reference_grouped_matmul(x, w, counts))  # empty, or exact zeros for K = 0
    dy = torch.ones_like(y)
    y.backward(dy)
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, counts, dy)
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    assert torch.equal(x.grad.double(), ref_dx) and torch.equal(w.grad.double(), ref_dw)


def _backend(name: str, **overrides) -> GmmBackend:
    fns = {"forward": eager.forward, "grad_input": eager.grad_input, "grad_weight": eager.grad_weight, **overrides}
    return GmmBackend(name=name, devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), **fns)


BAD_BACKENDS = {
    "short_rows": ({"forward": lambda x, w, e: eager.forward(x, w, e)[:-1]}, "forward", r"shape \(5, 4\)"),
    "wrong_dtype": ({"forward": lambda x, w, e: eager.forward(x, w, e).double()}, "forward", "float64 tensor"),
    "not_a_tensor": ({"forward": lambda x, w, e: eager.forward(x, w, e).tolist()}, "forward", "list, expected"),
    "bad_grad_input": ({"grad_input": lambda dy, w, e: eager.grad_input(dy, w, e).t()}, "grad_input", r"\(8, 6\)"),
    "bad_grad_weight": (
        {"grad_weight": lambda x, dy, e: eager.grad_weight(x, dy, e)[:, :, :2]},
        "grad_weight",
        "3, 8, 2",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BACKENDS))
def test_a_backend_returning_the_wrong_result_is_named(case):
    overrides, what, detail = BAD_BACKENDS[case]
    register_backend(_backend(case, **overrides))
    try:
        x, w, group_list = gmm_inputs([2, 0, 4], 8, 4)
        x.requires_grad_(True)
        w.requires_grad_(True)
        with pytest.raises((RuntimeError, TypeError), match=rf"backend '{case}' {what} returned .*{detail}"):
            moe_gmm.grouped_matmul(x, w, group_list, backend=case).sum().backward()
    finally:
        unregister_backend(case)


def test_a_correct_custom_backend_passes_the_check():
    register_backend(_backend("plain"))
    try:
        x, w, group_list = gmm_inputs([2, 0, 4], 8, 4)
        y = moe_gmm.grouped_matmul(x, w, group_list, backend="plain")
        assert torch.equal(y, moe_gmm.grouped_matmul(x, w, group_list, fused=False))
    finally:
        unregister_backend("plain")


@pytest.mark.parametrize("backend", CPU_BACKENDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("m", "k", "n"), [(1, 1, 1), (1, 3, 1), (3, 1, 1)])
def test_one_row_or_column_with_an_expanded_gradient(backend, dtype, m, k, n):
    # y.sum() hands backward an expanded [M, N] gradient (strides 0); with a size-1 dimension
    # .contiguous() keeps those strides, which the cpu kernels once refused with an internal error.
    x, w, _ = gmm_inputs([m, 0], k, n, dtype)
    if backend is not None and get_backend(backend).op_refusal(x, w) is not None:
        with pytest.raises(ValueError, match=f"backend='{backend}' cannot run these inputs"):
            moe_gmm.grouped_matmul(x, w, [m, 0], backend=backend)
        return
    x.requires_grad_(True)
    w.requires_grad_(True)
    moe_gmm.grouped_matmul(x, w, [m, 0], backend=backend).sum().backward()
    ref_dx, ref_dw = reference_grouped_matmul_grads(x, w, [m, 0], torch.ones(m, n, dtype=torch.float64))
    torch.testing.assert_close(x.grad.double(), ref_dx, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(w.grad.double(), ref_dw, rtol=1e-2, atol=1e-2)
