"""The ``cpu`` backend: both of its strategies (padded bmm, loop) held to the grouped-matmul contract.

The generic contract tests (tests/ops/test_grouped_matmul.py, test_backend_contract.py) already
run every registered CPU backend, this one included, through ``auto``-style dispatch; here each
strategy is forced, so that small test shapes cannot all land on one path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm import grouped_matmul
from moe_gmm.ops.backends import cpu, get_backend
from moe_gmm.testing import (
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["padded", "padded_by_expert", "loop"])
def strategy(request, monkeypatch):
    """Force one strategy by moving the thresholds of the plan (the code paths stay the real ones).

    ``padded_by_expert`` runs the padded path one expert per bmm (the smallest chunk it takes).
    """
    if request.param == "padded_by_expert":
        monkeypatch.setattr(cpu, "PADDED_CHUNK_BYTES", 1)
    if request.param.startswith("padded"):
        monkeypatch.setattr(cpu, "MIN_THREADS", 1)
        monkeypatch.setattr(cpu, "MIN_EXPERTS", 1)
        monkeypatch.setattr(cpu, "MAX_ROWS", 10**9)
        monkeypatch.setattr(cpu, "MAX_ROWS_FP32", 10**9)
        monkeypatch.setattr(cpu, "MAX_PAD_WASTE", float("inf"))
    else:
        monkeypatch.setattr(cpu, "MAX_ROWS", -1)
        monkeypatch.setattr(cpu, "MAX_ROWS_FP32", -1)
        monkeypatch.setattr(cpu, "SMALL_ROWS", -1)
    return request.param.removesuffix("_by_expert")


def _plan_strategy(counts, dtype):
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return cpu.plan(bounds, dtype).strategy


def _check(counts, k, n, dtype, *, transposed_weight=False, seed=0, expanded_grad=False):
    x, w, group_list = gmm_inputs(counts, k, n, dtype, transposed_weight=transposed_weight, seed=seed)
    tol = tolerance_for(dtype)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    if expanded_grad:
        dy = torch.ones(1, 1, dtype=dtype).expand(x.shape[0], n)
    results = {}
    for backend in ("eager", "cpu"):
        x_ = x.detach().clone().requires_grad_(True)
        w_ = w.detach().clone() if not transposed_weight else w.detach().transpose(1, 2).clone().transpose(1, 2)
        w_.requires_grad_(True)
        y = grouped_matmul(x_, w_, group_list, backend=backend)
        y.backward(dy)
        results[backend] = (y.detach(), x_.grad, w_.grad)
    y_ref = reference_grouped_matmul(x, w, counts)
    dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    for what, got, ref, eager in zip(
        ("forward", "grad_input", "grad_weight"), results["cpu"], (y_ref, dx_ref, dw_ref), results["eager"]
    ):
        assert got.dtype == dtype and got.shape == ref.shape
        assert_rel_close(got, ref, tol.rel, f"cpu {what} vs float64")
        torch.testing.assert_close(got, eager, rtol=tol.rtol, atol=tol.atol, msg=f"cpu {what} vs eager")
    dw = results["cpu"][2]
    for e, c in enumerate(counts):
        if c == 0:
            assert bool((dw[e] == 0).all()), f"expert {e} has no rows: its grad_weight must be exactly zero"


CASES = {
    "uniform": ([4, 4, 4, 4], 16, 32),
    "uneven": ([5, 3, 2], 8, 16),
    "empty_first_middle_last": ([0, 6, 0, 3, 0], 16, 24),
    "all_rows_one_expert": ([0, 0, 12, 0], 16, 16),
    "single_expert": ([9], 16, 16),
    "no_rows": ([0, 0, 0], 16, 16),
    "odd_k_n": ([2, 5, 1], 7, 13),
    # Unaligned K or N (no 16-byte row strides): both strategies take any width.
    "k_unaligned": ([0, 3], 1, 8),
    "n_unaligned": ([3, 2], 8, 1),
    "one_row_each": ([1, 1, 1, 1], 16, 16),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", sorted(CASES))
def test_cases_vs_float64_and_eager(strategy, dtype, case):
    counts, k, n = CASES[case]
    assert _plan_strategy(counts, dtype) == ("loop" if sum(counts) == 0 else strategy)
    _check(counts, k, n, dtype)


@pytest.mark.parametrize("transposed_weight", [False, True])
def test_weight_layouts(strategy, transposed_weight):
    _check([5, 0, 3, 8], 32, 16, torch.float32, transposed_weight=transposed_weight)


def test_expanded_grad_output(strategy):
    _check([3, 0, 4], 16, 8, torch.float32, expanded_grad=True)


def test_many_mostly_empty_experts(strategy):
    counts = [0] * 300
    for e, c in ((3, 5), (100, 1), (299, 4), (256, 7)):
        counts[e] = c
    _check(counts, 16, 8, torch.bfloat16)


def test_writes_everything_and_zero_grad_for_empty_experts_under_poison(strategy, poisoned_memory):
    # torch.empty returns NaN here, scratch buffers included: nothing unwritten may reach a result.
    cpu.release_workspace()
    counts = [0, 7, 0, 0, 9, 0, 2]
    x, w, _ = gmm_inputs(counts, 16, 32)
    dy = torch.randn(x.shape[0], 32)
    ends = torch.tensor(counts).cumsum(0)
    impl = get_backend("cpu")
    for _ in range(2):  # the second call reuses scratch that now holds stale rows
        y = impl.forward(x, w, ends)
        dx = impl.grad_input(dy, w, ends)
        dw = impl.grad_weight(x, dy, ends)
        dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
        assert_rel_close(y, reference_grouped_matmul(x, w, counts), 1e-5, "forward")
        assert_rel_close(dx, dx_ref, 1e-5, "grad_input")
        assert_rel_close(dw, dw_ref, 1e-5, "grad_weight")
        assert bool((dw[[0, 2, 3, 5]] == 0).all())


def test_scratch_reuse_does_not_alias_results(strategy):
    counts = [3, 2, 3]
    x, w, _ = gmm_inputs(counts, 8, 8)
    ends = torch.tensor(counts).cumsum(0)
    y1 = get_backend("cpu").forward(x, w, ends)
    kept = y1.clone()
    get_backend("cpu").forward(x * 2, w, ends)  # would overwrite y1 if y1 were scratch
    assert torch.equal(y1, kept)


def test_plan_choice(monkeypatch):
    # Small, even groups: one padded bmm. Big groups, or padding that multiplies the rows: the loop.
    monkeypatch.setattr(cpu, "MIN_THREADS", 1)

    def bounds(counts):
        return [0, *torch.tensor(counts).cumsum(0).tolist()]

    tiny = bounds([4, 3, 4, 2] * 8)  # 32 experts, <= 4 rows each
    assert cpu.plan(tiny).strategy == "padded" and cpu.plan(tiny).padded_rows == 4
    assert cpu.plan(tiny, torch.float32).strategy == "loop"  # MKL's fp32 GEMMs are cheap to call
    mid = bounds([200, 190, 210, 205] * 4)  # 16 experts, mid-size, little padding
    assert cpu.plan(mid).strategy == "padded"
    assert cpu.plan(mid, torch.float32).strategy == "loop"  # MKL's small fp32 GEMMs are cheap
    big = bounds([1000, 1010, 990, 1000] * 4)  # 16 big even groups
    assert cpu.plan(big).strategy == "padded"  # oneDNN's per-call setup: batching pays at any size
    assert cpu.plan(big, torch.float32).strategy == "loop"
    assert cpu.plan(bounds([4, 3, 4, 2])).strategy == "loop"  # few experts: few joins to save
    assert cpu.plan(bounds([60] + [0] * 30)).strategy == "loop"  # skewed: padding multiplies the rows
    assert cpu.plan(bounds([600, 10, 0, 300, 0, 0, 5, 80])).strategy == "loop"
    assert cpu.plan(bounds([0] * 20)).strategy == "loop"
    monkeypatch.setattr(cpu, "MIN_THREADS", torch.get_num_threads() + 1)
    assert cpu.plan(tiny).strategy == "loop"  # one thread: no fork/join to save


def test_registered_and_first_for_cpu():
    from moe_gmm.ops.backends import AUTO_PRIORITY, select_backend

    assert get_backend("cpu").devices == frozenset({"cpu"})
    assert AUTO_PRIORITY["cpu"][0] == "cpu"
    assert select_backend(torch.zeros(4, 8), torch.zeros(2, 8, 8)).name == "cpu"


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 9), min_size=1, max_size=12),
    k=st.integers(1, 24),
    n=st.integers(1, 24),
    dtype=st.sampled_from(DTYPES),
    force_padded=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_groups(counts, k, n, dtype, force_padded, seed):
    limits = (10**9, float("inf"), 10**9) if force_padded else (-1, 0.0, -1)
    names = (
        "MAX_ROWS",
        "MAX_PAD_WASTE",
        "SMALL_ROWS",
        "MIN_THREADS",
        "MAX_ROWS_FP32",
        "MIN_EXPERTS",
    )
    saved = {name: getattr(cpu, name) for name in names}
    forced = (*limits, 1, limits[0], 1 if force_padded else 10**9)
    for name, value in zip(names, forced):
        setattr(cpu, name, value)
    try:
        _check(counts, k, n, dtype, seed=seed)
    finally:
        for name, value in saved.items():
            setattr(cpu, name, value)


def test_loop_pass_choice():
    # Small outputs: grouped_mm's C++ loop; outputs worth caching, or unaligned K/N: the eager loop.
    w = torch.zeros(4, 64, 32)
    assert cpu._loop_for(w, 8, 32).name == "torch"
    big_rows = cpu.GROUPED_MM_MAX_OUT_BYTES // (32 * 4) + 1  # float32 rows of 32
    assert cpu._loop_for(w, big_rows, 32).name == "eager"
    assert cpu._loop_for(torch.zeros(4, 63, 32), 8, 32).name == "eager"  # K unaligned
    assert cpu._loop_for(torch.zeros(4, 63, 32), 8, 63).name == "eager"  # grad_input asks about the same K


@pytest.mark.parametrize("num_experts", [1, 7, 16, 60, 64, 256])
@pytest.mark.parametrize("chunk_bytes", [1, 64 << 10, 4 << 20])
def test_expert_runs_cover_every_expert_in_order(monkeypatch, num_experts, chunk_bytes):
    monkeypatch.setattr(cpu, "PADDED_CHUNK_BYTES", chunk_bytes)
    counts = tuple((e * 7) % 5 for e in range(num_experts))
    p = cpu.GmmPlan("padded", max(counts), counts)
    runs = cpu._expert_chunks(p, rows=8, width=1024, dtype=torch.bfloat16)
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    assert [r[0] for r in runs] == [0, *(r[1] for r in runs[:-1])] and runs[-1][1] == num_experts
    assert all((r[2], r[3]) == (bounds[r[0]], bounds[r[1]]) for r in runs)
    threads = torch.get_num_threads()
    sizes = [r[1] - r[0] for r in runs]
    assert all(size % threads == 0 for size in sizes[:-1]), "every run but the last splits evenly between threads"
    if num_experts in (16, 64, 256) and threads in (1, 2, 4):
        assert len(set(sizes)) == 1, "E with a fitting divisor runs in one bmm shape"
