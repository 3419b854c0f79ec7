"""The public ``grouped_matmul`` contract, through every CPU backend."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm import grouped_matmul
from moe_gmm.testing import gmm_inputs, reference_grouped_matmul, reference_grouped_matmul_grads
from tests.helpers.gmm_cases import cpu_backend_names, run_and_check

BACKENDS = cpu_backend_names()


# The reference system's unit test: (E, counts, K, N) in bf16, fused vs eager at rtol = atol = 1e-2.
# Here also backward, and both against float64.
REFERENCE_CASES = [
    (2, [4, 4], 16, 32),  # even split
    (3, [5, 3, 2], 8, 16),  # uneven
    (3, [2, 2, 2], 4, 8),  # small, K < N
    (4, [3, 3, 3, 3], 16, 8),  # more experts
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_experts", "counts", "k", "n"), REFERENCE_CASES)
def test_reference_cases_bf16(backend, num_experts, counts, k, n):
    assert len(counts) == num_experts
    run_and_check(counts, k, n, torch.bfloat16, backend=backend)


# Each case names the edge it covers.
EDGE_CASES = {
    "empty_first": ([0, 5, 3], 16, 16),
    "empty_middle": ([4, 0, 4], 16, 16),
    "empty_last": ([3, 5, 0], 16, 16),
    "empty_runs": ([0, 0, 7, 0, 0, 2, 0], 16, 32),
    "all_rows_one_expert": ([0, 0, 12, 0], 16, 16),
    "single_expert": ([9], 16, 16),
    "no_rows": ([0, 0, 0], 16, 16),
    "k_n_not_multiple_of_8": ([3, 0, 6], 12, 20),
    "odd_k_n": ([2, 5, 1], 7, 13),
    "one_row_each": ([1, 1, 1, 1], 16, 16),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_edge_cases(backend, dtype, case):
    counts, k, n = EDGE_CASES[case]
    run_and_check(counts, k, n, dtype, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_mostly_empty_experts(backend):
    counts = [0] * 512
    for e, c in ((3, 5), (100, 1), (511, 4), (256, 7)):
        counts[e] = c
    run_and_check(counts, 16, 16, torch.float32, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("group_list_type", ["count", "cumsum"])
def test_transposed_weight_view(backend, group_list_type):
    run_and_check([5, 0, 3, 8], 32, 16, torch.float32, backend=backend, transposed_weight=True,
                  group_list_type=group_list_type)


@pytest.mark.parametrize("form", ["list", "tuple", "int32", "int64"])
@pytest.mark.parametrize("group_list_type", ["count", "cumsum"])
def test_group_list_forms_agree(form, group_list_type):
    counts = [3, 0, 5, 2]
    x, w, _ = gmm_inputs(counts, 16, 16)
    values = torch.tensor(counts).cumsum(0).tolist() if group_list_type == "cumsum" else counts
    group_list = {
        "list": list(values),
        "tuple": tuple(values),
        "int32": torch.tensor(values, dtype=torch.int32),
        "int64": torch.tensor(values, dtype=torch.int64),
    }[form]
    y = grouped_matmul(x, w, group_list, group_list_type=group_list_type)
    torch.testing.assert_close(y.double(), reference_grouped_matmul(x, w, counts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["expanded", "transposed", "strided"])
def test_any_grad_output_layout(backend, layout):
    counts = [4, 0, 6, 6]
    x, w, group_list = gmm_inputs(counts, 16, 16)
    x.requires_grad_(True)
    w.requires_grad_(True)
    y = grouped_matmul(x, w, group_list, backend=backend)
    if layout == "expanded":
        y.sum().backward()  # zero-stride grad_output: torch's grouped_mm backward rejects it natively
        dy = torch.ones_like(y, dtype=torch.float64)
    elif layout == "transposed":
        dy = torch.randn(y.shape[1], y.shape[0], dtype=torch.float64).t()
        y.backward(dy.float())
    else:
        dy = torch.randn(y.shape[0], 2 * y.shape[1], dtype=torch.float64)[:, ::2]
        y.backward(dy.float())
    dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    torch.testing.assert_close(x.grad.double(), dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad.double(), dw_ref, rtol=1e-5, atol=1e-5)


def test_fused_false_is_eager_and_conflicts_with_other_backend():
    x, w, gl = gmm_inputs([2, 3], 16, 16)
    torch.testing.assert_close(grouped_matmul(x, w, gl, fused=False), grouped_matmul(x, w, gl, backend="eager"), rtol=0, atol=0)
    with pytest.raises(ValueError, match="fused=False"):
        grouped_matmul(x, w, gl, fused=False, backend="torch")


def test_float64_picks_a_backend_that_supports_it():
    x, w, gl = gmm_inputs([2, 3], 16, 16, torch.float64)
    y = grouped_matmul(x, w, gl)
    torch.testing.assert_close(y, reference_grouped_matmul(x, w, [2, 3]), rtol=1e-12, atol=1e-12)


def test_gradcheck_float64_eager():
    x, w, gl = gmm_inputs([2, 0, 3, 1], 5, 4, torch.float64)
    x.requires_grad_(True)
    w.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: grouped_matmul(a, b, gl, fused=False), (x, w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_is_propagated_not_hidden(backend):
    x, w, gl = gmm_inputs([3, 3], 16, 16)
    x[4, 2] = float("nan")
    y = grouped_matmul(x, w, gl, backend=backend)
    assert bool(torch.isnan(y[4]).all()) and bool(torch.isfinite(y[:3]).all()) and bool(torch.isfinite(y[5:]).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_element_written_under_poisoned_memory(backend, poisoned_memory):
    run_and_check([0, 6, 0, 2, 8, 0], 16, 32, torch.float32, backend=backend)


@st.composite
def _gmm_problem(draw):
    num_experts = draw(st.integers(1, 9))
    counts = draw(st.lists(st.integers(0, 12), min_size=num_experts, max_size=num_experts))
    k = draw(st.sampled_from([1, 3, 8, 16, 24, 33]))
    n = draw(st.sampled_from([1, 5, 8, 16, 40]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    backend = draw(st.sampled_from(BACKENDS))
    transposed = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return counts, k, n, dtype, backend, transposed, seed


@settings(max_examples=60, deadline=None)
@given(_gmm_problem())
def test_property_fused_eager_and_float64_agree(problem):
    counts, k, n, dtype, backend, transposed, seed = problem
    run_and_check(counts, k, n, dtype, backend=backend, transposed_weight=transposed, seed=seed)
