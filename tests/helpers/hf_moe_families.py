"""Every transformers MoE family whose experts use the experts interface, as a tiny model.

Families are found in the installed transformers, not listed: a ``modeling_<family>.py`` whose
experts class went through ``@use_experts_implementation``. Each is built from its own config
class's defaults shrunk to a tiny size; :data:`CONFIG_OVERRIDES` holds only what a family needs
beyond that to build small.
"""

from __future__ import annotations

import copy
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

TINY: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "shared_intermediate_size": 16, "share_expert_dim": 16,
    "moe_shared_expert_intermediate_size": 16, "first_dense_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "num_experts_per_tok": 2,
    "max_position_embeddings": 64, "sliding_window": 16, "n_group": 1, "topk_group": 1,
    "first_k_dense_replace": 0, "decoder_sparse_step": 1, "mlp_only_layers": [], "num_dense_layers": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "qk_head_dim": 16, "n_shared_experts": 1, "linear_head_dim": 8, "linear_num_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "index_head_dim": 8, "index_n_heads": 2, "index_topk": 4, "num_sliding_attention_heads": 4,
    "router_hidden_size": 16, "top_k_experts": 2, "enable_moe_block": True, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 128, "moe_hidden_size": 24, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
NUM_EXPERTS = 4
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

# Per family: config values beyond TINY that a tiny model needs (the defaults are full size).
CONFIG_OVERRIDES: dict[str, dict[str, Any]] = {
    "deepseek_ocr2": {"mlp_layer_types": ["dense", "sparse"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "zaya": {"num_experts_per_tok": 1},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 1, "expert_layer_offset": 0,
              "mamba_dt_rank": 8, "use_mamba_kernels": False},
    "nemotron_h": {"layers_block_type": ["full_attention", "moe"], "mamba_num_heads": 4, "mamba_head_dim": 8,
                   "use_mamba_kernels": False},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"], "mamba_n_heads": 4,
                         "mamba_d_head": 16, "mamba_d_state": 8, "mamba_chunk_size": 8},
    "kolibri1_1": {"kv_source_layers": [0, 1], "index_layers": [1], "head_dim": 16, "index_num_heads": 1,
                   "layer_types": ["sliding_attention", "indexed_attention"]},
    "hy_v4_vl": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", "mrope_section": [2, 1, 1]}},
    "glm4v_moe": {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5, "rope_type": "default",
                                      "mrope_section": [1, 0, 1]}},
    "mistral4": {"head_dim": 16},
    "qwen4_exp": {"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 4,
                  "indexer_compress_ratio": 2, "ple_embed_dim": 8},
    "dots3_note": {"layer_types": ["indexed_attention", "indexed_attention"]},
    "mimo_v2_flash": {"head_dim": 24, "v_head_dim": 16, "num_key_value_heads": 2},
    "glm5_next": {"qk_rope_head_dim": 0, "head_dim": 0, "qk_head_dim": 8, "index_kpool": 2},
    "ernie4_5_vl_moe": {"moe_intermediate_size": [16, 16],
                        "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default", "mrope_section": [1, 1, 2]}},
}  # fmt: skip


@dataclass(frozen=True)
class Family:
    name: str  # the ``transformers.models`` subpackage
    experts_class: str  # the class that went through ``@use_experts_implementation``
    model_class: str  # a ``*ForCausalLM`` when the family has one, else its text model


def _is_experts_interface_class(obj: object) -> bool:
    forward = vars(obj).get("forward") if isinstance(obj, type) else None
    return "use_experts_implementation" in getattr(getattr(forward, "__code__", None), "co_qualname", "")


def is_experts_module(module: torch.nn.Module) -> bool:
    """An instance of an experts-interface class (or of a subclass that wraps its forward)."""
    return any(_is_experts_interface_class(c) for c in type(module).__mro__)


def discover_families() -> list[Family]:
    """Families of the installed transformers with an experts-interface class and a text model to build."""
    import transformers.models

    found = []
    root = Path(transformers.models.__file__).parent
    for path in sorted(root.glob("*/modeling_*.py")):
        if "use_experts_implementation" not in path.read_text():  # import only the candidates
            continue
        module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
        local = {n: c for n, c in vars(module).items() if isinstance(c, type) and c.__module__ == module.__name__}
        experts = sorted(n for n, c in local.items() if _is_experts_interface_class(c))
        if not experts:
            continue
        model = _text_model(local)
        found.append(Family(path.parent.name, experts[0], model.__name__))
    return found


def _text_model(local: dict[str, type]) -> type:
    for suffixes in (("ForCausalLM",), ("TextModel",), ("Model",)):
        names = sorted(n for n, c in local.items() if n.endswith(suffixes) and hasattr(c, "config_class"))
        names = [n for n in names if "Vision" not in n and "Audio" not in n and "Talker" not in n]
        if names:
            return local[min(names, key=len)]
    raise LookupError(f"no text model among {sorted(local)}")


def tiny_config(family: Family, **overrides: Any) -> Any:
    """A fresh tiny config of ``family`` (a new object on every call: never share one between models);
    ``overrides`` win over everything."""
    module = importlib.import_module(f"transformers.models.{family.name}.modeling_{family.name}")
    config_cls = getattr(module, family.model_class).config_class
    default = config_cls()
    values = {k: copy.deepcopy(v) for k, v in TINY.items() if _has(default, k)}
    values.update({k: NUM_EXPERTS for k in EXPERT_COUNT_KEYS if _has(default, k)})
    layers = getattr(default, "num_hidden_layers", None)
    for key, value in vars(default).items():  # per-layer lists given in full follow the layer count
        if isinstance(value, list) and layers and len(value) == layers and key not in values:
            values[key] = _two_layers(value)
    values.update(copy.deepcopy(CONFIG_OVERRIDES.get(family.name, {})))
    return config_cls(**{**values, **overrides})


def _has(config: Any, key: str) -> bool:
    try:
        return hasattr(config, key)
    except RuntimeError:  # a per-layer config refusing a global read of a per-layer field: it has one
        return True


def _two_layers(per_layer: list) -> list:
    """Two layers' entries of a per-layer list: layer indices stay valid, a hybrid keeps two kinds."""
    if per_layer == list(range(len(per_layer))):
        return [0, 1]
    other = next((v for v in per_layer if v != per_layer[0]), per_layer[-1])
    return [per_layer[0], other]


def build(
    family: Family, experts_implementation: str, state: dict[str, torch.Tensor] | None = None, **overrides: Any
) -> torch.nn.Module:
    """A tiny ``family`` model on its own config, in fp32 training mode; ``state`` loads given weights,
    ``overrides`` go to :func:`tiny_config`."""
    module = importlib.import_module(f"transformers.models.{family.name}.modeling_{family.name}")
    config = tiny_config(family, **overrides)
    torch.manual_seed(0)
    model = getattr(module, family.model_class)(config).float().train()
    model.set_experts_implementation(experts_implementation)
    if state is not None:
        model.load_state_dict(state)
    return model
