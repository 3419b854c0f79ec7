"""Strict YAML config loading: defaults, shipped files, and every kind of bad input naming its key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from moe_gmm.config import (
    ConfigError,
    RunConfig,
    config_to_dict,
    load_config,
    parse_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _tiny() -> dict:
    return yaml.safe_load((CONFIGS / "tiny.yaml").read_text())


def test_tiny_yaml_matches_dataclass_defaults():
    # The dataclasses are the single source of defaults; the shipped default file restates them.
    assert load_config(CONFIGS / "tiny.yaml") == RunConfig()


def test_reference_config_is_schema_valid_with_reference_keys():
    cfg = load_config(CONFIGS / "qwen3_5_397b.yaml", world_size=256)
    assert cfg.parallel.expert_parallel_size == 16
    assert cfg.parallel.ep_plan.apply_modules == ["model.language_model.layers.{*}.mlp.experts"]
    assert cfg.parallel.ep_plan.dispatcher == "alltoall"
    assert cfg.model.model_id == "qwen3_5_moe"
    assert cfg.model.use_grouped_expert_matmul is True
    assert (cfg.model.hidden_size, cfg.model.num_experts, cfg.model.num_experts_per_tok) == (4096, 512, 10)
    assert cfg.model.num_experts % cfg.parallel.expert_parallel_size == 0


def test_round_trip_through_dict():
    cfg = load_config(CONFIGS / "qwen3_5_397b.yaml")
    assert parse_config(config_to_dict(cfg)) == cfg


def test_missing_sections_take_defaults():
    cfg = parse_config({"model": {"num_experts": 4}})
    assert cfg.model.num_experts == 4
    assert cfg.training == RunConfig().training


def _set(data: dict, dotted: str, value) -> dict:
    data = copy.deepcopy(data)
    *parents, last = dotted.split(".")
    node = data
    for p in parents:
        node = node[p]
    node[last] = value
    return data


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("parallel.ep_plan.dispatcher", "carrier_pigeon", r"^parallel\.ep_plan\.dispatcher: expected one of"),
        ("parallel.expert_parallel_size", "4", r"^parallel\.expert_parallel_size: expected int, got str"),
        ("parallel.expert_parallel_size", 2.0, r"^parallel\.expert_parallel_size: expected int, got float"),
        ("model.use_grouped_expert_matmul", "yes please", r"^model\.use_grouped_expert_matmul: expected bool"),
        ("model.num_experts", True, r"^model\.num_experts: expected int, got bool"),
        ("model.model_id", "llama", r"^model\.model_id: expected one of 'qwen3_5_moe'"),
        (
            "parallel.ep_plan.apply_modules",
            "model.layers.{*}.mlp.experts",
            r"^parallel\.ep_plan\.apply_modules: expected list",
        ),
        ("parallel.ep_plan.apply_modules", ["ok", 3], r"^parallel\.ep_plan\.apply_modules\[1\]: expected str"),
        ("training.lr", "1e-3", r"^training\.lr: expected float, got string '1e-3' \(YAML needs a dot"),
        ("dtype", "fp8", r"^dtype: expected one of 'bf16', 'fp32'"),
        ("device", "tpu", r"^device: expected one of"),
        ("model", [1, 2], r"^model: expected a mapping"),
    ],
)
def test_wrong_type_names_the_key(key, value, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(_set(_tiny(), key, value))


@pytest.mark.parametrize(
    ("key", "match"),
    [
        (
            "parallel.ep_plan.dispatchr",
            r"^parallel\.ep_plan\.dispatchr: unknown key \(allowed under parallel\.ep_plan: apply_modules, dispatcher, num_chunks\)",
        ),
        ("model.num_expert", r"^model\.num_expert: unknown key"),
        ("trainig", r"^trainig: unknown key \(allowed under <top level>"),
    ],
)
def test_unknown_key_names_the_full_path(key, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(_set(_tiny(), key, 1))


def test_impossible_combinations():
    with pytest.raises(ConfigError, match=r"^parallel\.expert_parallel_size: 3 must divide model\.num_experts 8"):
        parse_config(_set(_tiny(), "parallel.expert_parallel_size", 3))
    with pytest.raises(ConfigError, match=r"^parallel\.expert_parallel_size: 4 is larger than the world size 2"):
        parse_config(_set(_tiny(), "parallel.expert_parallel_size", 4), world_size=2)
    with pytest.raises(ConfigError, match=r"^model\.num_experts_per_tok: top-k 9 exceeds model\.num_experts 8"):
        parse_config(_set(_tiny(), "model.num_experts_per_tok", 9))
    with pytest.raises(ConfigError, match=r"^training\.steps: must be >= 1, got 0"):
        parse_config(_set(_tiny(), "training.steps", 0))
    data = _set(_tiny(), "parallel.expert_parallel_size", 2)
    with pytest.raises(ConfigError, match=r"^parallel\.ep_plan\.apply_modules: must name at least one module"):
        parse_config(_set(data, "parallel.ep_plan.apply_modules", []))
    # The plan itself is checked by moe_gmm.parallel's EPPlan (pattern syntax, dispatcher, chunks).
    with pytest.raises(ConfigError, match=r"^parallel\.ep_plan\.num_chunks: expected an int >= 1, got 0"):
        parse_config(_set(data, "parallel.ep_plan.num_chunks", 0))
    with pytest.raises(ConfigError, match=r"parallel\.ep_plan"):
        parse_config(_set(data, "parallel.ep_plan.apply_modules", ["model.layers.{x-y}.mlp.experts"]))
    # EP 2 of world 2 is fine.
    assert parse_config(data, world_size=2).parallel.expert_parallel_size == 2


def test_config_error_is_a_value_error_and_file_errors_are_config_errors(tmp_path):
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
