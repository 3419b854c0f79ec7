"""permute / unpermute vs the float64 loop references in moe_gmm.testing, forward and backward."""

from __future__ import annotations

import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm import grouped_matmul, permute, unpermute
from moe_gmm.testing import (
    ROUTINGS,
    assert_rel_close,
    reference_permute,
    reference_permute_grad,
    reference_unpermute,
    reference_unpermute_grads,
    routing_ids,
    tolerance_for,
)

DTYPES = (torch.float32, torch.bfloat16)

# Every test runs on the native CPU kernels and on the composed torch ops (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("glue_path")


def _inputs(num_tokens, top_k, num_experts, hidden, routing, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = routing_ids(num_tokens, top_k, num_experts, routing, generator=g)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    probs = torch.rand(num_tokens, top_k, generator=g)
    return x, ids, probs


def _check_round_trip(num_tokens, top_k, num_experts, hidden, routing, dtype, seed=0):
    """Forward and backward of permute then unpermute against the references."""
    x, ids, probs = _inputs(num_tokens, top_k, num_experts, hidden, routing, dtype, seed)
    x.requires_grad_(True)
    permuted, row_id_map, counts = permute(x, ids, num_experts)
    ref_permuted, ref_rows, ref_counts = reference_permute(x, ids, num_experts)

    # permute is a copy: exact in every dtype.
    assert permuted.dtype == dtype and row_id_map.dtype == torch.int64 and counts.dtype == torch.int64
    assert torch.equal(counts, ref_counts)
    assert torch.equal(row_id_map.view(num_tokens, top_k), ref_rows)
    assert torch.equal(permuted.double(), ref_permuted)

    # Expert outputs: poison-free random values, then the weighted combine.
    g = torch.Generator().manual_seed(seed + 1)
    expert_out = torch.randn(permuted.shape, generator=g).to(dtype).requires_grad_(True)
    probs.requires_grad_(True)
    out = unpermute(expert_out, row_id_map, probs)
    assert out.shape == (num_tokens, hidden) and out.dtype == dtype
    limit = tolerance_for(dtype).rel
    assert_rel_close(out, reference_unpermute(expert_out, ref_rows, probs), limit, "unpermute")

    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(grad_out)
    ref_dy, ref_dp = reference_unpermute_grads(expert_out, ref_rows, probs, grad_out)
    assert_rel_close(expert_out.grad, ref_dy, limit, "d expert_out")
    assert_rel_close(probs.grad, ref_dp, limit, "d probs")

    grad_permuted = torch.randn(permuted.shape, generator=g).to(dtype)
    permuted.backward(grad_permuted)
    assert_rel_close(x.grad, reference_permute_grad(grad_permuted, ref_rows), limit, "d hidden")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_round_trip_matches_reference(routing, dtype):
    _check_round_trip(num_tokens=24, top_k=3, num_experts=8, hidden=16, routing=routing, dtype=dtype)


@pytest.mark.parametrize(
    "num_tokens, top_k, num_experts",
    [
        (0, 2, 4),  # no tokens
        (17, 1, 4),  # top-1
        (9, 10, 16),  # k = 10
        (40, 4, 512),  # many experts, most empty
        (6, 4, 1),  # one expert takes everything
    ],
)
def test_edge_shapes(num_tokens, top_k, num_experts):
    routing = "uniform" if top_k <= num_experts else "duplicate_topk"
    _check_round_trip(num_tokens, top_k, num_experts, hidden=8, routing=routing, dtype=torch.float32)


def test_duplicate_expert_in_one_token():
    ids = torch.tensor([[2, 2, 0], [1, 2, 2]])
    x = torch.randn(2, 4)
    permuted, row_id_map, counts = permute(x, ids, 3)
    assert counts.tolist() == [1, 1, 4]
    # expert 2 rows, stable in (token, slot) order: (0,0), (0,1), (1,1), (1,2)
    assert row_id_map.tolist() == [2, 3, 0, 1, 4, 5]
    assert torch.equal(permuted[2:], torch.stack([x[0], x[0], x[1], x[1]]))


def test_row_id_map_is_a_permutation_and_rows_are_sorted():
    x, ids, _ = _inputs(50, 4, 7, 4, "skewed", torch.float32)
    _, row_id_map, counts = permute(x, ids, 7)
    assert torch.equal(torch.sort(row_id_map).values, torch.arange(200))
    expert_of_row = torch.empty(200, dtype=torch.int64)
    expert_of_row[row_id_map] = ids.reshape(-1)
    assert torch.equal(expert_of_row, torch.sort(expert_of_row).values)
    assert torch.equal(torch.repeat_interleave(torch.arange(7), counts), expert_of_row)


def test_int32_ids_accepted():
    x, ids, _ = _inputs(10, 2, 4, 4, "uniform", torch.float32)
    a = permute(x, ids, 4)
    b = permute(x, ids.int(), 4)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_unpermute_accumulates_bf16_in_float32():
    # 1 + 3 * 2^-8: a bf16 running sum rounds every 1 + 2^-8 back to 1 (half an ulp, ties to even);
    # a float32 sum rounded once gives 1 + 2^-6 (the tie 1 + 3 * 2^-8 rounds to the even mantissa).
    expert_out = torch.tensor([[1.0], [2.0**-8], [2.0**-8], [2.0**-8]], dtype=torch.bfloat16)
    out = unpermute(expert_out, torch.arange(4), torch.ones(1, 4))
    assert out.item() == 1.0 + 2.0**-6
    running = expert_out[0]
    for j in range(1, 4):
        running = running + expert_out[j]
    assert running.item() == 1.0  # what the test guards against


def test_gradcheck_float64():
    x, ids, probs = _inputs(5, 3, 4, 3, "duplicate_topk", torch.float64)
    x.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h: permute(h, ids, 4)[0], (x,))
    _, row_id_map, _ = permute(x.detach(), ids, 4)
    y = torch.randn(15, 3, dtype=torch.float64, requires_grad=True)
    p = probs.double().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: unpermute(a, row_id_map, b), (y, p))


def test_deterministic_bitwise():
    x, ids, probs = _inputs(64, 4, 8, 32, "duplicate_topk", torch.bfloat16)
    results = []
    for _ in range(2):
        xr = x.clone().requires_grad_(True)
        pr = probs.clone().requires_grad_(True)
        permuted, row_id_map, _ = permute(xr, ids, 8)
        out = unpermute(permuted * 3, row_id_map, pr)
        out.float().square().sum().backward()
        results.append((out, xr.grad, pr.grad))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_opcheck_custom_ops():
    x, ids, probs = _inputs(6, 2, 4, 4, "duplicate_topk", torch.float32)
    torch.library.opcheck(torch.ops.moe_gmm.permute.default, (x.requires_grad_(True), ids, 4))
    _, row_id_map, _ = permute(x.detach(), ids, 4)
    y = torch.randn(12, 4, requires_grad=True)
    torch.library.opcheck(torch.ops.moe_gmm.unpermute.default, (y, row_id_map, probs.requires_grad_(True)))


def test_fullgraph_compile_permute_gmm_unpermute():
    x, ids, probs = _inputs(12, 2, 4, 8, "uneven", torch.float32)
    w = torch.randn(4, 8, 8) / 8**0.5

    def layer(h, w_, p):
        permuted, row_id_map, counts = permute(h, ids, 4, validate=False)
        y = grouped_matmul(permuted, w_, counts, validate=False)
        return unpermute(y, row_id_map, p)

    args = [t.clone().requires_grad_(True) for t in (x, w, probs)]
    compiled_args = [t.clone().requires_grad_(True) for t in (x, w, probs)]
    expected = layer(*args)
    expected.square().sum().backward()
    got = torch.compile(layer, fullgraph=True, backend="aot_eager")(*compiled_args)
    got.square().sum().backward()
    assert_rel_close(got, expected, 1e-6, "compiled out")
    for a, b in zip(compiled_args, args):
        assert_rel_close(a.grad, b.grad, 1e-6, "compiled grad")


@settings(max_examples=15, deadline=None)
@given(
    num_tokens=st.integers(0, 20),
    top_k=st.integers(1, 5),
    num_experts=st.integers(1, 9),
    hidden=st.integers(1, 9),
    seed=st.integers(0, 1000),
)
def test_random_shapes(num_tokens, top_k, num_experts, hidden, seed):
    _check_round_trip(num_tokens, top_k, num_experts, hidden, "duplicate_topk", torch.float32, seed)


# ---------------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------------


def test_permute_rejects_bad_inputs():
    x = torch.randn(4, 3)
    ids = torch.tensor([[0, 1]] * 4)
    with pytest.raises(ValueError, match="selected_experts_Tk ids"):
        permute(x, ids + 1, 2)
    with pytest.raises(ValueError, match="selected_experts_Tk ids"):
        permute(x, ids - 1, 2)
    with pytest.raises(TypeError, match="selected_experts_Tk"):
        permute(x, ids.float(), 2)
    with pytest.raises(TypeError, match="hidden_TH"):
        permute(x.long(), ids, 2)
    with pytest.raises(ValueError, match="hidden_TH"):
        permute(x.view(4, 3, 1), ids, 2)
    with pytest.raises(ValueError, match="selected_experts_Tk.shape"):
        permute(x[:3], ids, 2)
    with pytest.raises(ValueError, match="num_experts"):
        permute(x, ids, 0)
    with pytest.raises(ValueError, match="k >= 1"):
        permute(x, ids[:, :0], 2)


def test_unpermute_rejects_bad_inputs():
    y = torch.randn(8, 3)
    rows = torch.arange(8)
    probs = torch.rand(4, 2)
    with pytest.raises(TypeError, match="row_id_map_R"):
        unpermute(y, rows.int(), probs)
    with pytest.raises(TypeError, match="row_id_map_R"):
        unpermute(y, rows.float(), probs)
    with pytest.raises(ValueError, match="probs_Tk"):
        unpermute(y, rows, probs[:3])
    with pytest.raises(ValueError, match="expert_out_RH"):
        unpermute(y[:6], rows, probs)
    with pytest.raises(TypeError, match="probs_Tk"):
        unpermute(y, rows, probs.long())
    with pytest.raises(ValueError, match="probs_Tk"):
        unpermute(y, rows, probs.view(8))


def _routed(num_tokens=4, top_k=2, num_experts=3, hidden=3):
    x, ids, probs = _inputs(num_tokens, top_k, num_experts, hidden, "uneven", torch.float32)
    permuted, row_id_map, _ = permute(x, ids, num_experts)
    return permuted, row_id_map, probs


@pytest.mark.parametrize("bad", [-1, 8, 10**6, -(2**63), 2**63 - 1])
@pytest.mark.parametrize("validate", [True, False])
def test_unpermute_refuses_a_map_value_out_of_range(bad, validate):
    # Such a value read (and in backward wrote) outside expert_out's rows.
    permuted, row_id_map, probs = _routed()
    row_id_map[3] = bad
    if validate:
        with pytest.raises(
            ValueError, match=rf"row_id_map_R values must lie in \[0, R = 8\).*row_id_map_R\[3\] = {bad}"
        ):
            unpermute(permuted, row_id_map, probs)
    else:  # the kernels' own bounds check (native) or index_select's (composed)
        with pytest.raises((ValueError, IndexError), match=r"row_id_map\[3\]|index out of range"):
            unpermute(permuted, row_id_map, probs, validate=False)


def test_unpermute_refuses_a_map_that_is_not_a_permutation():
    permuted, row_id_map, probs = _routed()
    with pytest.raises(ValueError, match=r"permutation of range\(8\).*row 1 is never referenced"):
        unpermute(permuted, torch.zeros_like(row_id_map), probs)
    twice = row_id_map.clone()
    twice[5] = twice[4]
    with pytest.raises(ValueError, match="permutation"):
        unpermute(permuted, twice, probs)


def test_unpermute_with_top_k_refuses_transposed_probs():
    permuted, row_id_map, probs = _routed(num_tokens=6, top_k=2)
    with pytest.raises(ValueError, match=r"probs_Tk must be \[T, k\] with k = top_k = 2, got shape \(2, 6\)"):
        unpermute(permuted, row_id_map, probs.reshape(2, 6), top_k=2)
    torch.testing.assert_close(unpermute(permuted, row_id_map, probs, top_k=2), unpermute(permuted, row_id_map, probs))
    with pytest.raises(TypeError, match="top_k must be an int"):
        unpermute(permuted, row_id_map, probs, top_k=2.0)


@pytest.mark.parametrize("bad", [-1, 3, 2**31 - 1])
def test_permute_unchecked_ids_still_raise(bad):
    # validate=False promises the ids are in range; the kernels refuse one that is not anyway.
    x, ids, _ = _inputs(4, 2, 3, 3, "uneven", torch.float32)
    ids[2, 1] = bad
    with pytest.raises(ValueError, match="expert id|selected_experts_Tk"):
        permute(x, ids, 3, validate=False)
    with pytest.raises(ValueError, match=rf"got {bad} at index \(2, 1\)"):
        permute(x, ids, 3)


def test_validate_flags_must_be_bool():
    permuted, row_id_map, probs = _routed()
    with pytest.raises(TypeError, match="validate must be a bool"):
        unpermute(permuted, row_id_map, probs, validate="no")
    x, ids, _ = _inputs(4, 2, 3, 3, "uneven", torch.float32)
    with pytest.raises(TypeError, match="validate must be a bool"):
        permute(x, ids, 3, validate=0)
    with pytest.raises(TypeError, match="num_experts"):
        permute(x, ids, 3.0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unchecked_paths_match_checked(dtype):
    x, ids, probs = _inputs(9, 3, 4, 16, "uneven", dtype)
    expert_out = torch.randn(27, 16).to(dtype)
    results = []
    for validate in (True, False):
        xs, ps, ys = (t.clone().requires_grad_(True) for t in (x, probs, expert_out))
        permuted, row_id_map, counts = permute(xs, ids, 4, validate=validate)
        out = unpermute(ys, row_id_map, ps, validate=validate)
        (out.sum() + permuted.sum()).backward()
        results.append((permuted, row_id_map, counts, out, xs.grad, ps.grad, ys.grad))
    for checked, unchecked in zip(*results):
        assert torch.equal(checked, unchecked)


def test_every_output_element_is_written(poisoned_memory):
    # Uninitialised memory is NaN here: the row scatter in unpermute's backward must cover every row.
    _check_round_trip(num_tokens=10, top_k=3, num_experts=5, hidden=8, routing="duplicate_topk", dtype=torch.float32)
    _check_round_trip(num_tokens=10, top_k=3, num_experts=8, hidden=8, routing="empty", dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", (*DTYPES, torch.float16), ids=str)
@pytest.mark.parametrize("chunk_tokens", [1, 3, 7])
def test_chunked_reductions_match_reference(monkeypatch, dtype, chunk_tokens):
    # Real shapes fit one chunk in these tests; shrink the chunk so every loop runs many times,
    # with a last chunk shorter than the others.
    permute_module = importlib.import_module("moe_gmm.ops.permute")  # the module; the package exports the function

    top_k, hidden = 3, 16
    row_bytes = top_k * hidden * 4
    monkeypatch.setattr(permute_module, "_CHUNK_BYTES", chunk_tokens * row_bytes)
    assert permute_module._token_step(top_k, hidden, torch.float32) == chunk_tokens
    _check_round_trip(num_tokens=23, top_k=top_k, num_experts=5, hidden=hidden, routing="uneven", dtype=dtype)
