"""The ``cpu`` backend: each of its strategies (AMX tiles, AVX-512, one GEMM per expert on a thread,
padded bmm, loop) held to the grouped-matmul contract.

The generic contract tests (tests/ops/test_grouped_matmul.py, test_backend_contract.py) already
run every registered CPU backend, this one included, through ``auto``-style dispatch; here each
strategy is forced, so that small test shapes cannot all land on one path.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from moe_gmm import grouped_matmul
from moe_gmm.ops import native
from moe_gmm.ops.backends import cpu, get_backend
from moe_gmm.testing import (
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(params=["experts", "padded", "padded_by_expert", "loop"])
def strategy(request, monkeypatch):
    """Force one strategy by moving the thresholds of the plan (the code paths stay the real ones).

    ``experts``: one library GEMM per expert, whole experts per thread (the native ``experts_mm``
    ops) for every expert, float32 included. ``padded_by_expert`` runs the padded path one expert
    per bmm (the smallest chunk it takes). The native tile and vector kernels (AMX, AVX-512) are
    off here: they have their own tests below.
    """
    monkeypatch.setattr(cpu, "USE_AMX", False)
    monkeypatch.setattr(cpu, "USE_AVX512", False)
    monkeypatch.setattr(cpu, "USE_EXPERTS_MM", request.param == "experts")
    monkeypatch.setattr(cpu, "EXPERTS_MM_MIN_EXPERTS_FP32", 1)
    if request.param == "experts":
        if native.ops() is None:
            pytest.skip("the experts_mm ops need the native kernels built")
        return "experts"
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
        # Two correct float32 sums of a long reduction in different orders differ by about the eager
        # loop's own error against float64 where the terms cancel to small outputs (1100 terms:
        # above 1e-5 for MKL's loop against a dot-product kernel in 4 of 61 random cases), so twice
        # that error widens atol (the register blocks: 0 of 141 such cases past it, at most 0.4).
        slack = (
            2 * (eager.double() - ref.double()).abs().max().item() if dtype == torch.float32 and ref.numel() else 0.0
        )
        torch.testing.assert_close(got, eager, rtol=tol.rtol, atol=tol.atol + slack, msg=f"cpu {what} vs eager")
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
    if strategy != "experts":
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


# --- the native bfloat16 kernels (AMX, AVX-512 BF16; widths that are multiples of 32) ------------

BF16_LIMITS = {
    "amx": ("AMX_NN_MAX_ROWS", "AMX_NT_MAX_ROWS", "AMX_GRAD_WEIGHT_MAX_ROWS"),
    "avx512_bf16": ("AVX512_BF16_NN_MAX_ROWS", "AVX512_BF16_NT_MAX_ROWS", "AVX512_BF16_GRAD_WEIGHT_MAX_ROWS"),
}


@pytest.fixture(params=sorted(BF16_LIMITS))
def bf16_family(request):
    """Each family of bfloat16 kernels this CPU runs, made the one the backend picks."""
    family = request.param
    ops = native.ops()
    if family == "amx" and not cpu.amx_available():
        pytest.skip("the AMX kernels need an x86 CPU with AMX-BF16 and the native kernels built")
    if family == "avx512_bf16" and (ops is None or not ops.avx512_bf16_gemm_supported()):
        pytest.skip("the AVX-512 BF16 kernels need an x86 CPU with AVX512_BF16 and the native kernels built")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "USE_AMX", family == "amx")  # on a CPU with AMX, test the AVX-512 kernels too
        yield family


def _assert_takes_bf16_kernels(family, counts, k, n, transposed_weight=False):
    x, w, _ = gmm_inputs(counts, k, n, torch.bfloat16, transposed_weight=transposed_weight)
    assert cpu._weight_layout(w) == ("ENK" if transposed_weight else "EKN")
    kernels = cpu._bf16_kernels(x, w, widths=(k, n))
    assert kernels is not None and kernels.family == family, f"these inputs should take the {family} kernels"


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    counts=st.lists(st.integers(0, 70), min_size=1, max_size=9),
    k=st.sampled_from([32, 64, 96, 288]),
    n=st.sampled_from([32, 64, 160, 288, 544]),
    transposed_weight=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_bf16_kernels_vs_float64_and_eager(bf16_family, counts, k, n, transposed_weight, seed):
    # Row counts on both sides of AMX's 16-row tile and 32-row block and of the AVX-512 kernels'
    # 4-row groups; widths past one panel (128-512 wide) and depths past one chunk or band.
    _assert_takes_bf16_kernels(bf16_family, counts, k, n, transposed_weight)
    with pytest.MonkeyPatch.context() as patch:
        for limit in BF16_LIMITS[bf16_family]:  # the kernels at every row count
            patch.setattr(cpu, limit, 10**9)
        _check(counts, k, n, torch.bfloat16, transposed_weight=transposed_weight, seed=seed)


@pytest.mark.parametrize("limit", range(3), ids=["nn", "nt", "tn"])
@pytest.mark.parametrize("transposed_weight", [False, True])  # nn is the forward of EKN, the grad_input of ENK
def test_bf16_kernels_hand_large_experts_to_library_gemms(bf16_family, monkeypatch, limit, transposed_weight):
    monkeypatch.setattr(cpu, BF16_LIMITS[bf16_family][limit], 8)
    _assert_takes_bf16_kernels(bf16_family, [3, 20, 0, 9, 8, 40], 64, 32, transposed_weight)
    _check([3, 20, 0, 9, 8, 40], 64, 32, torch.bfloat16, transposed_weight=transposed_weight)
    monkeypatch.setattr(cpu, BF16_LIMITS[bf16_family][limit], 0)  # every expert large
    _check([20, 0, 9], 64, 32, torch.bfloat16, transposed_weight=transposed_weight)


def test_bf16_kernels_take_experts_of_hundreds_of_rows(bf16_family, monkeypatch):
    # AVX-512 BF16: the pair blocks keep the float32 sums of all of an expert's rows between depth chunks
    for limit in BF16_LIMITS[bf16_family]:
        monkeypatch.setattr(cpu, limit, 10**9)
    _check([300, 2, 530], 64, 96, torch.bfloat16, transposed_weight=False)


@pytest.mark.parametrize("transposed_weight", [False, True])
def test_bf16_nn_inputs_whose_rows_are_4_kib_apart(bf16_family, poisoned_memory, transposed_weight):
    # nn multiplies x by an [E, K, N] weight (the forward) and dy by an [E, N, K] one (grad_input):
    # that input's rows are 2048 bf16, 4 KiB, apart here, where every row's line at one depth falls
    # in one L1 set; the same rows further apart give the same bits. The 257-row expert is oneDNN's.
    counts, wide, narrow = [200, 0, 3, 100, 257], 2048, 64
    k, n = (wide, narrow) if not transposed_weight else (narrow, wide)
    x, w, _ = gmm_inputs(counts, k, n, torch.bfloat16, transposed_weight=transposed_weight)
    a = x if not transposed_weight else torch.randn(x.shape[0], n).to(torch.bfloat16)
    ends = torch.tensor(counts).cumsum(0)
    off_period = torch.empty(a.shape[0], wide + 8, dtype=torch.bfloat16)[:, :wide].copy_(a)
    product = cpu.forward if not transposed_weight else cpu.grad_input
    out = product(a, w, ends)
    assert torch.equal(out, product(off_period, w, ends))
    applied = w if not transposed_weight else w.transpose(1, 2)
    ref = torch.cat([ae.double() @ we.double() for ae, we in zip(a.split(counts), applied)])
    assert_rel_close(out, ref, tolerance_for(torch.bfloat16).rel, "nn product")


def test_avx512_bf16_nn_blocks_sum_in_one_order_for_any_expert_size(bf16_family):
    if bf16_family != "avx512_bf16":
        pytest.skip("the pair blocks are the AVX-512 BF16 nn kernel's")
    # Every expert takes 6 x 64 blocks over its weight's pairs: the first block of rows makes the
    # pairs (and keeps them when more follow), the rest read them. All add the depth's pairs in
    # order into float32 sums, so 40 rows as one expert give the bits of the same rows as experts of
    # 7 and 5 rows (one block that keeps no pairs, two that share them) with the same weight. Depth
    # and width past one packed chunk (256) and one task (256 columns), the last strip 32 wide.
    k, n = 288, 544
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(40, k, generator=generator).to(torch.bfloat16)
    w = (torch.randn(1, k, n, generator=generator) / k**0.5).to(torch.bfloat16)
    whole = cpu.forward(x, w, torch.tensor([40]))
    split = cpu.forward(x, w.repeat(6, 1, 1), torch.tensor([7, 14, 21, 28, 35, 40]))
    assert torch.equal(whole, split)
    assert_rel_close(whole, x.double() @ w[0].double(), tolerance_for(torch.bfloat16).rel, "nn blocks")


def test_avx512_bf16_nt_weights_with_an_odd_row_stride(bf16_family):
    if bf16_family != "avx512_bf16":
        pytest.skip("the pair blocks are the AVX-512 BF16 nt kernel's")
    # The blocks read the weight's rows as 32-bit pairs; with an odd row stride they cannot, and the
    # experts of many rows stay on the dot products. Either way against float64.
    counts = [40, 3, 70]
    ends = torch.tensor(counts).cumsum(0)
    generator = torch.Generator().manual_seed(3)
    a = torch.randn(sum(counts), 96, generator=generator).to(torch.bfloat16)
    b = (torch.randn(3, 64, 96, generator=generator) / 96**0.5).to(torch.bfloat16)  # [E, J, R]
    b_odd = torch.empty(3, 64, 97, dtype=torch.bfloat16)[:, :, :96].copy_(b)
    ref = torch.cat([ae.double() @ be.double().T for ae, be in zip(a.split(counts), b)])
    for weight in (b, b_odd):
        out = torch.full((a.shape[0], 64), float("nan"), dtype=torch.bfloat16)
        native.ops().avx512_bf16_gemm_nt(a, weight, ends, 256, out)
        assert_rel_close(out, ref, tolerance_for(torch.bfloat16).rel, f"nt, row stride {weight.stride(1)}")


@pytest.mark.parametrize("counts", [[5, 0, 3], [40, 2, 70]], ids=["few_rows", "many_rows"])
def test_bf16_kernels_empty_reduction_is_zero(bf16_family, poisoned_memory, counts):
    # K = 0 (forward) and N = 0 (grad_input) are multiples of 32: the products are all zeros, after
    # calls that leave sums in the kernels' thread buffers, and the native ops write them too
    ends = torch.tensor(counts).cumsum(0)
    x, w, _ = gmm_inputs(counts, 64, 64, torch.bfloat16)
    cpu.forward(x, w, ends), cpu.grad_input(torch.randn(x.shape[0], 64).to(torch.bfloat16), w, ends)
    empty_x, empty_dy = (
        torch.empty(x.shape[0], 0, dtype=torch.bfloat16),
        torch.empty(x.shape[0], 0, dtype=torch.bfloat16),
    )
    assert torch.equal(
        cpu.forward(empty_x, torch.empty(3, 0, 64, dtype=torch.bfloat16), ends), torch.zeros(x.shape[0], 64)
    )
    assert torch.equal(
        cpu.grad_input(empty_dy, torch.empty(3, 64, 0, dtype=torch.bfloat16), ends), torch.zeros(x.shape[0], 64)
    )
    if bf16_family == "avx512_bf16":
        kernels = cpu._Bf16Kernels(bf16_family, native.ops())
        for product, weight in (("nn", torch.empty(3, 0, 64)), ("nt", torch.empty(3, 64, 0))):
            out = torch.full((x.shape[0], 64), float("nan"), dtype=torch.bfloat16)
            kernels.op(product)(empty_x, weight.to(torch.bfloat16), ends, 256, out)
            assert torch.equal(out, torch.zeros_like(out)), product


def test_bf16_kernels_expanded_grad_output(bf16_family):
    _check([3, 0, 40], 32, 64, torch.bfloat16, expanded_grad=True)


def test_bf16_kernels_many_mostly_empty_experts(bf16_family):
    counts = [0] * 300
    for e, c in ((3, 5), (100, 1), (299, 40), (256, 17)):
        counts[e] = c
    _check(counts, 32, 64, torch.bfloat16)


def test_bf16_kernels_write_everything_under_poison(bf16_family, poisoned_memory):
    counts = [0, 7, 0, 0, 33, 0, 2]
    x, w, _ = gmm_inputs(counts, 64, 96, torch.bfloat16)
    dy = torch.randn(x.shape[0], 96).to(torch.bfloat16)
    ends = torch.tensor(counts).cumsum(0)
    impl = get_backend("cpu")
    dx_ref, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    rel = tolerance_for(torch.bfloat16).rel
    for _ in range(2):  # the second call gets back cached memory holding the first call's results
        assert_rel_close(impl.forward(x, w, ends), reference_grouped_matmul(x, w, counts), rel, "forward")
        assert_rel_close(impl.grad_input(dy, w, ends), dx_ref, rel, "grad_input")
        dw = impl.grad_weight(x, dy, ends)
        assert_rel_close(dw, dw_ref, rel, "grad_weight")
        assert bool((dw[[0, 2, 3, 5]] == 0).all())


def test_bf16_kernels_results_do_not_depend_on_thread_count(bf16_family):
    counts = [40, 0, 3, 70, 17]
    x, w, _ = gmm_inputs(counts, 96, 320, torch.bfloat16)
    dy = torch.randn(x.shape[0], 320).to(torch.bfloat16)
    ends = torch.tensor(counts).cumsum(0)
    impl = get_backend("cpu")
    threads = torch.get_num_threads()
    results = []
    try:
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append((impl.forward(x, w, ends), impl.grad_input(dy, w, ends), impl.grad_weight(x, dy, ends)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for got, first in zip(other, results[0]):
            assert torch.equal(got, first)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_with_more_threads_than_cores_give_the_one_thread_results(dtype):
    # Hundreds of (expert, columns) tasks on 4 threads: on a machine of fewer cores the threads are
    # preempted mid-range and the others take their remaining tasks from the back.
    g = torch.Generator().manual_seed(11)
    counts = torch.randint(0, 13, (48,), generator=g).tolist()
    x, w, _ = gmm_inputs(counts, 64, 1024, dtype)
    dy = torch.randn(x.shape[0], 1024, generator=g).to(dtype)
    ends = torch.tensor(counts).cumsum(0)
    impl = get_backend("cpu")

    def passes():
        return impl.forward(x, w, ends), impl.grad_input(dy, w, ends), impl.grad_weight(x, dy, ends)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = passes()
        torch.set_num_threads(4)
        for _ in range(3):
            for got, want in zip(passes(), expected):
                assert torch.equal(got, want)
    finally:
        torch.set_num_threads(threads)


def test_bf16_kernels_nt_takes_rows_with_an_odd_stride(bf16_family):
    counts = [5, 0, 21]
    x, w, _ = gmm_inputs(counts, 64, 96, torch.bfloat16)
    dy_wide = torch.randn(x.shape[0], 97).to(torch.bfloat16)
    dy = dy_wide[:, :96]  # row stride 97: AMX cannot read its rows as bfloat16 pairs in place
    ends = torch.tensor(counts).cumsum(0)
    dx_ref, _ = reference_grouped_matmul_grads(x, w, counts, dy)
    got = get_backend("cpu").grad_input(dy, w, ends)
    assert_rel_close(got, dx_ref, tolerance_for(torch.bfloat16).rel, "grad_input")
    assert torch.equal(got, get_backend("cpu").grad_input(dy.contiguous(), w, ends))


def test_bf16_kernels_fall_back_for_unaligned_widths(bf16_family):
    x, w, _ = gmm_inputs([3, 4], 48, 32, torch.bfloat16)
    assert cpu._bf16_kernels(x, w, widths=(48, 32)) is None
    _check([3, 4], 48, 32, torch.bfloat16)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda op, a, b, e, o: op("nn")(a[:, :16], b[:, :16], e, 64, o), "multiple of 32"),
        (lambda op, a, b, e, o: op("nn")(a, b, e - 1, 64, o), "group_ends"),
        (lambda op, a, b, e, o: op("nn")(a.float(), b, e, 64, o), "bfloat16"),
        (lambda op, a, b, e, o: op("nt")(a, b, e, 64, o[:, :32]), "shapes do not match"),
        (lambda op, a, b, e, o: op("tn")(a, a[:5], e, 64, b), "shapes do not match"),
    ],
)
def test_bf16_kernel_ops_reject_bad_operands(bf16_family, call, message):
    a = torch.zeros(6, 64, dtype=torch.bfloat16)
    b = torch.zeros(2, 64, 64, dtype=torch.bfloat16)
    ends = torch.tensor([2, 6])
    out = torch.zeros(6, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=message):
        call(cpu._Bf16Kernels(bf16_family, native.ops()).op, a, b, ends, out)


def test_amx_nt_rejects_rows_with_an_odd_stride():
    if not cpu.amx_available():
        pytest.skip("the AMX kernels need an x86 CPU with AMX-BF16 and the native kernels built")
    a = torch.zeros(6, 65, dtype=torch.bfloat16)[:, :64]
    b, out = torch.zeros(2, 64, 64, dtype=torch.bfloat16), torch.zeros(6, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="even"):
        native.ops().amx_gemm_nt(a, b, torch.tensor([2, 6]), 64, out)


# --- the AVX-512 float32 grad_weight ------------------------------------------------------------


@pytest.fixture(scope="module")
def avx512():
    from moe_gmm.ops import native

    ops = native.ops()
    if ops is None or not ops.avx512_gemm_supported():
        pytest.skip("the AVX-512 grad_weight kernel needs an x86 CPU with AVX-512F and the native kernels built")


@settings(max_examples=20, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=9),
    k=st.integers(1, 100),
    n=st.integers(1, 150),
    max_rows=st.sampled_from([0, 16, 128]),
    seed=st.integers(0, 2**16),
)
def test_avx512_grad_weight_vs_float64_and_eager(avx512, counts, k, n, max_rows, seed):
    # Any widths (masked tails past 64 columns, partial 6-row blocks); experts above max_rows by MKL.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "AVX512_GRAD_WEIGHT_MAX_ROWS", max_rows)
        x, w, _ = gmm_inputs(counts, k, n, torch.float32)
        assert cpu._avx512(x, w) is not None
        _check(counts, k, n, torch.float32, seed=seed)


def test_avx512_grad_weight_writes_everything_under_poison(avx512, poisoned_memory):
    counts = [0, 7, 0, 0, 33, 0, 2, 300]
    x, w, _ = gmm_inputs(counts, 50, 96)
    dy = torch.randn(x.shape[0], 96)
    ends = torch.tensor(counts).cumsum(0)
    _, dw_ref = reference_grouped_matmul_grads(x, w, counts, dy)
    for _ in range(2):  # the second call gets back cached memory holding the first call's result
        dw = get_backend("cpu").grad_weight(x, dy, ends)
        assert_rel_close(dw, dw_ref, 1e-5, "grad_weight")
        assert bool((dw[[0, 2, 3, 5]] == 0).all())


# Experts of 384 rows (kTNPackRows in grouped_gemm_avx512.cpp) and more: the blocks read copies of
# the task's 48 columns of x and of each 64 columns of dy. Beside them, experts just under the
# limit, few-row and empty ones; widths off the 48-row panel, the 6-row block and the 64-column
# strip (masked tails).
PACKED_COUNTS = [400, 0, 5, 385, 383, 700]


def test_avx512_grad_weight_of_experts_of_many_rows_vs_float64_and_eager(avx512, monkeypatch):
    monkeypatch.setattr(cpu, "AVX512_GRAD_WEIGHT_MAX_ROWS", 4096)
    _check(PACKED_COUNTS, 101, 150, torch.float32, seed=5)


def test_avx512_grad_weight_of_experts_of_many_rows_reads_strided_rows(avx512, poisoned_memory):
    ops = native.ops()
    counts, k, n = PACKED_COUNTS, 100, 70
    g = torch.Generator().manual_seed(6)
    x = torch.randn(sum(counts), k + 5, generator=g)[:, :k]  # rows k + 5 floats apart
    dy = torch.randn(sum(counts), n + 11, generator=g)[:, 3 : 3 + n]
    ends = torch.tensor(counts).cumsum(0)
    dw_ref = torch.stack([xe.double().T @ de.double() for xe, de in zip(x.split(counts), dy.split(counts))])
    for _ in range(2):
        dw = torch.empty(len(counts), k, n)
        ops.avx512_gemm_tn(x, dy, ends, 4096, dw)
        assert_rel_close(dw, dw_ref.float(), 1e-5, "grad_weight, strided operands")
        assert bool((dw[1] == 0).all())


def _same_at_every_thread_count(call) -> None:
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(call())
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


@pytest.mark.parametrize("counts", [[40, 0, 3, 70, 17], PACKED_COUNTS], ids=["few_rows", "many_rows"])
def test_avx512_grad_weight_does_not_depend_on_thread_count(avx512, monkeypatch, counts):
    monkeypatch.setattr(cpu, "AVX512_GRAD_WEIGHT_MAX_ROWS", 4096)
    x, _, _ = gmm_inputs(counts, 96, 8)
    dy = torch.randn(x.shape[0], 200)
    ends = torch.tensor(counts).cumsum(0)
    _same_at_every_thread_count(lambda: get_backend("cpu").grad_weight(x, dy, ends))


@settings(max_examples=25, deadline=None)
@given(
    counts=st.lists(st.integers(0, 40), min_size=1, max_size=9),
    k=st.integers(1, 70),
    n=st.integers(1, 1100),  # past one task: 512 or 1024 columns
    max_rows=st.sampled_from([1, 16, 64]),
    transposed_weight=st.booleans(),
    seed=st.integers(0, 2**16),
)
# widths past both task sizes (512 and 1024 columns), for experts of 1-3 rows too
@example(counts=[3, 20, 0, 7], k=40, n=1100, max_rows=64, transposed_weight=False, seed=0)
@example(counts=[1, 2], k=16, n=600, max_rows=16, transposed_weight=True, seed=1)
# the register blocks for every expert (nn) or those of 24 rows and more (nt, through its transposed
# weight blocks, 64 deep under 128 rows and 256 deep from there): row counts off the block's 6,
# widths off its 64 columns and the transpose's 16, depths past one chunk of 64 or 256 and off it
@example(counts=[33, 70, 0, 5, 40], k=300, n=100, max_rows=4096, transposed_weight=False, seed=2)
@example(counts=[37, 31, 64], k=513, n=40, max_rows=4096, transposed_weight=True, seed=3)
@example(counts=[130, 17, 0, 3], k=270, n=300, max_rows=4096, transposed_weight=False, seed=4)
# nn's blocks requesting the next depth chunk, and past the last one the next task's first, while
# they compute: three chunks, two tasks per expert (the second narrower), empty experts
@example(counts=[9, 31, 0, 12, 0], k=600, n=1100, max_rows=64, transposed_weight=False, seed=5)
# weight rows 8 and 16 KiB apart: nn's depth chunks shrink to 128 and 64 rows (nn_depth_chunk),
# with a shorter last chunk
@example(counts=[20, 0, 70], k=300, n=2048, max_rows=4096, transposed_weight=False, seed=6)
@example(counts=[7, 40], k=150, n=4096, max_rows=4096, transposed_weight=False, seed=7)
# tasks of 1024 and 512 columns (experts of at most 32 rows): nn's chunks of 64 and 128 rows keep a
# chunk's bytes down (kNNChunkBytes), with a shorter last chunk
@example(counts=[5, 0, 30, 12], k=300, n=1536, max_rows=4096, transposed_weight=False, seed=8)
# a reduction of 434 canceling to small outputs: one chain of 434 float32 sums was 4x less accurate
# than the eager loop here
@example(counts=[0, 0, 0, 15, 40], k=2, n=434, max_rows=64, transposed_weight=False, seed=19587)
def test_avx512_few_rows_products_vs_float64_and_eager(avx512, counts, k, n, max_rows, transposed_weight, seed):
    # Both kernels on both passes: nn is the forward of [E, K, N] and the grad_input of [E, N, K],
    # nt the other two. Depths not a multiple of 16 (a vector) nor of 64 (nn's partial sums), widths past
    # one task, odd weight-row counts (nt's pairs), expert row counts past 8 (nt's group) and past
    # max_rows (one MKL GEMM each).
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cpu, "AVX512_NN_MAX_ROWS", max_rows)
        patch.setattr(cpu, "AVX512_NT_MAX_ROWS", max_rows)
        _check(counts, k, n, torch.float32, transposed_weight=transposed_weight, seed=seed)


@pytest.mark.parametrize("transposed_weight", [False, True])
def test_avx512_few_rows_products_write_every_row_under_poison(avx512, poisoned_memory, transposed_weight):
    counts = [0, 7, 0, 3, 33, 0, 16]
    x, w, _ = gmm_inputs(counts, 50, 97, transposed_weight=transposed_weight)
    dy = torch.randn(x.shape[0], 97)
    ends = torch.tensor(counts).cumsum(0)
    assert cpu._few_rows_product(x, w, ends) is not None  # forward: nn for [E, K, N], nt for [E, N, K]
    assert cpu._few_rows_product(dy, w.transpose(1, 2), ends) is not None  # grad_input: the other
    dx_ref, _ = reference_grouped_matmul_grads(x, w, counts, dy)
    for _ in range(2):
        assert_rel_close(
            get_backend("cpu").forward(x, w, ends), reference_grouped_matmul(x, w, counts), 1e-5, "forward"
        )
        assert_rel_close(get_backend("cpu").grad_input(dy, w, ends), dx_ref, 1e-5, "grad_input")
    strided = w[:, ::2, ::2]  # neither rows nor columns contiguous: MKL's GEMMs
    assert cpu._few_rows_product(x[:, : strided.shape[1]], strided, ends) is None


@pytest.mark.parametrize("k, n", [(0, 64), (64, 0)], ids=["no_depth_forward", "no_depth_grad_input"])
def test_avx512_products_over_an_empty_depth_are_zero(avx512, poisoned_memory, k, n):
    # Experts of few rows (the dot products) and of many (the register blocks) alike.
    counts = [40, 0, 20, 3]
    x, w, _ = gmm_inputs(counts, k, n)
    dy = torch.randn(x.shape[0], n)
    ends = torch.tensor(counts).cumsum(0)
    for _ in range(2):  # first into fresh (NaN) outputs, then into the recycled ones
        assert bool((get_backend("cpu").forward(x, w, ends) == 0).all())
        assert bool((get_backend("cpu").grad_input(dy, w, ends) == 0).all())


def test_avx512_register_blocks_do_not_depend_on_thread_count(avx512, monkeypatch):
    # nn (forward of [E, K, N]) on every expert's blocks, nt (its grad_input) on experts of 24 rows and more
    monkeypatch.setattr(cpu, "AVX512_NN_MAX_ROWS", 4096)
    monkeypatch.setattr(cpu, "AVX512_NT_MAX_ROWS", 4096)
    counts = [40, 0, 70, 3, 33, 130, 17]
    x, w, _ = gmm_inputs(counts, 300, 130)
    dy = torch.randn(x.shape[0], 130)
    ends = torch.tensor(counts).cumsum(0)
    assert cpu._few_rows_product(x, w, ends) is not None
    assert cpu._few_rows_product(dy, w.transpose(1, 2), ends) is not None
    _same_at_every_thread_count(lambda: get_backend("cpu").forward(x, w, ends))
    _same_at_every_thread_count(lambda: get_backend("cpu").grad_input(dy, w, ends))


def test_avx512_nt_few_rows_does_not_depend_on_thread_count(avx512):
    counts = [40, 0, 3, 9, 17, 1]
    x, w, _ = gmm_inputs(counts, 70, 300)
    dy = torch.randn(x.shape[0], 300)
    ends = torch.tensor(counts).cumsum(0)
    _same_at_every_thread_count(lambda: get_backend("cpu").grad_input(dy, w, ends))


# --- one library GEMM per expert, whole experts per thread (experts_mm, experts_mm_tn) ----------


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


def test_experts_strategy_choice(experts_ops, monkeypatch):
    # float32: MKL's own split between threads was as fast with few large experts
    x8, w8, _ = gmm_inputs([30] * 8, 32, 16)
    x20, w20, _ = gmm_inputs([30] * 20, 32, 16)
    assert cpu._experts_product(x8, w8, torch.tensor([30] * 8).cumsum(0)) is None
    assert cpu._experts_product(x20, w20, torch.tensor([30] * 20).cumsum(0)) is not None
    xb, wb = x8.to(torch.bfloat16), w8.to(torch.bfloat16)  # 16-bit: from any number of experts
    assert cpu._experts_product(xb, wb, torch.tensor([30] * 8).cumsum(0)) is not None
    monkeypatch.setattr(cpu, "USE_EXPERTS_MM", False)
    assert cpu._experts_product(xb, wb, torch.tensor([30] * 8).cumsum(0)) is None
