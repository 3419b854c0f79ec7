"""The ``cpu`` backend's one library GEMM per expert, whole experts per thread (the native
``experts_mm`` / ``experts_mm_tn`` ops, called from ``kernels``), against float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm.ops import native
from moe_gmm.ops.backends import cpu
from moe_gmm.ops.backends.cpu import kernels
from moe_gmm.testing import assert_rel_close, gmm_inputs, tolerance_for
from tests.helpers.cpu_checks import DTYPES


@pytest.fixture(scope="module")
def experts_ops():
    ops = native.ops()
    if ops is None:
        pytest.skip("the experts_mm ops need the native kernels built")
    return ops


def _grouped_operands(counts, k, n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    a = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(len(counts), k, n, generator=g).to(dtype)
    dy = torch.randn(rows, n, generator=g).to(dtype)
    return a, w, dy, torch.tensor(counts, dtype=torch.int64).cumsum(0)


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 70), min_size=1, max_size=7),
    k=st.integers(1, 100),
    n=st.integers(1, 80),
    dtype=st.sampled_from(DTYPES),
    min_rows=st.sampled_from([-1, 0, 5, 33]),
    seed=st.integers(0, 2**16),
)
def test_experts_mm_vs_float64_leaving_small_experts_untouched(experts_ops, counts, k, n, dtype, min_rows, seed):
    # Row counts and widths off multiples of 32 (the edges of the 16-bit transpose in tn), odd rows.
    a, w, dy, ends = _grouped_operands(counts, k, n, dtype, seed)
    rel = tolerance_for(dtype).rel
    starts = [0, *ends.tolist()[:-1]]
    out = torch.full((a.shape[0], n), float("nan"), dtype=dtype)
    dx = torch.full((a.shape[0], k), float("nan"), dtype=dtype)
    dw = torch.full((len(counts), k, n), float("nan"), dtype=dtype)
    experts_ops.experts_mm(a, w, ends, min_rows, out)
    experts_ops.experts_mm(dy, w.transpose(1, 2), ends, min_rows, dx)  # a weight's transposed view
    experts_ops.experts_mm_tn(a, dy, ends, min_rows, dw)
    for e, (start, count) in enumerate(zip(starts, counts)):
        rows = slice(start, start + count)
        if count <= min_rows and not (count == 0 and min_rows < 0):
            assert bool(out[rows].isnan().all() and dx[rows].isnan().all() and dw[e].isnan().all()), f"expert {e}"
            continue
        a64, w64, dy64 = a[rows].double(), w[e].double(), dy[rows].double()
        assert_rel_close(out[rows], a64 @ w64, rel, f"experts_mm expert {e}")
        assert_rel_close(dx[rows], dy64 @ w64.T, rel, f"experts_mm transposed expert {e}")
        assert_rel_close(dw[e], a64.T @ dy64, rel, f"experts_mm_tn expert {e}")
        if count == 0:
            assert bool((dw[e] == 0).all()), f"empty expert {e}: its weight gradient must be exactly zero"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_experts_mm_on_experts_past_the_row_quantum(experts_ops, dtype):
    # Experts of 512+ rows keep their row count: odd counts (the transpose's odd-count padding)
    # against float64, next to padded small ones, under a NaN-filled output.
    counts = [513, 31, 0, 600, 1]
    a, w, dy, ends = _grouped_operands(counts, 64, 40, dtype, seed=5)
    out = torch.full((a.shape[0], 40), float("nan"), dtype=dtype)
    dw = torch.full((len(counts), 64, 40), float("nan"), dtype=dtype)
    experts_ops.experts_mm(a, w, ends, 0, out)
    experts_ops.experts_mm_tn(a, dy, ends, -1, dw)
    rel = tolerance_for(dtype).rel
    for e, (start, count) in enumerate(zip([0, *ends.tolist()[:-1]], counts)):
        rows = slice(start, start + count)
        assert_rel_close(out[rows], a[rows].double() @ w[e].double(), rel, f"experts_mm expert {e}")
        assert_rel_close(dw[e], a[rows].double().T @ dy[rows].double(), rel, f"experts_mm_tn expert {e}")


def test_experts_mm_padding_rows_are_zero_not_stale_memory(experts_ops, poisoned_memory):
    # 100 rows run as 128 on per-thread scratch, grown here (so NaN-filled under poisoned memory):
    # with a transposed b, oneDNN let a NaN in the row after the expert's last reach that row.
    _, w, _, ends = _grouped_operands([100], 20, 3000, torch.bfloat16, seed=2)
    dy = torch.randn(100, 3000).to(torch.bfloat16)
    dx = torch.full((100, 20), float("nan"), dtype=torch.bfloat16)
    experts_ops.experts_mm(dy, w.transpose(1, 2), ends, -1, dx)
    assert_rel_close(dx, dy.double() @ w[0].double().T, tolerance_for(torch.bfloat16).rel, "experts_mm")


def test_experts_mm_tn_reads_strided_rows(experts_ops):
    # A column slice of a wider matrix (row stride 101), bfloat16: the transpose reads it in place.
    counts = [37, 0, 64, 5]
    wide = torch.randn(sum(counts), 101).to(torch.bfloat16)
    a = wide[:, 3:99]
    dy = torch.randn(sum(counts), 40).to(torch.bfloat16)
    ends = torch.tensor(counts).cumsum(0)
    dw = torch.empty(len(counts), 96, 40, dtype=torch.bfloat16)
    experts_ops.experts_mm_tn(a, dy, ends, -1, dw)
    expected = torch.empty_like(dw)
    experts_ops.experts_mm_tn(a.contiguous(), dy, ends, -1, expected)
    assert torch.equal(dw, expected)
    assert_rel_close(dw[2], a[37:101].double().T @ dy[37:101].double(), tolerance_for(torch.bfloat16).rel, "tn")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("counts", [[300, 0, 40, 130, 7, 64, 1100], [1100]], ids=["several", "one"])
def test_experts_mm_does_not_depend_on_thread_count(experts_ops, dtype, counts):
    # oneDNN's 16-bit GEMMs do not split their reduction between threads; MKL's float32 ones do
    # past a few hundred rows (as torch.mm's do), so float32 is held to it on short reductions.
    if dtype == torch.float32:
        counts = [c for c in counts if c <= 300] or [300]
    a, w, dy, ends = _grouped_operands(counts, 96, 72, dtype, seed=3)
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            out, dw = torch.empty(a.shape[0], 72, dtype=dtype), torch.empty(len(counts), 96, 72, dtype=dtype)
            experts_ops.experts_mm(a, w, ends, 0, out)
            experts_ops.experts_mm_tn(a, dy, ends, -1, dw)
            results.append((out, dw))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        assert torch.equal(other[0], results[0][0]) and torch.equal(other[1], results[0][1])


def test_experts_mm_takes_operands_that_require_grad(experts_ops):
    # Weights are parameters: the worker threads' GEMMs must not be recorded by autograd (an out=
    # GEMM on tensors that require grad raises there).
    a, w, dy, ends = _grouped_operands([50, 70], 32, 48, torch.float32, seed=1)
    a.requires_grad_(True), w.requires_grad_(True)
    out, dw = torch.empty(120, 48), torch.empty(2, 32, 48)
    with torch.enable_grad():
        experts_ops.experts_mm(a, w, ends, 0, out)
        experts_ops.experts_mm_tn(a, dy, ends, -1, dw)
    assert not out.requires_grad and not dw.requires_grad
    assert_rel_close(out[50:], a[50:].detach().double() @ w[1].detach().double(), 1e-5, "experts_mm")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ops, a, w, dy, e: ops.experts_mm(a, w, e, 0, torch.empty(6, 9)), "shapes do not match"),
        (lambda ops, a, w, dy, e: ops.experts_mm(a, w[:, :3], e, 0, torch.empty(6, 8)), "shapes do not match"),
        (lambda ops, a, w, dy, e: ops.experts_mm(a, w.double(), e, 0, torch.empty(6, 8)), "one dtype"),
        (lambda ops, a, w, dy, e: ops.experts_mm(a, w, e - 1, 0, torch.empty(6, 8)), "group_ends"),
        (lambda ops, a, w, dy, e: ops.experts_mm_tn(a, dy, e, 0, torch.empty(2, 4, 9)), "shapes do not match"),
        (lambda ops, a, w, dy, e: ops.experts_mm_tn(a, dy[:5], e, 0, torch.empty(2, 4, 8)), "shapes do not match"),
        (lambda ops, a, w, dy, e: ops.experts_mm_tn(a, dy.half(), e, 0, torch.empty(2, 4, 8)), "one dtype"),
    ],
)
def test_experts_mm_rejects_bad_operands(experts_ops, call, message):
    a, w, dy, ends = _grouped_operands([2, 4], 4, 8, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match=message):
        call(experts_ops, a, w, dy, ends)


def test_experts_strategy_choice(experts_ops):
    # float32: MKL's own split between threads was as fast with few large experts
    x8, w8, _ = gmm_inputs([30] * 8, 32, 16)
    x20, w20, _ = gmm_inputs([30] * 20, 32, 16)
    assert kernels.experts_product(x8, w8, torch.tensor([30] * 8).cumsum(0)) is None
    assert kernels.experts_product(x20, w20, torch.tensor([30] * 20).cumsum(0)) is not None
    xb, wb = x8.to(torch.bfloat16), w8.to(torch.bfloat16)  # 16-bit: from any number of experts
    assert kernels.experts_product(xb, wb, torch.tensor([30] * 8).cumsum(0)) is not None
    with cpu.use_tuning(use_experts_mm=False):
        assert kernels.experts_product(xb, wb, torch.tensor([30] * 8).cumsum(0)) is None
