"""Equivalence with real transformers code: tiny models built from configs, random weights, no downloads."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

transformers = pytest.importorskip("transformers")

from moe_gmm.integrations.transformers import (
    hf_to_moe_gmm_state_dict,
    moe_block_config_from_hf,
    moe_gmm_to_hf_state_dict,
    register_moe_gmm_experts,
)
from moe_gmm.layers import SparseMoeBlock
from moe_gmm.testing import assert_rel_close

FP32_LIMIT = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_moe_gmm_experts()
    register_moe_gmm_experts("moe_gmm_eager", fused=False)


def _qwen3_5_moe_config(**kw):
    return transformers.Qwen3_5MoeTextConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3,
        shared_expert_intermediate_size=48, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, layer_types=["linear_attention", "full_attention"], **kw,
    )  # fmt: skip


def _qwen3_moe_config(**kw):
    return transformers.Qwen3MoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, **kw,
    )  # fmt: skip


def _olmoe_config(**kw):
    return transformers.OlmoeConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        intermediate_size=32, num_experts=8, num_experts_per_tok=2, eos_token_id=2, **kw,
    )  # fmt: skip


def _mixtral_config(**kw):
    return transformers.MixtralConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, **kw,
    )  # fmt: skip


def _gpt_oss_config(**kw):
    # Interleaved gate/up, biases and a clamped custom gate: exercises the generic path.
    return transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], **kw,
    )  # fmt: skip


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)


class _GmmCalls(TorchDispatchMode):
    """Counts ``moe_gmm::grouped_matmul`` calls and records the weight storages they read."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.weight_ptrs: list[int] = []
        self.weights_contiguous: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        if name.startswith("moe_gmm::grouped_matmul"):
            self.calls[name] += 1
            if name == "moe_gmm::grouped_matmul":
                self.weight_ptrs.append(args[1].untyped_storage().data_ptr())
                self.weights_contiguous.append(args[1].is_contiguous())
        return func(*args, **(kwargs or {}))


# ---------------------------------------------------------------------------------------------
# Import hygiene and registration
# ---------------------------------------------------------------------------------------------


def test_import_does_not_need_transformers():
    code = (
        "import sys, moe_gmm, moe_gmm.integrations.transformers; "
        "assert 'transformers' not in sys.modules, 'transformers imported eagerly'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_registration():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    assert "moe_gmm" in ALL_EXPERTS_FUNCTIONS and "moe_gmm_eager" in ALL_EXPERTS_FUNCTIONS
    assert register_moe_gmm_experts() == "moe_gmm"  # idempotent
    with pytest.raises(ValueError, match="name"):
        register_moe_gmm_experts("")


# ---------------------------------------------------------------------------------------------
# State-dict converters
# ---------------------------------------------------------------------------------------------


def test_converters_round_trip_exactly():
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = _qwen3_5_moe_config()
    hf_block = Qwen3_5MoeSparseMoeBlock(cfg)
    _randomize(hf_block, 0)
    hf_sd = hf_block.state_dict()
    ours = hf_to_moe_gmm_state_dict(hf_sd)
    assert ours["experts.gate_up_proj"].shape == (8, 64, 64) and ours["experts.down_proj"].shape == (8, 32, 64)
    assert torch.equal(ours["experts.gate_up_proj"][3, :, :32], hf_sd["experts.gate_up_proj"][3, :32].T)  # gate half
    back = moe_gmm_to_hf_state_dict(ours)
    assert back.keys() == hf_sd.keys()
    for k in hf_sd:
        assert torch.equal(back[k], hf_sd[k]), k
    again = hf_to_moe_gmm_state_dict(back)
    for k in ours:
        assert torch.equal(again[k], ours[k]), k
    # a block's state dict loads strictly into SparseMoeBlock
    SparseMoeBlock(moe_block_config_from_hf(cfg)).load_state_dict(ours, strict=True)


def test_per_expert_checkpoint_keys_are_stacked():
    g = torch.Generator().manual_seed(0)
    num_experts, hidden, inter = 3, 6, 4
    sd = {"model.layers.0.mlp.gate.weight": torch.randn(num_experts, hidden, generator=g)}
    gates, ups, downs = [], [], []
    for e in range(num_experts):
        gates.append(torch.randn(inter, hidden, generator=g))
        ups.append(torch.randn(inter, hidden, generator=g))
        downs.append(torch.randn(hidden, inter, generator=g))
        sd[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gates[-1]
        sd[f"model.layers.0.mlp.experts.{e}.up_proj.weight"] = ups[-1]
        sd[f"model.layers.0.mlp.experts.{e}.down_proj.weight"] = downs[-1]
    ours = hf_to_moe_gmm_state_dict(sd)
    assert sorted(ours) == [
        "model.layers.0.mlp.experts.down_proj",
        "model.layers.0.mlp.experts.gate_up_proj",
        "model.layers.0.mlp.gate.weight",
    ]
    x = torch.randn(5, hidden, generator=g)
    e = 1
    got = (x @ ours["model.layers.0.mlp.experts.gate_up_proj"][e]).chunk(2, dim=-1)
    torch.testing.assert_close(got[0], x @ gates[e].T)
    torch.testing.assert_close(got[1], x @ ups[e].T)
    assert torch.equal(ours["model.layers.0.mlp.experts.down_proj"][e], downs[e].T)
    del sd["model.layers.0.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match="incomplete per-expert"):
        hf_to_moe_gmm_state_dict(sd)


def test_converter_rejects_wrong_rank():
    with pytest.raises(ValueError, match="experts.down_proj"):
        hf_to_moe_gmm_state_dict({"experts.down_proj": torch.zeros(4, 4)})


def test_config_from_hf():
    cfg = moe_block_config_from_hf(_qwen3_5_moe_config())
    assert (cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok) == (64, 8, 3)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.norm_topk_prob) == (32, 48, True)
    mixtral = moe_block_config_from_hf(_mixtral_config(), use_grouped_expert_matmul=False)
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.shared_expert_intermediate_size) == (4, 32, 0)
    assert mixtral.use_grouped_expert_matmul is False
    with pytest.raises(ValueError, match="hidden_act"):
        moe_block_config_from_hf(_qwen3_moe_config(hidden_act="gelu"))


# ---------------------------------------------------------------------------------------------
# Block equivalence: transformers' sparse MoE blocks vs SparseMoeBlock
# ---------------------------------------------------------------------------------------------


SPARSE_BLOCKS = {
    # family: (config factory, modeling module, sparse block class)
    "qwen3_5_moe": (_qwen3_5_moe_config, "qwen3_5_moe", "Qwen3_5MoeSparseMoeBlock"),
    "qwen3_moe": (_qwen3_moe_config, "qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "olmoe": (_olmoe_config, "olmoe", "OlmoeSparseMoeBlock"),  # norm_topk_prob=False
    "mixtral": (_mixtral_config, "mixtral", "MixtralSparseMoeBlock"),
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("family", list(SPARSE_BLOCKS))
def test_hf_sparse_block_matches_sparse_moe_block(family, fused):
    import importlib

    make_config, module_name, class_name = SPARSE_BLOCKS[family]
    cfg = make_config()
    cfg._experts_implementation = "eager"  # transformers' own per-expert loop
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    hf_block = getattr(module, class_name)(cfg)
    hf_block.train(False)  # Mixtral's router jitter is training-only
    _randomize(hf_block, 1)
    block = SparseMoeBlock(moe_block_config_from_hf(cfg, use_grouped_expert_matmul=fused))
    block.load_state_dict(hf_to_moe_gmm_state_dict(hf_block.state_dict()), strict=True)

    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    out_hf, out = hf_block(x_hf), block(x_ours)
    assert_rel_close(out, out_hf, FP32_LIMIT, "block output")
    out_hf.backward(dy)
    out.backward(dy)
    assert_rel_close(x_ours.grad, x_hf.grad, FP32_LIMIT, "d hidden_states")
    hf_grads = hf_to_moe_gmm_state_dict({n: p.grad for n, p in hf_block.named_parameters()})
    ours = dict(block.named_parameters())
    assert ours.keys() == hf_grads.keys()
    for name, grad in hf_grads.items():
        assert_rel_close(ours[name].grad, grad, FP32_LIMIT, f"d {name}")


# ---------------------------------------------------------------------------------------------
# Whole models: experts_implementation="moe_gmm" vs "eager"
# ---------------------------------------------------------------------------------------------

MODELS = {
    "qwen3_5_moe": (_qwen3_5_moe_config, "Qwen3_5MoeForCausalLM"),
    "qwen3_moe": (_qwen3_moe_config, "Qwen3MoeForCausalLM"),
    "olmoe": (_olmoe_config, "OlmoeForCausalLM"),
    "mixtral": (_mixtral_config, "MixtralForCausalLM"),
    "gpt_oss": (_gpt_oss_config, "GptOssForCausalLM"),
}


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    with _GmmCalls() as calls:
        loss = model(ids, labels=ids).loss
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, calls


def _causal_lm(family: str, experts_implementation: str):
    """A tiny model of ``family`` with seeded random weights, in training mode."""
    make_config, class_name = MODELS[family]
    torch.manual_seed(0)
    model = getattr(transformers, class_name)(make_config(experts_implementation=experts_implementation))
    return model.train()


@pytest.mark.parametrize("family", list(MODELS))
def test_causal_lm_moe_gmm_matches_eager(family):
    model = _causal_lm(family, "eager")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))

    loss_ref, grads_ref, calls_ref = _loss_and_grads(model, ids)
    assert calls_ref.calls["moe_gmm::grouped_matmul"] == 0
    for impl in ("moe_gmm", "moe_gmm_eager"):
        model.set_experts_implementation(impl)
        loss, grads, calls = _loss_and_grads(model, ids)
        # Two routed-expert matmuls per MoE layer forward, two grads each in backward.
        assert calls.calls["moe_gmm::grouped_matmul"] == 2 * 2
        assert calls.calls["moe_gmm::grouped_matmul_grad_weight"] == 2 * 2
        assert_rel_close(loss, loss_ref, FP32_LIMIT, f"{family} {impl} loss")
        assert grads.keys() == grads_ref.keys()
        for name, grad in grads.items():
            assert_rel_close(grad, grads_ref[name], FP32_LIMIT, f"{family} {impl} d {name}")
    # No weight copy: the grouped matmul read the experts parameters' own storage.
    expert_ptrs = {
        p.untyped_storage().data_ptr() for n, p in model.named_parameters() if n.endswith(("gate_up_proj", "down_proj"))
    }
    assert set(calls.weight_ptrs) <= expert_ptrs


def test_bf16_model_close_to_eager():
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(_qwen3_moe_config(experts_implementation="eager")).to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(ids).logits.float()
        model.set_experts_implementation("moe_gmm")
        got = model(ids).logits.float()
    assert_rel_close(got, ref, 1e-2, "bf16 logits")


def test_hf_expert_parallel_is_refused():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    cfg = _qwen3_moe_config()
    cfg._experts_implementation = "moe_gmm"
    experts = Qwen3MoeExperts(cfg)
    experts._is_expert_parallel = True
    with pytest.raises(NotImplementedError, match="moe_gmm.parallel"):
        experts(torch.randn(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
