"""GroupedExperts: vs the float64 reference, fused vs eager, and bad inputs."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.layers import GroupedExperts
from moe_gmm.testing import (
    assert_rel_close,
    reference_expert_mlp,
    reference_permute,
    reference_unpermute,
    routing_ids,
    tolerance_for,
)

E, H, INTER = 6, 16, 8


def _routing(num_tokens, top_k, routing="uniform", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = routing_ids(num_tokens, top_k, E, routing, generator=g)
    probs = torch.rand(num_tokens, top_k, generator=g)
    return ids, probs


@pytest.mark.parametrize("routing", ["uniform", "empty", "duplicate_topk"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_vs_reference(fused, routing):
    experts = GroupedExperts(E, H, INTER, use_grouped_expert_matmul=fused)
    ids, probs = _routing(30, 3, routing)
    x = torch.randn(30, H, requires_grad=True)
    probs.requires_grad_(True)
    out = experts(x, ids, probs)
    assert out.shape == (30, H)

    leaves = [t.detach().double().requires_grad_(True) for t in (x, experts.gate_up_proj, experts.down_proj, probs)]
    # Reference: permute by loop, per-expert loop MLP, weighted combine by loop (all float64).
    _, rows, counts = reference_permute(x, ids, E)
    order = torch.argsort(rows.reshape(-1))
    permuted = leaves[0][order // 3]
    ref_rows_out = reference_expert_mlp(permuted, leaves[1], leaves[2], counts)
    ref = (ref_rows_out[rows] * leaves[3].unsqueeze(-1)).sum(1)
    assert_rel_close(out, reference_unpermute(ref_rows_out, rows, probs), 1e-5, "out vs loop combine")
    assert_rel_close(out, ref, 1e-5, "out")
    assert torch.equal(experts.last_tokens_per_expert, counts)

    dy = torch.randn(30, H)
    out.backward(dy)
    ref.backward(dy.double())
    for name, got, want in zip(
        ("x", "gate_up", "down", "probs"), (x, experts.gate_up_proj, experts.down_proj, probs), leaves
    ):
        assert_rel_close(got.grad, want.grad, 1e-5, f"d {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_vs_eager(dtype):
    fused = GroupedExperts(E, H, INTER).to(dtype)
    eager = GroupedExperts(E, H, INTER, use_grouped_expert_matmul=False).to(dtype)
    eager.load_state_dict(fused.state_dict())
    ids, probs = _routing(40, 2, "skewed")
    x = torch.randn(40, H).to(dtype)
    outs, grads = [], []
    for m in (fused, eager):
        xi = x.clone().requires_grad_(True)
        o = m(xi, ids, probs)
        o.float().square().sum().backward()
        outs.append(o)
        grads.append((xi.grad, m.gate_up_proj.grad, m.down_proj.grad))
    tol = tolerance_for(dtype)
    torch.testing.assert_close(outs[0], outs[1], rtol=tol.rtol, atol=tol.atol)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol)


def test_zero_tokens():
    experts = GroupedExperts(E, H, INTER)
    x = torch.zeros(0, H, requires_grad=True)
    out = experts(x, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2))
    out.sum().backward()
    assert out.shape == (0, H) and not experts.gate_up_proj.grad.any()


def test_bad_inputs():
    experts = GroupedExperts(E, H, INTER)
    ids, probs = _routing(4, 2)
    with pytest.raises(ValueError, match="hidden_TH"):
        experts(torch.randn(4, H + 1), ids, probs)
    with pytest.raises(TypeError, match="hidden_TH dtype"):
        experts(torch.randn(4, H, dtype=torch.float64), ids, probs)
    with pytest.raises(ValueError, match="top_k_weights_Tk"):
        experts(torch.randn(4, H), ids, probs[:, :1])
    with pytest.raises(ValueError, match="selected_experts_Tk ids"):
        experts(torch.randn(4, H), ids + E, probs)
    with pytest.raises(ValueError, match="intermediate_size"):
        GroupedExperts(E, H, 0)
