"""A Hugging Face MoE model trained with ``loss.backward()``: every expert parameter's gradient
arrives in the parameter's own layout (no copy of weight-gradient size) and equals transformers'
eager experts; the optimizer moe-gmm builds then steps the experts as torch's for-loop AdamW does."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import profile

transformers = pytest.importorskip("transformers")

from moe_gmm.integrations.transformers import register_moe_gmm_experts
from moe_gmm.optim import adamw_kind, make_adamw
from moe_gmm.testing import assert_rel_close


def _config(impl: str):
    # One config object per model: transformers writes the experts implementation into it.
    return transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        experts_implementation=impl,
    )  # fmt: skip


def _expert_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.dim() == 3}


def _twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    """The same tiny Qwen3-MoE twice: ``moe_gmm`` experts, and transformers' ``eager`` experts."""
    register_moe_gmm_experts()
    torch.manual_seed(0)
    eager = transformers.Qwen3MoeForCausalLM(_config("eager"))
    model = transformers.Qwen3MoeForCausalLM(_config("moe_gmm"))
    model.load_state_dict(copy.deepcopy(eager.state_dict()))
    return model, eager


def test_expert_grads_need_no_copy() -> None:
    model, eager = _twins()
    ids = torch.randint(0, 96, (2, 24))

    def step(m: torch.nn.Module) -> torch.Tensor:
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    step(model)  # warm-up
    model.zero_grad(set_to_none=True)
    with profile(record_shapes=True) as prof:
        loss = step(model)
    loss_ref = step(eager)
    torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=1e-6)

    params, params_ref = _expert_params(model), _expert_params(eager)
    assert params, "the model has no 3-D expert parameters"
    sizes = {p.numel() for p in params.values()}
    copies = [
        (e.name, e.input_shapes)
        for e in prof.events()
        if e.name in ("aten::copy_", "aten::clone")
        and any(len(s) == 3 and torch.Size(s).numel() in sizes for s in e.input_shapes if s)
    ]
    assert copies == [], f"weight-gradient-sized copies after loss.backward(): {copies}"
    for name, p in params.items():
        assert p.grad.stride() == p.stride(), (name, p.stride(), p.grad.stride())
        assert_rel_close(p.grad, params_ref[name].grad, 1e-5, what=f"{name}.grad")


def test_make_adamw_steps_the_experts_like_the_for_loop_adamw() -> None:
    """Three steps of the AdamW moe-gmm trains with on the ``moe_gmm`` model, and of torch's for-loop
    AdamW on a copy fed the same gradients: every expert weight within float32 rounding (an update
    read at the wrong elements is lr-sized, 1e-2)."""
    model, _ = _twins()
    twin = copy.deepcopy(model)
    opt = make_adamw(model.named_parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
    assert adamw_kind(opt) == "fused"
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        ids = torch.randint(0, 96, (2, 24), generator=g)
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        for p, q in zip(model.parameters(), twin.parameters(), strict=True):
            q.grad = None if p.grad is None else torch.empty_like(q).copy_(p.grad)
        opt.step()
        opt_ref.step()
    params, params_ref = _expert_params(model), _expert_params(twin)
    for name, p in params.items():
        assert_rel_close(p.detach(), params_ref[name].detach(), 1e-6, what=name)
