"""The ``cpu`` backend's native bfloat16 kernels (``kernels``): AMX tiles and AVX-512 BF16, the same
three products (nn, nt, tn) for widths that are multiples of 32, larger experts one library GEMM each.

Every test runs once per family this CPU has (the ``bf16_family`` fixture skips the others: the AMX
runs need an x86 CPU with AMX-BF16).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_gmm.ops import native
from moe_gmm.ops.backends import cpu, get_backend
from moe_gmm.ops.backends.cpu import kernels
from moe_gmm.testing import (
    assert_rel_close,
    gmm_inputs,
    reference_grouped_matmul,
    reference_grouped_matmul_grads,
    tolerance_for,
)
from tests.helpers.cpu_checks import check_cpu

BF16_LIMITS = {
    "amx": ("amx_nn_max_rows", "amx_nt_max_rows", "amx_grad_weight_max_rows"),
    "avx512_bf16": ("avx512_bf16_nn_max_rows", "avx512_bf16_nt_max_rows", "avx512_bf16_grad_weight_max_rows"),
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
    with cpu.use_tuning(use_amx=family == "amx"):  # on a CPU with AMX, test the AVX-512 kernels too
        yield family


def _assert_takes_bf16_kernels(family, counts, k, n, transposed_weight=False):
    x, w, _ = gmm_inputs(counts, k, n, torch.bfloat16, transposed_weight=transposed_weight)
    assert kernels.weight_layout(w) == ("ENK" if transposed_weight else "EKN")
    chosen = kernels.bf16_kernels(x, w, widths=(k, n))
    assert chosen is not None and chosen.family == family, f"these inputs should take the {family} kernels"


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
    with cpu.use_tuning(**dict.fromkeys(BF16_LIMITS[bf16_family], 10**9)):  # the kernels at every row count
        check_cpu(counts, k, n, torch.bfloat16, transposed_weight=transposed_weight, seed=seed)


@pytest.mark.parametrize("limit", range(3), ids=["nn", "nt", "tn"])
@pytest.mark.parametrize("transposed_weight", [False, True])  # nn is the forward of EKN, the grad_input of ENK
def test_bf16_kernels_hand_large_experts_to_library_gemms(bf16_family, limit, transposed_weight):
    field = BF16_LIMITS[bf16_family][limit]
    with cpu.use_tuning(**{field: 8}):
        _assert_takes_bf16_kernels(bf16_family, [3, 20, 0, 9, 8, 40], 64, 32, transposed_weight)
        check_cpu([3, 20, 0, 9, 8, 40], 64, 32, torch.bfloat16, transposed_weight=transposed_weight)
    with cpu.use_tuning(**{field: 0}):  # every expert large
        check_cpu([20, 0, 9], 64, 32, torch.bfloat16, transposed_weight=transposed_weight)


def test_bf16_kernels_take_experts_of_hundreds_of_rows(bf16_family):
    # AVX-512 BF16: the pair blocks keep the float32 sums of all of an expert's rows between depth chunks
    with cpu.use_tuning(**dict.fromkeys(BF16_LIMITS[bf16_family], 10**9)):
        check_cpu([300, 2, 530], 64, 96, torch.bfloat16, transposed_weight=False)


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
        family_kernels = kernels.Bf16Kernels(bf16_family, native.ops())
        for product, weight in (("nn", torch.empty(3, 0, 64)), ("nt", torch.empty(3, 64, 0))):
            out = torch.full((x.shape[0], 64), float("nan"), dtype=torch.bfloat16)
            family_kernels.op(product)(empty_x, weight.to(torch.bfloat16), ends, 256, out)
            assert torch.equal(out, torch.zeros_like(out)), product


def test_bf16_kernels_expanded_grad_output(bf16_family):
    check_cpu([3, 0, 40], 32, 64, torch.bfloat16, expanded_grad=True)


def test_bf16_kernels_many_mostly_empty_experts(bf16_family):
    counts = [0] * 300
    for e, c in ((3, 5), (100, 1), (299, 40), (256, 17)):
        counts[e] = c
    check_cpu(counts, 32, 64, torch.bfloat16)


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
    assert kernels.bf16_kernels(x, w, widths=(48, 32)) is None
    check_cpu([3, 4], 48, 32, torch.bfloat16)


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
        call(kernels.Bf16Kernels(bf16_family, native.ops()).op, a, b, ends, out)


def test_amx_nt_rejects_rows_with_an_odd_stride():
    if not cpu.amx_available():
        pytest.skip("the AMX kernels need an x86 CPU with AMX-BF16 and the native kernels built")
    a = torch.zeros(6, 65, dtype=torch.bfloat16)[:, :64]
    b, out = torch.zeros(2, 64, 64, dtype=torch.bfloat16), torch.zeros(6, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="even"):
        native.ops().amx_gemm_nt(a, b, torch.tensor([2, 6]), 64, out)
