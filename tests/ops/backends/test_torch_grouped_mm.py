"""Quirks of torch's native grouped_mm that the torch backend must absorb."""

from __future__ import annotations

import torch

from moe_gmm import grouped_matmul
from moe_gmm.ops.backends import get_backend
from moe_gmm.testing import gmm_inputs, reference_grouped_matmul

TORCH = get_backend("torch")


def test_refuses_unaligned_k_or_n_with_a_reason():
    x, w, _ = gmm_inputs([2, 2], 12, 16, torch.bfloat16)
    reason = TORCH.refusal(x, w)
    assert reason is not None and "K and N multiples of 8" in reason and "K=12" in reason
    x32, w32, _ = gmm_inputs([2, 2], 12, 16, torch.float32)
    assert TORCH.refusal(x32, w32) is None  # 12 fp32 = 48 bytes: aligned


def test_kernel_refuses_zero_widths_which_the_op_answers_without_it():
    for k, n in ((0, 16), (16, 0)):
        x, w, _ = gmm_inputs([2, 0, 3], k, n)
        assert f"K={k}, N={n}" in TORCH.refusal(x, w)
        assert TORCH.op_refusal(x, w) is None
        assert torch.equal(grouped_matmul(x, w, [2, 0, 3], backend="torch"), torch.zeros(5, n))
        assert torch.equal(grouped_matmul(x, w, [2, 0, 3]), torch.zeros(5, n))


def test_refuses_float64():
    x, w, _ = gmm_inputs([2, 2], 16, 16, torch.float64)
    assert "float64" in TORCH.refusal(x, w)


def test_padded_weight_slice_and_column_strided_input():
    counts = [3, 0, 5]
    x_wide = torch.randn(8, 32)
    x = x_wide[:, ::2]  # neither last stride is 1: the kernel rejects it natively
    w_padded = torch.randn(3, 16, 24)[..., :16]
    y = grouped_matmul(x, w_padded, counts, backend="torch")
    torch.testing.assert_close(y.double(), reference_grouped_matmul(x, w_padded, counts), rtol=1e-5, atol=1e-5)


def test_int64_group_list_is_converted_for_the_kernel():
    x, w, group_list = gmm_inputs([4, 4], 16, 16)
    assert group_list.dtype == torch.int64
    y = grouped_matmul(x, w, group_list, backend="torch")
    torch.testing.assert_close(y.double(), reference_grouped_matmul(x, w, [4, 4]), rtol=1e-5, atol=1e-5)
