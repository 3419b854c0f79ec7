"""The fused gather/scatter MoE MLP vs the float64 reference and vs the unfused ops.

Runs on the triton backend: compiled with CUDA, else in Triton's CPU interpreter
(``tests/conftest.py`` sets ``TRITON_INTERPRET=1``); tiny shapes keep it fast.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed: the gather/scatter kernels cannot be tested")

from moe_gmm.ops import expert_mlp, permute, unpermute  # noqa: E402
from moe_gmm.ops.gather_gmm import moe_mlp_gather_scatter, routing_rows  # noqa: E402
from moe_gmm.testing import (  # noqa: E402
    assert_rel_close,
    reference_expert_mlp,
    reference_permute,
    routing_ids,
    tolerance_for,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

T, K_TOP, H, I, E = 24, 2, 32, 16, 4


def _inputs(dtype, routing="uniform", *, hf_layout=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    ids = routing_ids(T, K_TOP, E, routing, generator=g)
    probs = torch.softmax(torch.randn(T, K_TOP, generator=g, dtype=torch.float64), -1)
    if hf_layout:  # [E, 2I, H] / [E, H, I] parameters read through transposed views
        gate_up = torch.randn(E, 2 * I, H, generator=g, dtype=torch.float64).div(H**0.5).transpose(1, 2)
        down = torch.randn(E, H, I, generator=g, dtype=torch.float64).div(I**0.5).transpose(1, 2)
    else:
        gate_up = torch.randn(E, H, 2 * I, generator=g, dtype=torch.float64) / H**0.5
        down = torch.randn(E, I, H, generator=g, dtype=torch.float64) / I**0.5
    leaves = [t.to(DEVICE, dtype).detach().requires_grad_(True) for t in (hidden, probs, gate_up, down)]
    return leaves[0], ids.to(DEVICE), leaves[1], leaves[2], leaves[3]


def _reference(hidden, ids, probs, gate_up, down):
    """float64 out and grads by autograd through the shared references (permute rows, expert MLP)."""
    _, rows_Tk, counts = reference_permute(hidden, ids.cpu(), E)
    leaves = [t.detach().double().cpu().requires_grad_(True) for t in (hidden, probs, gate_up, down)]
    h64, p64, gu64, d64 = leaves
    token_of_row = torch.empty(T * K_TOP, dtype=torch.int64)
    token_of_row[rows_Tk.flatten()] = torch.arange(T * K_TOP) // K_TOP
    y64 = reference_expert_mlp(h64[token_of_row], gu64, d64, counts)
    out64 = (y64[rows_Tk] * p64.unsqueeze(-1)).sum(1)
    return out64, leaves


def _unfused(hidden, ids, probs, gate_up, down):
    x_RH, row_id_map, counts = permute(hidden, ids, E)
    return unpermute(expert_mlp(x_RH, counts, gate_up, down, backend="triton"), row_id_map, probs)


@pytest.mark.parametrize("routing", ["uniform", "empty", "duplicate_topk"])
@pytest.mark.parametrize("hf_layout", [False, True], ids=["EH2I", "hf-views"])
def test_matches_float64_reference(routing, hf_layout):
    hidden, ids, probs, gate_up, down = _inputs(torch.float32, routing, hf_layout=hf_layout)
    out = moe_mlp_gather_scatter(hidden, ids, probs, gate_up, down)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    out.backward(grad_out.to(out))
    out64, leaves = _reference(hidden, ids, probs, gate_up, down)
    out64.backward(grad_out)
    assert_rel_close(out.cpu(), out64, 1e-5, "out")
    for name, got, ref in zip(("hidden", "probs", "gate_up", "down"), (hidden, probs, gate_up, down), leaves):
        assert_rel_close(got.grad.cpu(), ref.grad, 1e-5, f"d{name}")
    if routing == "empty":  # even experts get no tokens: their weight grads are exactly zero
        assert torch.equal(gate_up.grad[0::2], torch.zeros_like(gate_up.grad[0::2]))
        assert torch.equal(down.grad[0::2], torch.zeros_like(down.grad[0::2]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_fused_matches_unfused(dtype):
    inputs = _inputs(dtype, "uneven", seed=1)
    clones = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    out_f = moe_mlp_gather_scatter(*inputs)
    out_u = _unfused(*clones)
    grad_out = torch.randn(out_f.shape, generator=torch.Generator().manual_seed(2)).to(out_f)
    out_f.backward(grad_out)
    out_u.backward(grad_out)
    tol = tolerance_for(dtype)
    torch.testing.assert_close(out_f, out_u, rtol=tol.rtol, atol=tol.atol)
    for i in (0, 2, 3, 4):  # hidden, probs, gate_up, down (ids have no grad)
        assert_rel_close(inputs[i].grad.float().cpu(), clones[i].grad.double().cpu(), 2 * tol.rel, f"grad {i}")


@settings(max_examples=4, deadline=None)
@given(
    num_tokens=st.integers(1, 20),
    top_k=st.integers(1, 3),
    num_experts=st.integers(3, 6),
    hidden=st.integers(1, 40),
    inter=st.integers(1, 24),
)
def test_random_shapes_match_unfused(num_tokens, top_k, num_experts, hidden, inter):
    g = torch.Generator().manual_seed(num_tokens * 7 + hidden)
    ids = routing_ids(num_tokens, top_k, num_experts, "duplicate_topk", generator=g).to(DEVICE)
    leaves = [
        torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(True)
        for shape in ((num_tokens, hidden), (num_tokens, top_k), (num_experts, hidden, 2 * inter),
                      (num_experts, inter, hidden))
    ]  # fmt: skip
    clones = [t.detach().clone().requires_grad_(True) for t in leaves]
    hidden_f, probs_f, gate_up_f, down_f = leaves
    out_f = moe_mlp_gather_scatter(hidden_f, ids, probs_f, gate_up_f, down_f)
    x_RH, row_id_map, counts = permute(clones[0], ids, num_experts)
    out_u = unpermute(expert_mlp(x_RH, counts, clones[2], clones[3], backend="eager"), row_id_map, clones[1])
    out_f.sum().backward()
    out_u.sum().backward()
    assert_rel_close(out_f.cpu(), out_u.double().cpu(), 1e-5, "out")
    for i, name in enumerate(("hidden", "probs", "gate_up", "down")):
        assert_rel_close(leaves[i].grad.cpu(), clones[i].grad.double().cpu(), 1e-5, f"d{name}")


def test_routing_rows_is_permutes_grouping():
    _, ids, _, _, _ = _inputs(torch.float32, "duplicate_topk", seed=3)
    hidden = torch.randn(T, H, device=DEVICE)
    _, row_id_map, counts = permute(hidden, ids, E)
    slot_of_row, token_of_row, ends = routing_rows(ids, E)
    assert torch.equal(row_id_map[slot_of_row], torch.arange(T * K_TOP, device=DEVICE))
    assert torch.equal(token_of_row, slot_of_row // K_TOP)
    assert torch.equal(ends, torch.cumsum(counts, 0))


def test_bad_arguments_name_the_argument():
    hidden, ids, probs, gate_up, down = _inputs(torch.float32)
    with pytest.raises(ValueError, match="probs_Tk"):
        moe_mlp_gather_scatter(hidden, ids, probs[:, :1], gate_up, down)
    with pytest.raises(ValueError, match="down_EIH"):
        moe_mlp_gather_scatter(hidden, ids, probs, gate_up, down[:, :-1])
    with pytest.raises(TypeError, match="selected_experts_Tk"):
        moe_mlp_gather_scatter(hidden, ids.float(), probs, gate_up, down)
    with pytest.raises(ValueError, match="hidden_TH"):
        moe_mlp_gather_scatter(hidden[:, :-1], ids, probs, gate_up, down)


def test_custom_ops_pass_opcheck():
    """Schema, fake (shape-only) and autograd registrations of both custom ops."""
    from moe_gmm.ops import gather_gmm

    g = torch.Generator().manual_seed(4)
    num_tokens, top_k, k_dim, n_dim, num_experts = 4, 2, 16, 16, 3
    ids = routing_ids(num_tokens, top_k, num_experts, "uniform", generator=g).to(DEVICE)
    slot_of_row, token_of_row, ends = routing_rows(ids, num_experts)
    x = torch.randn(num_tokens, k_dim, generator=g).to(DEVICE).requires_grad_(True)
    a = torch.randn(num_tokens * top_k, k_dim, generator=g).to(DEVICE).requires_grad_(True)
    w = torch.randn(num_experts, k_dim, n_dim, generator=g).to(DEVICE).requires_grad_(True)
    probs = torch.rand(num_tokens, top_k, generator=g).to(DEVICE).requires_grad_(True)
    torch.library.opcheck(gather_gmm._gather_op, (x, w, ends, token_of_row, slot_of_row))
    torch.library.opcheck(gather_gmm._scatter_op, (a, w, ends, token_of_row, slot_of_row, probs))


def test_compiles_fullgraph():
    """Static shapes throughout (group ends by binary search, not bincount): one graph, same numbers."""
    hidden, ids, probs, gate_up, down = _inputs(torch.float32, "uneven", seed=6)
    compiled = torch.compile(
        lambda *args: moe_mlp_gather_scatter(*args, validate=False), fullgraph=True, backend="aot_eager"
    )
    out = compiled(hidden, ids, probs, gate_up, down)
    out.sum().backward()
    grads = [t.grad.clone() for t in (hidden, probs, gate_up, down)]
    for t in (hidden, probs, gate_up, down):
        t.grad = None
    ref = moe_mlp_gather_scatter(hidden, ids, probs, gate_up, down)
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    for got, t in zip(grads, (hidden, probs, gate_up, down)):
        torch.testing.assert_close(got, t.grad, rtol=0, atol=0)
