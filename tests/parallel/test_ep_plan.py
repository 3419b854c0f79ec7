"""``ep_plan`` patterns and the plan dataclass (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.parallel.plan import EPPlan, ModulePattern, match_modules

# Module names as a Qwen3.5-MoE model (multimodal wrapper) lists them, trimmed to what matters.
QWEN35_NAMES = [
    "model",
    "model.language_model",
    "model.language_model.layers",
    *[
        f"model.language_model.layers.{i}.{suffix}"
        for i in range(12)
        for suffix in (
            "mlp",
            "mlp.gate",
            "mlp.experts",
            "mlp.shared_expert",
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert_gate",
        )
    ],
    "mtp.layers.0.mlp.experts",
    "lm_head",
]


def test_reference_397b_pattern_matches_routed_experts_only():
    plan = EPPlan(expert_parallel_size=16, apply_modules=["model.language_model.layers.{*}.mlp.experts"])
    matched = plan.match(QWEN35_NAMES)
    assert matched == [f"model.language_model.layers.{i}.mlp.experts" for i in range(12)]
    assert not any("shared_expert" in n for n in matched)
    assert "mtp.layers.0.mlp.experts" not in matched  # anchored: the MTP layers are not EP


@pytest.mark.parametrize(
    ("pattern", "name", "expected"),
    [
        ("layers.{*}.mlp.experts", "layers.7.mlp.experts", True),
        ("layers.{*}.mlp.experts", "layers.x.mlp.experts", False),
        ("layers.{*}.mlp.experts", "layers.7.mlp.experts.0", False),  # anchored at the end
        ("layers.{*}.mlp.experts", "model.layers.7.mlp.experts", False),  # anchored at the start
        ("layers.{*}.mlp.experts", "layers.7.mlp.shared_expert", False),
        ("layers.{*}.mlp.experts", "layers.7Xmlp.experts", False),  # '.' is literal
        ("layers.{2-4}.mlp.experts", "layers.2.mlp.experts", True),
        ("layers.{2-4}.mlp.experts", "layers.4.mlp.experts", True),  # inclusive
        ("layers.{2-4}.mlp.experts", "layers.5.mlp.experts", False),
        ("layers.{2-4}.mlp.experts", "layers.1.mlp.experts", False),
        ("layers.{2-4}.mlp.experts", "layers.12.mlp.experts", False),  # a number, not a digit prefix
        ("layers.*.experts", "layers.3.block.experts", True),  # '*' crosses dots
        ("*.experts", "a.b.c.experts", True),
        ("*.experts", "a.b.shared_experts", False),
        ("layers.?.experts", "layers.3.experts", True),
        ("layers.?.experts", "layers.13.experts", False),
        ("layers.{*}.mlp.{0-1}", "layers.3.mlp.1", True),  # several groups, each range checked
        ("layers.{*}.mlp.{0-1}", "layers.3.mlp.2", False),
    ],
)
def test_pattern_language(pattern, name, expected):
    assert ModulePattern.compile(pattern).matches(name) is expected


@pytest.mark.parametrize(
    ("pattern", "match"),
    [
        ("layers.{x}.experts", r"unknown group \{x\}"),
        ("layers.{5-2}.experts", r"range \{5-2\}.*empty"),
        ("layers.{*.experts", "unbalanced"),
        ("layers.*}.experts", "unbalanced"),
        ("", "must not be empty"),
    ],
)
def test_bad_patterns_raise_naming_the_key(pattern, match):
    with pytest.raises(ValueError, match=match) as info:
        ModulePattern.compile(pattern)
    assert "parallel.ep_plan.apply_modules" in str(info.value)


def test_pattern_matching_nothing_raises():
    with pytest.raises(ValueError, match=r"apply_modules: pattern 'model.layers.\{\*\}.mlp.experts' matches no module"):
        match_modules(QWEN35_NAMES, ["model.layers.{*}.mlp.experts"])


def test_a_pattern_matching_nothing_lists_the_closest_experts_modules():
    from tests.helpers.ep_models import tiny_moe_stack

    modules = dict(tiny_moe_stack(num_layers=3).named_modules())
    for typo in ("layers.{*}.mlp.expert", "model.layers.{*}.mlp.experts", "layers.{*}.experts"):
        with pytest.raises(ValueError) as info:
            match_modules(modules, [typo])
        # Not the first module names ('', 'layers', ...): the experts modules, as a pattern to copy.
        assert str(info.value) == (
            f"parallel.ep_plan.apply_modules: pattern {typo!r} matches no module "
            "(closest experts modules: layers.{*}.mlp.experts)"
        )
    dense = dict(torch.nn.Sequential(torch.nn.Linear(2, 2)).named_modules())
    with pytest.raises(ValueError, match=r"\(the model has no module with 3-D gate_up_proj and down_proj parameters"):
        match_modules(dense, ["layers.{*}.mlp.experts"])
    # Names alone (no modules to inspect): the closest names, layer indices folded into {*}.
    with pytest.raises(ValueError, match=r"\(closest module names: model.language_model.layers.\{\*\}.mlp.experts, "):
        match_modules(QWEN35_NAMES, ["model.language_model.layers.{*}.mlp.expert"])


def test_two_patterns_on_one_module_raise():
    with pytest.raises(ValueError, match=r"layers.3.mlp.experts' is matched by both"):
        match_modules(
            QWEN35_NAMES,
            ["model.language_model.layers.{*}.mlp.experts", "model.language_model.layers.{3-3}.mlp.experts"],
        )


def test_disjoint_ranges_combine_in_module_order():
    matched = match_modules(
        QWEN35_NAMES,
        ["model.language_model.layers.{6-11}.mlp.experts", "model.language_model.layers.{0-5}.mlp.experts"],
    )
    assert matched == [f"model.language_model.layers.{i}.mlp.experts" for i in range(12)]


def test_plan_validation():
    with pytest.raises(ValueError, match="parallel.expert_parallel_size"):
        EPPlan(expert_parallel_size=0, apply_modules=["a"])
    with pytest.raises(ValueError, match="parallel.expert_parallel_size"):
        EPPlan(expert_parallel_size=True, apply_modules=["a"])
    with pytest.raises(ValueError, match="parallel.ep_plan.dispatcher.*'mc2'"):
        EPPlan(expert_parallel_size=2, apply_modules=["a"], dispatcher="mc2")
    with pytest.raises(ValueError, match="parallel.ep_plan.apply_modules: must name"):
        EPPlan(expert_parallel_size=2, apply_modules=[])
    with pytest.raises(TypeError, match="parallel.ep_plan.apply_modules: expected a list"):
        EPPlan(expert_parallel_size=2, apply_modules="layers.{*}.experts")
    with pytest.raises(ValueError, match="unknown group"):
        EPPlan(expert_parallel_size=2, apply_modules=["layers.{y}.experts"])  # fails at construction
    with pytest.raises(ValueError, match="parallel.ep_plan.num_chunks"):
        EPPlan(expert_parallel_size=2, apply_modules=["a"], dispatcher="alltoall_overlap", num_chunks=0)
    assert EPPlan(expert_parallel_size=1, apply_modules=[]).apply_modules == ()


def test_plan_from_reference_config_mapping_and_dataclass():
    from moe_gmm.config import EPPlanConfig, ParallelConfig

    section = {
        "expert_parallel_size": 16,
        "ep_plan": {"apply_modules": ["model.language_model.layers.{*}.mlp.experts"], "dispatcher": "alltoall"},
    }
    plan = EPPlan.from_config(section)
    assert plan == EPPlan(16, ("model.language_model.layers.{*}.mlp.experts",), "alltoall")
    dc = ParallelConfig(
        expert_parallel_size=4, ep_plan=EPPlanConfig(apply_modules=["x.{*}"], dispatcher="alltoall_overlap")
    )
    assert EPPlan.from_config(dc) == EPPlan(4, ("x.{*}",), "alltoall_overlap")
    with pytest.raises(ValueError, match=r"parallel.ep_plan: unknown keys \['use_npu_fused_ops'\]"):
        EPPlan.from_config({"expert_parallel_size": 2, "ep_plan": {"apply_modules": ["a"], "use_npu_fused_ops": True}})
    with pytest.raises(ValueError, match=r"parallel: unknown keys \['expert_parallel'\]"):
        EPPlan.from_config({"expert_parallel": 2})


def test_reference_397b_plan_on_a_real_multimodal_qwen3_5_moe_module_tree():
    """The reference config's plan, on the module names of a tiny Hugging Face Qwen3.5-MoE with a vision tower."""
    transformers = pytest.importorskip("transformers")

    from moe_gmm.config import load_config
    from moe_gmm.parallel.layout import experts_layout

    text = {
        "vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 16,
        "num_experts_per_tok": 3, "shared_expert_intermediate_size": 24, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "layer_types": ["linear_attention", "full_attention"],
    }  # fmt: skip
    vision = {
        "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
        "patch_size": 4, "temporal_patch_size": 1, "spatial_merge_size": 1,
    }  # fmt: skip
    model = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)
    )
    plan = EPPlan.from_config(load_config("qwen3_5_397b").parallel)
    assert plan.expert_parallel_size == 16 and plan.apply_modules == ("model.language_model.layers.{*}.mlp.experts",)
    modules = dict(model.named_modules())
    matched = plan.match(modules)
    assert matched == ["model.language_model.layers.0.mlp.experts", "model.language_model.layers.1.mlp.experts"]
    layout, _ = experts_layout(modules[matched[0]])
    assert layout is not None and layout.num_experts == 16 and not layout.in_out and not layout.hf_transpose
    layout, why = experts_layout(modules["model.language_model.layers.0.mlp.shared_expert"])
    assert layout is None and "no 3-D gate_up_proj" in why
    # The text model's pattern on the multimodal model: the error shows the path to write instead.
    with pytest.raises(
        ValueError, match=r"\(closest experts modules: model\.language_model\.layers\.\{\*\}\.mlp\.experts\)$"
    ):
        EPPlan(16, ["model.layers.{*}.mlp.experts"]).match(modules)
