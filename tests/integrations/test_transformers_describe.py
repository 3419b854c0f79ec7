"""describe_experts: each experts module's implementation and the backend that actually runs it."""

from __future__ import annotations

import logging
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from moe_gmm.integrations.transformers import ExpertsDescription, describe_experts, register_moe_gmm_experts
from moe_gmm.layers import MoeBlockConfig, SparseMoeBlock
from moe_gmm.ops.backends import explain


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_moe_gmm_experts()
    register_moe_gmm_experts("moe_gmm_eager", fused=False)
    register_moe_gmm_experts("moe_gmm_torch", backend="torch")


def _qwen3_moe(hidden=40, inter=24, layers=2):
    # Sizes no other test uses: the backend log prints each (device, dtype, shape) choice once per process.
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, moe_intermediate_size=inter, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def test_each_layer_names_the_backend_that_runs_it(caplog):
    model = _qwen3_moe()
    model.set_experts_implementation("moe_gmm")
    described = describe_experts(model)
    assert [d.name for d in described] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    experts = model.model.layers[0].mlp.experts
    expected = {
        "gate_up_proj": explain(torch.empty(1, 40), experts.gate_up_proj.transpose(1, 2)).backend,
        "down_proj": explain(torch.empty(1, 24), experts.down_proj.transpose(1, 2)).backend,
    }
    for d in described:
        assert d.implementation == "moe_gmm" and d.backends == expected
        assert str(d) == f"{d.name}: moe_gmm, backend {expected['gate_up_proj']}"
    # The backend named is the one the forward picks: the log says so for both weight shapes.
    caplog.set_level(logging.INFO, logger="moe_gmm")
    model(input_ids=torch.randint(0, 64, (2, 6)))
    logged = {
        m.group(1): m.group(2)
        for r in caplog.records
        if (m := re.search(r"weight (\[4, \d+, \d+\]): backend '(\w+)'", r.getMessage()))
    }
    assert logged == {"[4, 40, 48]": expected["gate_up_proj"], "[4, 24, 40]": expected["down_proj"]}


def test_other_implementations_and_a_refused_backend():
    model = _qwen3_moe(hidden=48, inter=20)
    model.set_experts_implementation("moe_gmm_eager")
    assert {d.backend for d in describe_experts(model)} == {"eager"}
    model.set_experts_implementation("grouped_mm")
    (first, _) = describe_experts(model)
    assert first == ExpertsDescription("model.layers.0.mlp.experts", "grouped_mm", {})
    assert first.backend == "-" and str(first).endswith("grouped_mm, backend -")
    # torch's grouped_mm takes bf16 widths in multiples of 8 only: down_proj's K=20 is refused.
    model = model.to(torch.bfloat16)
    model.set_experts_implementation("moe_gmm_torch")
    (first, _) = describe_experts(model)
    assert first.backends["gate_up_proj"] == "torch"
    assert first.backends["down_proj"].startswith("none: torch grouped_mm needs K and N multiples of 8")
    assert first.backend.startswith("gate_up_proj torch, down_proj none: ")


def test_moe_gmm_blocks_and_bad_input():
    cfg = {"hidden_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    fused = SparseMoeBlock(MoeBlockConfig(**cfg))
    eager = SparseMoeBlock(MoeBlockConfig(**cfg, use_grouped_expert_matmul=False))
    auto = explain(torch.empty(1, 32), fused.experts.gate_up_proj).backend
    assert describe_experts(fused) == [
        ExpertsDescription("experts", "GroupedExperts", {"gate_up_proj": auto, "down_proj": auto})
    ]
    assert describe_experts(eager)[0].backends == {"gate_up_proj": "eager", "down_proj": "eager"}
    assert describe_experts(torch.nn.Linear(2, 2)) == []
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        describe_experts("model")
