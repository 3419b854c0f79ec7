"""Weight layouts: padded rows and transposed storage, their helpers, and the grouped matmul on them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm import grouped_matmul
from moe_gmm.ops.weight_layout import (
    ROW_PAD_BYTES,
    default_row_pad,
    lay_out_rows,
    lay_out_transposed,
    pad_rows,
    row_padding,
    store_transposed,
    stored_transposed,
)
from moe_gmm.testing import assert_rel_close, reference_grouped_matmul, reference_grouped_matmul_grads


@pytest.mark.parametrize(
    ("dtype", "expected"), [(torch.float32, 16), (torch.bfloat16, 32), (torch.float16, 32), (torch.float64, 8)]
)
def test_default_pad_is_one_cache_line(dtype, expected):
    assert default_row_pad(dtype) == expected
    assert default_row_pad(dtype) * torch.empty((), dtype=dtype).element_size() == ROW_PAD_BYTES


@pytest.mark.parametrize("shape", [(5, 7), (3, 5, 7), (2, 3, 4, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_pad_rows_keeps_values_and_pads_storage(shape, dtype):
    w = torch.randn(shape).to(dtype).requires_grad_()
    padded = pad_rows(w)
    pad = default_row_pad(dtype)
    assert padded.shape == w.shape and padded.dtype == dtype and not padded.requires_grad
    assert torch.equal(padded, w.detach())
    assert padded.stride(-1) == 1 and padded.stride(-2) == shape[-1] + pad
    assert row_padding(padded) == pad
    assert not padded.is_contiguous()
    # the padding is zeroed storage after every row, outside the view
    storage = torch.as_strided(padded, (*shape[:-1], shape[-1] + pad), padded.stride())
    assert torch.equal(storage[..., shape[-1] :], torch.zeros_like(storage[..., shape[-1] :]))
    assert row_padding(pad_rows(w, 4)) == 4


def test_row_padding_of_other_layouts():
    w = torch.randn(4, 6, 8)
    assert row_padding(w) == 0  # contiguous
    assert row_padding(w.transpose(1, 2)) == 0  # columns contiguous, not rows
    assert row_padding(w[..., :6]) == 2  # a column slice is a padded block by definition
    padded = pad_rows(w)
    assert row_padding(padded[1:3]) == 16  # whole experts of a padded block
    assert row_padding(padded[::2]) == 0  # experts skipped: not one block
    assert row_padding(padded[:, ::2]) == 2 * 24 - 8  # every other row: a block of rows 48 apart
    assert row_padding(padded[:, 1:]) == 0  # experts no longer step over whole blocks of its rows
    assert row_padding(torch.empty(0, 6, 8)) == 0
    assert row_padding(torch.randn(8)) == 0


def test_lay_out_rows_keeps_the_parameter_and_its_values():
    param = torch.nn.Parameter(torch.randn(3, 5, 8))
    values = param.detach().clone()
    lay_out_rows(param, True)
    assert row_padding(param) == 16 and torch.equal(param, values) and param.requires_grad
    storage = param.data_ptr()
    lay_out_rows(param, True)  # already padded: left as it is
    assert param.data_ptr() == storage
    lay_out_rows(param, False)
    assert param.is_contiguous() and torch.equal(param, values)
    meta = torch.nn.Parameter(torch.empty(3, 5, 8, device="meta"))
    lay_out_rows(meta, True)  # only CPU weights are padded
    assert meta.is_contiguous()


@pytest.mark.parametrize("pad", [0, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_store_transposed_keeps_values_over_transposed_storage(pad, dtype):
    w = torch.randn(3, 5, 8).to(dtype).requires_grad_()
    stored = store_transposed(w, pad)
    assert stored.shape == w.shape and stored.dtype == dtype and not stored.requires_grad
    assert torch.equal(stored, w.detach()) and stored.stride(-2) == 1
    assert stored_transposed(stored) and not stored_transposed(w)
    assert row_padding(stored.mT) == pad
    assert stored.mT.is_contiguous() == (pad == 0)


def test_stored_transposed_of_other_layouts():
    w = torch.randn(4, 6, 8)
    assert not stored_transposed(w) and not stored_transposed(pad_rows(w))
    assert stored_transposed(w.transpose(1, 2)) and stored_transposed(pad_rows(w).transpose(1, 2))
    assert not stored_transposed(w[..., ::2].transpose(1, 2))  # strided columns: neither layout
    assert not stored_transposed(torch.randn(4, 1, 1)) and not stored_transposed(torch.randn(8))
    assert not stored_transposed(torch.empty(0, 6, 8).transpose(1, 2))


def test_lay_out_transposed_round_trip_keeps_parameter_values_and_padding():
    param = torch.nn.Parameter(torch.randn(3, 5, 8))
    values = param.detach().clone()
    lay_out_transposed(param, True)
    assert stored_transposed(param) and param.mT.is_contiguous() and torch.equal(param, values)
    assert param.requires_grad and param.shape == (3, 5, 8)
    storage = param.data_ptr()
    lay_out_transposed(param, True)  # already so: left as it is
    assert param.data_ptr() == storage
    lay_out_rows(param, True)  # padding pads the transposed storage's own rows
    assert stored_transposed(param) and row_padding(param.mT) == 16 and torch.equal(param, values)
    lay_out_transposed(param, False)  # back to row-major, still padded
    assert not stored_transposed(param) and row_padding(param) == 16 and torch.equal(param, values)
    lay_out_transposed(param, True)
    lay_out_rows(param, False)  # unpadded, still transposed
    assert stored_transposed(param) and param.mT.is_contiguous() and torch.equal(param, values)
    lay_out_transposed(param, False)
    assert param.is_contiguous() and torch.equal(param, values)


def test_transposed_storage_survives_dtype_conversion():
    # Dense strides are preserved by .to(): the layout outlives a model.to(torch.bfloat16).
    stored = store_transposed(torch.randn(2, 4, 6))
    assert stored_transposed(stored.to(torch.bfloat16))


def test_bad_arguments():
    with pytest.raises(TypeError, match="weight"):
        pad_rows([[1.0]])
    with pytest.raises(ValueError, match="weight"):
        pad_rows(torch.randn(8))
    for bad in (0, -4, True, 2.0):
        with pytest.raises(ValueError, match="pad"):
            pad_rows(torch.randn(2, 3), bad)
    with pytest.raises(TypeError, match="weight"):
        row_padding("w")
    with pytest.raises(TypeError, match="dtype"):
        default_row_pad("float32")
    with pytest.raises(TypeError, match="weight"):
        store_transposed(None)
    with pytest.raises(ValueError, match="weight"):
        store_transposed(torch.randn(8))
    for bad in (-1, True, 1.0):
        with pytest.raises(ValueError, match="pad"):
            store_transposed(torch.randn(2, 3), bad)
    with pytest.raises(TypeError, match="weight"):
        stored_transposed(3)


def _random_gmm_inputs(counts, k, n, dtype, seed, *, weight_nk=False):
    """group_list, x [M, k], a weight [E, k, n] ([E, n, k] with weight_nk) scaled by k**-0.5, dy [M, n]."""
    g = torch.Generator().manual_seed(seed)
    m = sum(counts)
    x = torch.randn(m, k, generator=g).to(dtype)
    shape = (len(counts), n, k) if weight_nk else (len(counts), k, n)
    w = (torch.randn(shape, generator=g) / k**0.5).to(dtype)
    dy = torch.randn(m, n, generator=g).to(dtype)
    return torch.tensor(counts), x, w, dy


# Random grouped-matmul problems: uneven and empty groups, widths on and off the kernels' multiples.
_GMM_PROBLEMS = {
    "counts": st.lists(st.integers(0, 24), min_size=1, max_size=6),
    "k": st.sampled_from([8, 16, 48, 64]),
    "n": st.sampled_from([8, 32, 64, 80]),
    "dtype": st.sampled_from([torch.float32, torch.bfloat16]),
    "seed": st.integers(0, 2**16),
}


@settings(max_examples=25, deadline=None)
@given(**_GMM_PROBLEMS)
def test_grouped_matmul_on_padded_weights_is_bit_identical(counts, k, n, dtype, seed):
    """Only the storage differs: forward, grad_input and grad_weight equal the contiguous weight's
    bit for bit (auto backend), and both match the float64 reference."""
    group_list, x, w, dy = _random_gmm_inputs(counts, k, n, dtype, seed)
    results = []
    for weight in (w.clone(), pad_rows(w)):
        xl, wl = x.clone().requires_grad_(), weight.requires_grad_()
        y = grouped_matmul(xl, wl, group_list)
        gx, gw = torch.autograd.grad(y, (xl, wl), dy)
        results.append((y, gx, gw))
    for a, b, name in zip(*results, ("out", "grad_input", "grad_weight"), strict=True):
        assert torch.equal(a, b), name
    ref_y = reference_grouped_matmul(x, w, group_list)
    ref_gx, ref_gw = reference_grouped_matmul_grads(x, w, group_list, dy)
    limit = 1e-5 if dtype == torch.float32 else 2e-2
    for got, want, name in zip(results[1], (ref_y, ref_gx, ref_gw), ("out", "grad_input", "grad_weight"), strict=True):
        assert_rel_close(got, want, limit, name)


@settings(max_examples=25, deadline=None)
@given(**_GMM_PROBLEMS, pad=st.sampled_from([0, 16]))
def test_grouped_matmul_on_input_major_storage(counts, k, n, dtype, pad, seed):
    """A ``[E, N, K]`` weight over ``[E, K, N]`` storage, as ``store_expert_weights_input_major``
    leaves Hugging Face experts, passed transposed: forward and both grads match the row-major
    weight's to rounding (another kernel) and the float64 reference; the weight's grad comes back
    in the parameter's own layout."""
    group_list, x, w_ENK, dy = _random_gmm_inputs(counts, k, n, dtype, seed, weight_nk=True)
    results = []
    for weight in (w_ENK.clone(), store_transposed(w_ENK, pad)):
        xl, wl = x.clone().requires_grad_(), torch.nn.Parameter(weight)
        y = grouped_matmul(xl, wl.transpose(1, 2), group_list)
        y.backward(dy)
        if not pad:  # a dense layout's grad comes in the same strides
            assert wl.grad.stride() == wl.stride()
        results.append((y, xl.grad, wl.grad))
    ref_y = reference_grouped_matmul(x, w_ENK.transpose(1, 2), group_list)
    ref_gx, ref_gw = reference_grouped_matmul_grads(x, w_ENK.transpose(1, 2), group_list, dy)
    limit = 1e-5 if dtype == torch.float32 else 2e-2
    wants = (ref_y, ref_gx, ref_gw.transpose(1, 2))
    for got, want, name in zip(results[1], wants, ("out", "grad_input", "grad_weight"), strict=True):
        assert_rel_close(got, want, limit, name)
    for a, b, name in zip(*results, ("out", "grad_input", "grad_weight"), strict=True):
        assert_rel_close(b, a.double(), limit, name)
