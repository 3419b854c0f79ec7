"""A Hugging Face MoE model trained with ``loss.backward()``: every expert parameter's gradient
arrives in the parameter's own layout (no copy of weight-gradient size), for each weight layout the
integration offers, and equals transformers' eager experts."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.profiler import profile

transformers = pytest.importorskip("transformers")

from moe_gmm.integrations.transformers import (
    pad_expert_weight_rows,
    register_moe_gmm_experts,
    store_expert_weights_input_major,
)
from moe_gmm.testing import assert_rel_close

LAYOUT_CHANGES = {
    "default": lambda model: None,
    "input_major": store_expert_weights_input_major,
    "padded_rows": pad_expert_weight_rows,
    "padded_input_major": lambda model: (pad_expert_weight_rows(model), store_expert_weights_input_major(model)),
}


def _config(impl: str):
    # One config object per model: transformers writes the experts implementation into it.
    return transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        experts_implementation=impl,
    )  # fmt: skip


def _expert_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.dim() == 3}


def _contract_strides(param: torch.Tensor) -> tuple[int, ...]:
    dense = param.is_contiguous() or param.mT.is_contiguous()
    return param.stride() if dense else torch.empty(param.shape).stride()


@pytest.mark.parametrize("layout", sorted(LAYOUT_CHANGES))
def test_expert_grads_need_no_copy(layout: str) -> None:
    register_moe_gmm_experts()
    torch.manual_seed(0)
    eager = transformers.Qwen3MoeForCausalLM(_config("eager"))
    model = transformers.Qwen3MoeForCausalLM(_config("moe_gmm"))
    model.load_state_dict(copy.deepcopy(eager.state_dict()))
    LAYOUT_CHANGES[layout](model)
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
        assert p.grad.stride() == _contract_strides(p), (name, p.stride(), p.grad.stride())
        assert_rel_close(p.grad, params_ref[name].grad, 1e-5, what=f"{layout} {name}.grad")
