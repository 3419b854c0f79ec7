"""GroupedExperts: vs the float64 reference, fused vs eager, and bad inputs."""

from __future__ import annotations

import copy

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


def _padded_twin(module: GroupedExperts) -> GroupedExperts:
    twin = GroupedExperts(module.num_experts, module.hidden_size, module.intermediate_size, pad_weight_rows=True)
    twin.load_state_dict(module.state_dict())  # copies into the padded storage
    return twin.to(module.gate_up_proj.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("routing", ["uniform", "empty", "skewed"])
def test_padded_weight_rows_give_the_same_bits(dtype, routing):
    """Only the storage differs: output and every gradient equal the contiguous layer's bit for bit,
    and match the float64 reference."""
    plain = GroupedExperts(E, H, 32).to(dtype)  # 2I = 64, H = 16: rows of 256 and 64 bytes
    padded = _padded_twin(plain)
    assert padded.weight_rows_padded and not plain.weight_rows_padded
    assert padded.gate_up_proj.stride(1) == 64 + 64 // padded.gate_up_proj.element_size()
    ids, probs = _routing(40, 3, routing)
    x = torch.randn(40, H).to(dtype)
    dy = torch.randn(40, H).to(dtype)
    results = []
    for m in (plain, padded):
        xi = x.clone().requires_grad_(True)
        out = m(xi, ids, probs)
        results.append((out, *torch.autograd.grad(out, (xi, m.gate_up_proj, m.down_proj), dy)))
    for a, b, name in zip(*results, ("out", "dx", "d gate_up", "d down"), strict=True):
        assert torch.equal(a, b), name

    leaves = [t.detach().double().requires_grad_(True) for t in (x, padded.gate_up_proj, padded.down_proj)]
    _, rows, counts = reference_permute(x, ids, E)
    permuted = leaves[0][torch.argsort(rows.reshape(-1)) // 3]
    ref = (reference_expert_mlp(permuted, leaves[1], leaves[2], counts)[rows] * probs.double().unsqueeze(-1)).sum(1)
    ref_grads = torch.autograd.grad(ref, leaves, dy.double())
    limit = 1e-5 if dtype == torch.float32 else 3e-2
    for got, want, name in zip(results[1], (ref, *ref_grads), ("out", "dx", "d gate_up", "d down"), strict=True):
        assert_rel_close(got, want, limit, name)


def test_padded_layout_follows_the_module():
    m = GroupedExperts(E, H, INTER, pad_weight_rows=True)
    gate_up, down = m.gate_up_proj, m.down_proj
    values = gate_up.detach().clone()
    assert m.weight_rows_padded and "pad_weight_rows=True" in repr(m)

    m.to(torch.bfloat16)  # a conversion copies into contiguous memory; the module lays it out again
    assert m.weight_rows_padded and m.gate_up_proj.stride(1) == 2 * INTER + 32
    m.double()
    assert m.weight_rows_padded and m.gate_up_proj.stride(1) == 2 * INTER + 8

    m.float()
    m.set_weight_row_padding(False)
    assert not m.weight_rows_padded and m.gate_up_proj.is_contiguous() and "pad_weight_rows" not in repr(m)
    m.set_weight_row_padding(True)
    assert m.weight_rows_padded
    # the same Parameter objects throughout (an optimizer built before keeps working)
    assert m.gate_up_proj is gate_up and m.down_proj is down
    torch.testing.assert_close(m.gate_up_proj, values.to(torch.bfloat16).double().float(), rtol=0, atol=0)

    # state_dict holds the parameters (views); loading copies into the padded storage
    state = m.state_dict()
    assert state["gate_up_proj"].data_ptr() == m.gate_up_proj.data_ptr()
    other = GroupedExperts(E, H, INTER)
    m.load_state_dict(other.state_dict())
    assert m.weight_rows_padded and torch.equal(m.down_proj, other.down_proj)
    # assign=True replaces the parameters: contiguous until laid out again
    m.load_state_dict(other.state_dict(), assign=True)
    assert not m.weight_rows_padded and m.pad_weight_rows
    m.float()
    assert m.weight_rows_padded


def test_padded_layout_round_trips_through_torch_save_and_meta(tmp_path):
    m = GroupedExperts(E, H, INTER, pad_weight_rows=True)
    torch.save(m.state_dict(), tmp_path / "experts.pt")
    loaded = torch.load(tmp_path / "experts.pt")
    assert torch.equal(loaded["gate_up_proj"], m.gate_up_proj)

    with torch.device("meta"):
        lazy = GroupedExperts(E, H, INTER, pad_weight_rows=True)
    assert not lazy.weight_rows_padded  # nothing to lay out on the meta device
    lazy.to_empty(device="cpu")
    assert lazy.weight_rows_padded
    lazy.load_state_dict(loaded)
    assert lazy.weight_rows_padded and torch.equal(lazy.down_proj, m.down_proj)


def test_padded_layout_survives_deepcopy_and_pickling(tmp_path):
    m = GroupedExperts(E, H, INTER, pad_weight_rows=True)
    twin = copy.deepcopy(m)
    assert twin.weight_rows_padded and torch.equal(twin.gate_up_proj, m.gate_up_proj)
    assert twin.gate_up_proj.data_ptr() != m.gate_up_proj.data_ptr()
    torch.save(m, tmp_path / "module.pt")
    loaded = torch.load(tmp_path / "module.pt", weights_only=False)
    assert loaded.weight_rows_padded and torch.equal(loaded.down_proj, m.down_proj)
    plain = copy.deepcopy(GroupedExperts(E, H, INTER))
    assert not plain.weight_rows_padded and plain.gate_up_proj.is_contiguous()


def test_optimizer_steps_on_padded_weights_match_contiguous():
    plain = GroupedExperts(E, H, INTER)
    padded = _padded_twin(plain)
    ids, probs = _routing(24, 2, "uneven")
    x = torch.randn(24, H)
    params = []
    for m in (plain, padded):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        for _ in range(3):
            opt.zero_grad()
            m(x, ids, probs).square().mean().backward()
            opt.step()
        params.append((m.gate_up_proj.detach(), m.down_proj.detach()))
    assert padded.weight_rows_padded
    for a, b in zip(*params):
        assert torch.equal(a, b)


def test_padded_layout_bad_arguments():
    with pytest.raises(TypeError, match="pad_weight_rows"):
        GroupedExperts(E, H, INTER, pad_weight_rows=1)
    with pytest.raises(TypeError, match="enabled"):
        GroupedExperts(E, H, INTER).set_weight_row_padding("yes")
