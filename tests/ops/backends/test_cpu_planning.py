"""The ``cpu`` backend's torch-only strategies (``planning``): padded bmm and the GEMM loop, and
the one-GEMM-per-expert native call, each forced and held to the grouped-matmul contract.

The generic contract tests (tests/ops/test_grouped_matmul.py, test_backend_contract.py) already
run every registered CPU backend, this one included, through ``auto``-style dispatch; here each
strategy is forced, so that small test shapes cannot all land on one path.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm.ops import native
from moe_gmm.ops.backends import cpu, get_backend
from moe_gmm.ops.backends.cpu import planning
from moe_gmm.testing import assert_rel_close, gmm_inputs, reference_grouped_matmul, reference_grouped_matmul_grads
from tests.helpers.cpu_checks import DTYPES, check_cpu

# The thresholds that force one strategy; the code paths stay the real ones.
PADDED = {
    "min_threads": 1,
    "min_experts": 1,
    "max_rows": 10**9,
    "max_rows_fp32": 10**9,
    "max_pad_waste": float("inf"),
}
LOOP = {"max_rows": -1, "max_rows_fp32": -1, "small_rows": -1}


@pytest.fixture(params=["experts", "padded", "padded_by_expert", "loop"])
def strategy(request):
    """Force one strategy by moving the thresholds of the plan.

    ``experts``: one library GEMM per expert, whole experts per thread (the native ``experts_mm``
    ops) for every expert, float32 included. ``padded_by_expert`` runs the padded path one expert
    per bmm (the smallest chunk it takes). The native tile and vector kernels (AMX, AVX-512) are
    off here: they have their own tests (test_cpu_bf16_kernels.py, test_cpu_avx512_fp32.py).
    """
    changes: dict[str, object] = {
        "use_amx": False,
        "use_avx512": False,
        "use_experts_mm": request.param == "experts",
        "experts_mm_min_experts_fp32": 1,
    }
    if request.param == "experts" and native.ops() is None:
        pytest.skip("the experts_mm ops need the native kernels built")
    if request.param == "padded_by_expert":
        changes["padded_chunk_bytes"] = 1
    if request.param.startswith("padded"):
        changes.update(PADDED)
    elif request.param == "loop":
        changes.update(LOOP)
    with cpu.use_tuning(**changes):
        yield request.param.removesuffix("_by_expert")


def _plan_strategy(counts, dtype):
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return cpu.plan(bounds, dtype).strategy


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
    if strategy != "experts":
        assert _plan_strategy(counts, dtype) == ("loop" if sum(counts) == 0 else strategy)
    check_cpu(counts, k, n, dtype)


@pytest.mark.parametrize("transposed_weight", [False, True])
def test_weight_layouts(strategy, transposed_weight):
    check_cpu([5, 0, 3, 8], 32, 16, torch.float32, transposed_weight=transposed_weight)


def test_expanded_grad_output(strategy):
    check_cpu([3, 0, 4], 16, 8, torch.float32, expanded_grad=True)


def test_many_mostly_empty_experts(strategy):
    counts = [0] * 300
    for e, c in ((3, 5), (100, 1), (299, 4), (256, 7)):
        counts[e] = c
    check_cpu(counts, 16, 8, torch.bfloat16)


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


def test_plan_choice():
    # Small, even groups: one padded bmm. Big groups, or padding that multiplies the rows: the loop.
    # The tuning is passed to plan() (a second thread is not needed to choose padded).
    one_thread = replace(cpu.current_tuning(), min_threads=1)

    def chosen(counts, dtype=torch.bfloat16, tuning=one_thread):
        return cpu.plan([0, *torch.tensor(counts).cumsum(0).tolist()], dtype, tuning=tuning)

    tiny = [4, 3, 4, 2] * 8  # 32 experts, <= 4 rows each
    assert chosen(tiny).strategy == "padded" and chosen(tiny).padded_rows == 4
    assert chosen(tiny, torch.float32).strategy == "loop"  # MKL's fp32 GEMMs are cheap to call
    mid = [200, 190, 210, 205] * 4  # 16 experts, mid-size, little padding
    assert chosen(mid).strategy == "padded"
    assert chosen(mid, torch.float32).strategy == "loop"  # MKL's small fp32 GEMMs are cheap
    big = [1000, 1010, 990, 1000] * 4  # 16 big even groups
    assert chosen(big).strategy == "padded"  # oneDNN's per-call setup: batching pays at any size
    assert chosen(big, torch.float32).strategy == "loop"
    assert chosen([4, 3, 4, 2]).strategy == "loop"  # few experts: few joins to save
    assert chosen([60] + [0] * 30).strategy == "loop"  # skewed: padding multiplies the rows
    assert chosen([600, 10, 0, 300, 0, 0, 5, 80]).strategy == "loop"
    assert chosen([0] * 20).strategy == "loop"
    more_threads = replace(one_thread, min_threads=torch.get_num_threads() + 1)
    assert chosen(tiny, tuning=more_threads).strategy == "loop"  # one thread: no fork/join to save
    with cpu.use_tuning(one_thread):  # without the argument: the tuning in force
        assert cpu.plan([0, *torch.tensor(tiny).cumsum(0).tolist()]).strategy == "padded"


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
    if force_padded:
        forced = {**PADDED, "small_rows": 10**9}
    else:
        forced = {**LOOP, "max_pad_waste": 0.0, "min_threads": 1, "min_experts": 10**9}
    with cpu.use_tuning(**forced):
        check_cpu(counts, k, n, dtype, seed=seed)


def test_loop_pass_choice():
    # Small outputs: grouped_mm's C++ loop; outputs worth caching, or unaligned K/N: the eager loop.
    w = torch.zeros(4, 64, 32)
    assert planning.loop_for(w, 8, 32).name == "torch"
    big_rows = cpu.current_tuning().grouped_mm_max_out_bytes // (32 * 4) + 1  # float32 rows of 32
    assert planning.loop_for(w, big_rows, 32).name == "eager"
    assert planning.loop_for(torch.zeros(4, 63, 32), 8, 32).name == "eager"  # K unaligned
    assert planning.loop_for(torch.zeros(4, 63, 32), 8, 63).name == "eager"  # grad_input asks about the same K
