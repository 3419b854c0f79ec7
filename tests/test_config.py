"""Strict YAML config loading: defaults, shipped files, and every kind of bad input naming its key."""

from __future__ import annotations

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_gmm.config import (
    ConfigError,
    EPPlanConfig,
    ModelConfig,
    ParallelConfig,
    RunConfig,
    TrainingConfig,
    config_to_dict,
    load_config,
    packaged_configs,
    parse_config,
    resolve_config,
)

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "moe_gmm" / "configs"


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


def test_packaged_configs_load_by_name_from_any_directory(tmp_path, monkeypatch):
    assert list(packaged_configs()) == ["qwen3_5_397b", "tiny", "tiny_dp2_ep2"]
    monkeypatch.chdir(tmp_path)  # nothing named tiny here: the name finds the packaged file
    assert resolve_config("tiny") == CONFIGS / "tiny.yaml"
    assert load_config("tiny") == RunConfig()
    assert load_config("qwen3_5_397b").parallel.expert_parallel_size == 16


def test_a_path_wins_over_a_packaged_name(tmp_path, monkeypatch):
    (tmp_path / "tiny").write_text("seed: 7\n")
    monkeypatch.chdir(tmp_path)
    assert load_config("tiny").seed == 7
    own = tmp_path / "own.yaml"
    own.write_text("training:\n  steps: 3\n")
    assert load_config(own).training.steps == 3 and load_config(str(own)).training.steps == 3


def test_unknown_config_names_list_the_packaged_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ConfigError,
        match=r"^config 'tiyn': no such file and no packaged config of that name "
        r"\(packaged: qwen3_5_397b, tiny, tiny_dp2_ep2\)$",
    ):
        load_config("tiyn")
    # Something shaped like a path is read as one: the missing file is the error, with the names.
    with pytest.raises(
        ConfigError,
        match=r"^config file 'configs/tiny.yaml': cannot be read \(No such file or "
        r"directory; packaged configs: qwen3_5_397b, tiny, tiny_dp2_ep2\)$",
    ):
        load_config("configs/tiny.yaml")
    with pytest.raises(TypeError, match=r"config must be a str or Path, got int"):
        load_config(3)


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


def test_data_parallel_shard_must_fit_the_world():
    data = _set(_tiny(), "parallel.expert_parallel_size", 2)
    with pytest.raises(ConfigError, match=r"^parallel\.data_parallel_shard: must be >= 1 or null, got 0"):
        parse_config(_set(data, "parallel.data_parallel_shard", 0))
    with pytest.raises(ConfigError, match=r"^parallel\.data_parallel_shard: expected int or null, got str"):
        parse_config(_set(data, "parallel.data_parallel_shard", "2"))
    with pytest.raises(ConfigError, match=r"^parallel\.data_parallel_shard: 3 x parallel\.expert_parallel_size 2 = 6 "):
        parse_config(_set(data, "parallel.data_parallel_shard", 3), world_size=4)
    assert parse_config(_set(data, "parallel.data_parallel_shard", 2), world_size=4).parallel.data_parallel_shard == 2
    assert parse_config(data, world_size=4).parallel.data_parallel_shard is None  # null: world / ep


def test_config_error_is_a_value_error_and_file_errors_are_config_errors(tmp_path):
    assert issubclass(ConfigError, ValueError)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("training.lr", float("nan"), r"^training\.lr: must be a finite number"),
        ("training.lr", float("-inf"), r"^training\.lr: must be a finite number"),
        ("training.weight_decay", -0.5, r"^training\.weight_decay: must be >= 0"),
        ("training.grad_clip", -1.0, r"^training\.grad_clip: must be > 0, or 0 / null for no clipping"),
        ("training.grad_clip", float("inf"), r"^training\.grad_clip: must be a finite number"),
        ("model.router_aux_loss_coef", -0.1, r"^model\.router_aux_loss_coef: must be >= 0"),
        ("model.max_position_embeddings", 0, r"^model\.max_position_embeddings: must be >= 1, got 0"),
        ("model.linear_key_head_dim", 0, r"^model\.linear_key_head_dim: must be >= 1, got 0"),
        ("model.linear_num_value_heads", 3, r"^model\.linear_num_value_heads: 3 must be a multiple of"),
        ("model.full_attention_interval", 3, r"^model\.full_attention_interval: 3 exceeds model\.num_hidden_layers 2"),
        ("model.max_position_embeddings", 31, r"^training\.seq_len: 32 exceeds model\.max_position_embeddings 31"),
        ("model.gmm_backend", "bogus", r"^model\.gmm_backend: 'bogus' is not a registered backend; registered: \["),
        ("model.hidden_size", 2**64, r"^model\.hidden_size: 18446744073709551616 does not fit in a 64-bit integer"),
        ("seed", 2**32, r"^seed: must be in \[0, 4294967295\]"),
        ("model.norm_topk_prob", "no", r"^model\.norm_topk_prob: expected bool, got str 'no'"),
        ("training.grad_clip", "off", r"^training\.grad_clip: expected float or null, got str 'off'"),
    ],
)
def test_out_of_range_values_name_the_key(key, value, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(_set(_tiny(), key, value))


def test_grad_clip_null_or_zero_means_off_and_backends_come_from_the_registry():
    assert parse_config(_set(_tiny(), "training.grad_clip", None)).training.grad_clip is None
    assert parse_config(_set(_tiny(), "training.grad_clip", 0)).training.grad_clip == 0.0
    assert parse_config(_set(_tiny(), "model.gmm_backend", "eager")).model.gmm_backend == "eager"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("model:\n  hidden_size: 64\n  hidden_size: 32\n", r"^model\.hidden_size: duplicate key \(lines 2 and 3"),
        ("seed: 1\ntraining: {}\nseed: 2\n", r"^seed: duplicate key \(lines 1 and 3"),
        ("training:\n  steps: 1\ntraining:\n  steps: 2\n", r"^training: duplicate key \(lines 1 and 3"),
        (
            "parallel:\n  ep_plan:\n    dispatcher: alltoall\n    dispatcher: alltoall\n",
            r"^parallel\.ep_plan\.dispatcher: duplicate key \(lines 3 and 4",
        ),
    ],
)
def test_duplicate_yaml_keys_are_refused(text, match, tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(path)


def test_anchors_and_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "anchors.yaml"
    # A merged key that the mapping then sets itself is YAML's override, not a duplicate.
    path.write_text("model: &m\n  <<: {num_experts: 4, hidden_size: 16}\n  num_experts: 8\n")
    cfg = load_config(path)
    assert (cfg.model.num_experts, cfg.model.hidden_size) == (8, 16)


def test_unsafe_and_undecodable_files_are_config_errors(tmp_path):
    path = tmp_path / "tag.yaml"
    path.write_text("seed: !!python/object/apply:os.getpid []\n")
    with pytest.raises(ConfigError, match=r"not valid YAML \(could not determine a constructor"):
        load_config(path)
    path.write_bytes(b"seed: \xff\n")
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(path)


_SECTIONS = {
    "RunConfig": RunConfig,
    "ModelConfig": ModelConfig,
    "TrainingConfig": TrainingConfig,
    "ParallelConfig": ParallelConfig,
    "EPPlanConfig": EPPlanConfig,
}
# A value of the wrong type for every kind of field annotation the schema uses.
_WRONG = {
    "int": ["8", 8.0, True, None],
    "float": ["1e-3", True, None, [1.0]],
    "bool": ["false", 1, 0, None],
    "str": [3, b"x", None],
}


@given(st.data())
@settings(max_examples=60, deadline=None)
def test_every_config_dataclass_checks_its_field_types_on_construction(data):
    cls = data.draw(st.sampled_from(sorted(_SECTIONS)))
    fields = {f.name: f for f in dataclasses.fields(_SECTIONS[cls])}
    hints = typing.get_type_hints(_SECTIONS[cls])
    kinds = {name: typing.get_args(hints[name]) or (hints[name],) for name in fields}
    simple = [n for n, k in kinds.items() if k[0] in (int, float, bool, str) and type(None) not in k]
    name = data.draw(st.sampled_from(sorted(simple)))
    value = data.draw(st.sampled_from(_WRONG[kinds[name][0].__name__]))
    with pytest.raises(TypeError, match=rf"^{cls}\.{name}: expected "):
        _SECTIONS[cls](**{name: value})


def test_config_dataclasses_check_nested_and_literal_fields():
    with pytest.raises(TypeError, match=r"^RunConfig\.model: expected ModelConfig, got dict"):
        RunConfig(model={"hidden_size": 8})
    with pytest.raises(TypeError, match=r"^RunConfig\.dtype: expected one of 'bf16', 'fp32', got str 'fp16'"):
        RunConfig(dtype="fp16")
    with pytest.raises(TypeError, match=r"^EPPlanConfig\.apply_modules: expected list of str"):
        EPPlanConfig(apply_modules=["a", 1])
    with pytest.raises(TypeError, match=r"^TrainingConfig\.grad_clip: expected float or null"):
        TrainingConfig(grad_clip="off")
    assert TrainingConfig(grad_clip=None, lr=1).lr == 1
