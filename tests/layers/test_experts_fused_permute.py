"""GroupedExperts(fused_permute=True): the gather/scatter kernels vs the permute/unpermute path.

Runs the triton kernels: compiled with CUDA, else in Triton's CPU interpreter (tests/conftest.py).
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from moe_gmm.layers import GroupedExperts
from moe_gmm.testing import assert_rel_close, routing_ids

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: fused_permute cannot run", allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set", allow_module_level=True)

E, H, INTER, T, TOP_K = 6, 16, 8, 20, 3


@pytest.mark.parametrize("routing", ["uneven", "empty"])
def test_fused_permute_matches_default_path(routing):
    plain = GroupedExperts(E, H, INTER).to(DEVICE)
    fused = GroupedExperts(E, H, INTER, fused_permute=True).to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(0)
    ids = routing_ids(T, TOP_K, E, routing, generator=g).to(DEVICE)
    probs = torch.rand(T, TOP_K, generator=g).to(DEVICE)
    x = torch.randn(T, H, generator=g).to(DEVICE)
    grads = []
    for module in (plain, fused):
        x_, p_ = x.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        out = module(x_, ids, p_)
        out.backward(torch.ones_like(out))
        grads.append((out, x_.grad, p_.grad, module.gate_up_proj.grad, module.down_proj.grad))
    for name, got, want in zip(("out", "dx", "dprobs", "dgate_up", "ddown"), grads[1], grads[0]):
        assert_rel_close(got.cpu(), want.double().cpu(), 1e-5, name)
    assert torch.equal(fused.last_tokens_per_expert, plain.last_tokens_per_expert)


def test_fused_permute_argument_errors():
    with pytest.raises(ValueError, match="fused_permute"):
        GroupedExperts(E, H, INTER, fused_permute=True, use_grouped_expert_matmul=False)
    with pytest.raises(ValueError, match="fused_permute"):
        GroupedExperts(E, H, INTER, fused_permute=True, backend="torch")
    experts = GroupedExperts(E, H, INTER, fused_permute=True).to(DEVICE)
    ids = torch.full((2, TOP_K), E, device=DEVICE)
    with pytest.raises(ValueError, match="selected_experts_Tk"):
        experts(torch.randn(2, H, device=DEVICE), ids, torch.rand(2, TOP_K, device=DEVICE))


def test_moe_block_option_matches_default_block():
    from moe_gmm.layers import MoeBlockConfig, SparseMoeBlock

    config = dict(hidden_size=16, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                  shared_expert_intermediate_size=8)  # fmt: skip
    plain = SparseMoeBlock(MoeBlockConfig(**config)).to(DEVICE)
    fused = SparseMoeBlock(MoeBlockConfig(**config, fused_permute=True)).to(DEVICE)
    fused.load_state_dict(plain.state_dict())
    assert fused.experts.fused_permute
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    assert_rel_close(fused(x).cpu(), plain(x).double().cpu(), 1e-5, "block output")
