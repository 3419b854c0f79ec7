"""The ``cpu`` backend's native float32 kernels on AVX-512 (``kernels``): grad_weight (tn) and the
forward / grad_input of experts of few rows (nn, nt), larger experts one library GEMM each.

Every test needs an x86 CPU with AVX-512F and the native kernels built (the ``avx512`` fixture).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from moe_gmm.ops import native
from moe_gmm.ops.backends import cpu, get_backend
from moe_gmm.ops.backends.cpu import kernels
from moe_gmm.testing import assert_rel_close, gmm_inputs, reference_grouped_matmul, reference_grouped_matmul_grads
from tests.helpers.cpu_checks import check_cpu, same_at_every_thread_count


@pytest.fixture(scope="module")
def avx512():
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
    with cpu.use_tuning(avx512_grad_weight_max_rows=max_rows):
        x, w, _ = gmm_inputs(counts, k, n, torch.float32)
        assert kernels.avx512_ops(x, w) is not None
        check_cpu(counts, k, n, torch.float32, seed=seed)


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


def test_avx512_grad_weight_of_experts_of_many_rows_vs_float64_and_eager(avx512):
    with cpu.use_tuning(avx512_grad_weight_max_rows=4096):
        check_cpu(PACKED_COUNTS, 101, 150, torch.float32, seed=5)


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


@pytest.mark.parametrize("counts", [[40, 0, 3, 70, 17], PACKED_COUNTS], ids=["few_rows", "many_rows"])
def test_avx512_grad_weight_does_not_depend_on_thread_count(avx512, counts):
    x, _, _ = gmm_inputs(counts, 96, 8)
    dy = torch.randn(x.shape[0], 200)
    ends = torch.tensor(counts).cumsum(0)
    with cpu.use_tuning(avx512_grad_weight_max_rows=4096):
        same_at_every_thread_count(lambda: get_backend("cpu").grad_weight(x, dy, ends))


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
    with cpu.use_tuning(avx512_nn_max_rows=max_rows, avx512_nt_max_rows=max_rows):
        check_cpu(counts, k, n, torch.float32, transposed_weight=transposed_weight, seed=seed)


@pytest.mark.parametrize("transposed_weight", [False, True])
def test_avx512_few_rows_products_write_every_row_under_poison(avx512, poisoned_memory, transposed_weight):
    counts = [0, 7, 0, 3, 33, 0, 16]
    x, w, _ = gmm_inputs(counts, 50, 97, transposed_weight=transposed_weight)
    dy = torch.randn(x.shape[0], 97)
    ends = torch.tensor(counts).cumsum(0)
    assert kernels.few_rows_product(x, w, ends) is not None  # forward: nn for [E, K, N], nt for [E, N, K]
    assert kernels.few_rows_product(dy, w.transpose(1, 2), ends) is not None  # grad_input: the other
    dx_ref, _ = reference_grouped_matmul_grads(x, w, counts, dy)
    for _ in range(2):
        assert_rel_close(
            get_backend("cpu").forward(x, w, ends), reference_grouped_matmul(x, w, counts), 1e-5, "forward"
        )
        assert_rel_close(get_backend("cpu").grad_input(dy, w, ends), dx_ref, 1e-5, "grad_input")
    strided = w[:, ::2, ::2]  # neither rows nor columns contiguous: MKL's GEMMs
    assert kernels.few_rows_product(x[:, : strided.shape[1]], strided, ends) is None


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


def test_avx512_register_blocks_do_not_depend_on_thread_count(avx512):
    # nn (forward of [E, K, N]) on every expert's blocks, nt (its grad_input) on experts of 24 rows and more
    counts = [40, 0, 70, 3, 33, 130, 17]
    x, w, _ = gmm_inputs(counts, 300, 130)
    dy = torch.randn(x.shape[0], 130)
    ends = torch.tensor(counts).cumsum(0)
    with cpu.use_tuning(avx512_nn_max_rows=4096, avx512_nt_max_rows=4096):
        assert kernels.few_rows_product(x, w, ends) is not None
        assert kernels.few_rows_product(dy, w.transpose(1, 2), ends) is not None
        same_at_every_thread_count(lambda: get_backend("cpu").forward(x, w, ends))
        same_at_every_thread_count(lambda: get_backend("cpu").grad_input(dy, w, ends))


def test_avx512_nt_few_rows_does_not_depend_on_thread_count(avx512):
    counts = [40, 0, 3, 9, 17, 1]
    x, w, _ = gmm_inputs(counts, 70, 300)
    dy = torch.randn(x.shape[0], 300)
    ends = torch.tensor(counts).cumsum(0)
    same_at_every_thread_count(lambda: get_backend("cpu").grad_input(dy, w, ends))
