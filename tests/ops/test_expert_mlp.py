"""expert_mlp (GMM -> swiglu -> GMM) vs the float64 loop reference, fused vs eager, HF layouts."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.ops import expert_mlp
from moe_gmm.testing import assert_rel_close, group_counts, reference_expert_mlp, tolerance_for

HIDDEN, INTER = 16, 8


def _weights(num_experts, dtype, *, hf_layout, seed=0):
    """(gate_up [E, H, 2I], down [E, I, H]) as plain tensors or as transposed views of HF-layout leaves."""
    g = torch.Generator().manual_seed(seed)
    if hf_layout:
        gate_up_leaf = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5).to(dtype)
        down_leaf = (torch.randn(num_experts, HIDDEN, INTER, generator=g) / INTER**0.5).to(dtype)
    else:
        gate_up_leaf = (torch.randn(num_experts, HIDDEN, 2 * INTER, generator=g) / HIDDEN**0.5).to(dtype)
        down_leaf = (torch.randn(num_experts, INTER, HIDDEN, generator=g) / INTER**0.5).to(dtype)
    return gate_up_leaf.requires_grad_(True), down_leaf.requires_grad_(True)


def _views(gate_up_leaf, down_leaf, hf_layout):
    if hf_layout:
        return gate_up_leaf.transpose(1, 2), down_leaf.transpose(1, 2)
    return gate_up_leaf, down_leaf


@pytest.mark.parametrize("hf_layout", [False, True], ids=["ours", "hf_transposed"])
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("routing", ["uniform", "empty", "skewed"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_vs_reference_forward_backward(fused, routing, dtype, hf_layout):
    num_experts = 6
    counts = group_counts(40, num_experts, routing, generator=torch.Generator().manual_seed(3))
    x = torch.randn(sum(counts), HIDDEN, generator=torch.Generator().manual_seed(4)).to(dtype).requires_grad_(True)
    gate_up_leaf, down_leaf = _weights(num_experts, dtype, hf_layout=hf_layout)
    y = expert_mlp(x, torch.tensor(counts), *_views(gate_up_leaf, down_leaf, hf_layout), fused=fused)
    assert y.shape == x.shape and y.dtype == dtype

    ref_leaves = [t.detach().double().requires_grad_(True) for t in (x, gate_up_leaf, down_leaf)]
    ref = reference_expert_mlp(ref_leaves[0], *_views(ref_leaves[1], ref_leaves[2], hf_layout), counts)
    limit = tolerance_for(dtype).rel
    assert_rel_close(y, ref, limit, "y")

    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(dtype)
    y.backward(dy)
    ref.backward(dy.double())
    for name, got, want in zip(("x", "gate_up", "down"), (x, gate_up_leaf, down_leaf), ref_leaves):
        assert got.grad.shape == got.shape, name  # grads land on the leaf layout, never a copy's
        assert_rel_close(got.grad, want.grad, limit, f"d {name}")
    empty = [e for e, c in enumerate(counts) if c == 0]
    if empty:
        assert not gate_up_leaf.grad[empty].any() and not down_leaf.grad[empty].any()


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_fused_matches_eager(dtype):
    counts = group_counts(64, 8, "uneven", generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    gate_up, down = _weights(8, dtype, hf_layout=True)
    args = (x, counts, *_views(gate_up.detach(), down.detach(), True))
    tol = tolerance_for(dtype)
    torch.testing.assert_close(
        expert_mlp(*args, fused=True), expert_mlp(*args, fused=False), rtol=tol.rtol, atol=tol.atol
    )


def test_zero_rows_and_cumsum_group_list():
    gate_up, down = _weights(3, torch.float32, hf_layout=False)
    y = expert_mlp(torch.zeros(0, HIDDEN), [0, 0, 0], gate_up, down)
    assert y.shape == (0, HIDDEN)
    x = torch.randn(5, HIDDEN)
    a = expert_mlp(x, [2, 0, 3], gate_up, down)
    b = expert_mlp(x, [2, 2, 5], gate_up, down, group_list_type="cumsum")
    assert torch.equal(a, b)


def test_bad_inputs():
    gate_up, down = _weights(3, torch.float32, hf_layout=False)
    x = torch.randn(5, HIDDEN)
    with pytest.raises(ValueError, match="down_EIH"):
        expert_mlp(x, [2, 0, 3], gate_up, down[:2])
    with pytest.raises(ValueError, match="gate_up_EH2I"):
        expert_mlp(x, [2, 0, 3], gate_up[..., :-1], down)
    with pytest.raises(ValueError, match="gate_up_EH2I"):
        expert_mlp(x, [2, 0, 3], gate_up[0], down)
    with pytest.raises(ValueError, match="sum"):
        expert_mlp(x, [2, 0, 2], gate_up, down)
    with pytest.raises(ValueError, match="x.shape"):
        expert_mlp(torch.randn(5, HIDDEN + 1), [2, 0, 3], gate_up, down)


def test_fullgraph_compile_with_profiler_labels():
    from moe_gmm import permute, unpermute

    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, HIDDEN, generator=g)
    ids = torch.randint(0, 4, (10, 2), generator=g)
    probs = torch.rand(10, 2, generator=g)
    gate_up, down = _weights(4, torch.float32, hf_layout=True)

    def routed(h, gu, dn):
        permuted, row_id_map, counts = permute(h, ids, 4, validate=False)
        y = expert_mlp(permuted, counts, gu.transpose(1, 2), dn.transpose(1, 2), validate=False)
        return unpermute(y, row_id_map, probs)

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down)]
    compiled_leaves = [t.detach().clone().requires_grad_(True) for t in (x, gate_up, down)]
    routed(*leaves).sum().backward()
    torch.compile(routed, fullgraph=True, backend="aot_eager")(*compiled_leaves).sum().backward()
    for a, b in zip(compiled_leaves, leaves):
        assert_rel_close(a.grad, b.grad, 1e-6, "compiled grad")
