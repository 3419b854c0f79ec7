"""Run configuration: one dataclass per component (the single source of defaults) and strict YAML loading.

The YAML keys follow the reference training configuration (``parallel.expert_parallel_size``,
``parallel.ep_plan.apply_modules``, ``parallel.ep_plan.dispatcher``, ``model.model_id``,
``model.use_grouped_expert_matmul``) plus the model sizes, training steps, seed, dtype and device.

Loading is strict: an unknown or duplicate key, a value of the wrong type (``bool`` is not an
``int``, a string is not a ``bool``), a size < 1, a float that is not finite, a backend name the
registry does not know or an impossible combination raises :class:`ConfigError` naming the full key
path (``parallel.ep_plan.dispatcher``), never a warning. The dataclasses also check their field
types on construction (``TypeError`` naming the field), so a config built in code is held to the
same types.

Configs ship with the package (``moe_gmm/configs/*.yaml``): :func:`load_config` takes a file path
or a packaged config's name (``"tiny"``), so the command line works from any directory.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from moe_gmm._validation import check_field_types, describe_type
from moe_gmm.config_yaml import ConfigError, load_yaml_bounded
from moe_gmm.config_yaml import key_text as _key_text
from moe_gmm.config_yaml import shown as _shown

__all__ = [
    "ConfigError",
    "EPPlanConfig",
    "ModelConfig",
    "ParallelConfig",
    "RunConfig",
    "TrainingConfig",
    "config_to_dict",
    "load_config",
    "packaged_configs",
    "parse_config",
    "resolve_config",
    "training_memory_bytes",
    "validate_config",
]

Device = Literal["cpu", "cuda", "npu"]
DType = Literal["bf16", "fp32"]


# The synthetic batches seed a generator with ``seed * 1_000_003 + step``; this keeps it in range.
MAX_SEED = 2**32 - 1
class _Typed:
    """Base of the config dataclasses: field types are checked on construction."""

    def __post_init__(self) -> None:
        check_field_types(self)


@dataclass
class EPPlanConfig(_Typed):
    """Which modules are expert-parallel and how tokens travel (``parallel.ep_plan``).

    The YAML side of :class:`moe_gmm.parallel.plan.EPPlan`, which checks the values (pattern
    syntax, dispatcher names); :func:`validate_config` builds one so a bad plan fails at load time.
    """

    # Anchored patterns over ``named_modules()`` names; ``{*}`` matches one layer index.
    apply_modules: list[str] = field(default_factory=lambda: ["model.layers.{*}.mlp.experts"])
    dispatcher: str = "alltoall"  # moe_gmm.parallel.plan.DISPATCHERS
    # Chunks the local tokens are split into by the "alltoall_overlap" dispatcher.
    num_chunks: int = 2


@dataclass
class ParallelConfig(_Typed):
    """``parallel``: a (dp, ep) DeviceMesh over ``torch.distributed`` (world = dp * ep)."""

    # Data-parallel ranks per expert shard (the mesh's dp dim); None = world size / expert_parallel_size.
    data_parallel_shard: int | None = None
    expert_parallel_size: int = 1
    ep_plan: EPPlanConfig = field(default_factory=EPPlanConfig)


@dataclass
class ModelConfig(_Typed):
    """``model``: a Qwen3.5-MoE text model's sizes (Hugging Face ``Qwen3_5MoeTextConfig`` names)."""

    model_id: Literal["qwen3_5_moe"] = "qwen3_5_moe"
    use_grouped_expert_matmul: bool = True
    # Grouped-matmul backend for the fused path; None = the registry's automatic choice.
    gmm_backend: str | None = None
    vocab_size: int = 128
    hidden_size: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    linear_key_head_dim: int = 16
    linear_value_head_dim: int = 16
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    # Every n-th layer is full attention, the others linear attention (as in Qwen3.5).
    full_attention_interval: int = 2
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    shared_expert_intermediate_size: int = 32
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0
    max_position_embeddings: int = 4096


@dataclass
class TrainingConfig(_Typed):
    """``training``: a short run on deterministic synthetic tokens."""

    steps: int = 20
    micro_batch_size: int = 4
    seq_len: int = 32
    lr: float = 1.0e-3
    weight_decay: float = 0.0
    # Max global gradient norm; null or 0 turns clipping off (a negative value is refused).
    grad_clip: float | None = 1.0
    # Save a checkpoint every this many steps (and at the end); 0 = only at the end.
    checkpoint_every: int = 0


@dataclass
class RunConfig(_Typed):
    """The whole file."""

    seed: int = 0
    device: Device = "cpu"
    dtype: DType = "fp32"
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)


# ----------------------------------------------------------------------------------------------
# Strict mapping of plain data (parsed YAML) onto the dataclasses
# ----------------------------------------------------------------------------------------------


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected {describe_type(tp)}, got {_shown(value)}")
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {describe_type(tp)}, got {type(value).__name__} {_shown(value)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {describe_type(tp)}, got {type(value).__name__} {_shown(value)}")
        (item_tp,) = typing.get_args(tp)
        return [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -(2**63) <= value < 2**63:
                raise ConfigError(f"{path}: {value} does not fit in a 64-bit integer")
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            # PyYAML reads ``1e-3`` (no dot) as a string; say so rather than guess.
            raise ConfigError(f"{path}: expected float, got string {_shown(value)} (YAML needs a dot: write 1.0e-3)")
    elif tp is str:
        if isinstance(value, str):
            return value
    else:  # pragma: no cover - a schema field of a type this loader does not know
        raise TypeError(f"unsupported config field type {tp!r} at {path}")
    raise ConfigError(f"{path}: expected {describe_type(tp)}, got {type(value).__name__} {_shown(value)}")


def _build(cls: type, data: Any, path: str) -> Any:
    where = path or "<top level>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} {_shown(data)}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in known:
            full = f"{path}.{_key_text(key)}" if path else _key_text(key)
            raise ConfigError(f"{full}: unknown key (allowed under {where}: {', '.join(sorted(known))})")
    kwargs = {key: _convert(value, hints[key], f"{path}.{key}" if path else key) for key, value in data.items()}
    return cls(**kwargs)


def validate_config(cfg: RunConfig, *, world_size: int | None = None) -> RunConfig:
    """Reject out-of-range values and impossible combinations; ``world_size`` (if known) bounds the EP size."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    positive = {
        "model.vocab_size": m.vocab_size,
        "model.hidden_size": m.hidden_size,
        "model.num_hidden_layers": m.num_hidden_layers,
        "model.num_attention_heads": m.num_attention_heads,
        "model.num_key_value_heads": m.num_key_value_heads,
        "model.head_dim": m.head_dim,
        "model.linear_key_head_dim": m.linear_key_head_dim,
        "model.linear_value_head_dim": m.linear_value_head_dim,
        "model.linear_num_key_heads": m.linear_num_key_heads,
        "model.linear_num_value_heads": m.linear_num_value_heads,
        "model.full_attention_interval": m.full_attention_interval,
        "model.num_experts": m.num_experts,
        "model.num_experts_per_tok": m.num_experts_per_tok,
        "model.moe_intermediate_size": m.moe_intermediate_size,
        "model.shared_expert_intermediate_size": m.shared_expert_intermediate_size,
        "model.max_position_embeddings": m.max_position_embeddings,
        "parallel.expert_parallel_size": p.expert_parallel_size,
        "training.steps": t.steps,
        "training.micro_batch_size": t.micro_batch_size,
        "training.seq_len": t.seq_len,
    }
    for key, value in positive.items():
        if value < 1:
            raise ConfigError(f"{key}: must be >= 1, got {value}")
    # Training predicts token t+1 from token t: one position leaves no target (the loss is NaN)
    # and one vocabulary entry leaves nothing to predict.
    for key, value in {"training.seq_len": t.seq_len, "model.vocab_size": m.vocab_size}.items():
        if value < 2:
            raise ConfigError(f"{key}: must be >= 2 for a causal LM to have a next token to learn, got {value}")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"seed: must be in [0, {MAX_SEED}], got {cfg.seed}")
    for key, value in {
        "training.lr": t.lr,
        "training.weight_decay": t.weight_decay,
        "training.grad_clip": t.grad_clip,
        "model.router_aux_loss_coef": m.router_aux_loss_coef,
    }.items():
        if value is not None and not math.isfinite(value):
            raise ConfigError(f"{key}: must be a finite number, got {value}")
    if t.lr <= 0:
        raise ConfigError(f"training.lr: must be > 0, got {t.lr}")
    if t.weight_decay < 0:
        raise ConfigError(f"training.weight_decay: must be >= 0, got {t.weight_decay}")
    if t.grad_clip is not None and t.grad_clip < 0:
        raise ConfigError(f"training.grad_clip: must be > 0, or 0 / null for no clipping, got {t.grad_clip}")
    if m.router_aux_loss_coef < 0:
        raise ConfigError(f"model.router_aux_loss_coef: must be >= 0, got {m.router_aux_loss_coef}")
    if t.checkpoint_every < 0:
        raise ConfigError(f"training.checkpoint_every: must be >= 0, got {t.checkpoint_every}")
    if m.num_experts_per_tok > m.num_experts:
        raise ConfigError(
            f"model.num_experts_per_tok: top-k {m.num_experts_per_tok} exceeds model.num_experts {m.num_experts}"
        )
    if m.num_attention_heads % m.num_key_value_heads:
        raise ConfigError(
            f"model.num_key_value_heads: {m.num_key_value_heads} must divide "
            f"model.num_attention_heads {m.num_attention_heads}"
        )
    if m.linear_num_value_heads % m.linear_num_key_heads:
        raise ConfigError(
            f"model.linear_num_value_heads: {m.linear_num_value_heads} must be a multiple of "
            f"model.linear_num_key_heads {m.linear_num_key_heads}"
        )
    if m.full_attention_interval > m.num_hidden_layers:
        raise ConfigError(
            f"model.full_attention_interval: {m.full_attention_interval} exceeds model.num_hidden_layers "
            f"{m.num_hidden_layers} (the model needs at least one full-attention layer)"
        )
    if t.seq_len > m.max_position_embeddings:
        raise ConfigError(
            f"training.seq_len: {t.seq_len} exceeds model.max_position_embeddings {m.max_position_embeddings}"
        )
    if m.gmm_backend is not None:
        from moe_gmm.ops.backends import registered_backends

        names = sorted(registered_backends())
        if m.gmm_backend not in names:
            raise ConfigError(
                f"model.gmm_backend: {_shown(m.gmm_backend)} is not a registered backend; registered: {names}"
            )
    if m.num_experts % p.expert_parallel_size:
        raise ConfigError(
            f"parallel.expert_parallel_size: {p.expert_parallel_size} must divide model.num_experts "
            f"{m.num_experts} (each rank owns an equal block of experts)"
        )
    if world_size is not None and p.expert_parallel_size > world_size:
        raise ConfigError(
            f"parallel.expert_parallel_size: {p.expert_parallel_size} is larger than the world size {world_size}"
        )
    if world_size is not None and world_size % p.expert_parallel_size:
        raise ConfigError(
            f"parallel.expert_parallel_size: {p.expert_parallel_size} must divide the world size {world_size}"
        )
    if p.data_parallel_shard is not None and p.data_parallel_shard < 1:
        raise ConfigError(f"parallel.data_parallel_shard: must be >= 1 or null, got {p.data_parallel_shard}")
    if world_size is not None and p.data_parallel_shard is not None:
        mesh = p.data_parallel_shard * p.expert_parallel_size
        if mesh != world_size:
            raise ConfigError(
                f"parallel.data_parallel_shard: {p.data_parallel_shard} x parallel.expert_parallel_size "
                f"{p.expert_parallel_size} = {mesh} must equal the world size {world_size} (or set it to null)"
            )
    from moe_gmm.parallel.plan import EPPlan

    try:
        EPPlan.from_config(p)
    except (TypeError, ValueError) as exc:  # its messages start with the key path
        raise ConfigError(str(exc)) from None
    return cfg


def parse_config(data: Any, *, world_size: int | None = None) -> RunConfig:
    """Map parsed YAML (nested dicts) onto :class:`RunConfig`, strictly, and validate it."""
    return validate_config(_build(RunConfig, data, ""), world_size=world_size)


def packaged_configs() -> dict[str, Path]:
    """The configs shipped with the package, by name (the file name without ``.yaml``)."""
    folder = Path(__file__).resolve().parent / "configs"
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def resolve_config(name_or_path: str | Path) -> Path:
    """The file behind ``--config``: an existing file, else the packaged config of that name.

    A value that names neither raises :class:`ConfigError` listing the packaged names; one that
    looks like a path (a folder separator or a ``.yaml`` / ``.yml`` suffix) is returned as it is,
    so reading it reports the missing file.
    """
    if not isinstance(name_or_path, (str, Path)):
        raise TypeError(f"config must be a str or Path, got {type(name_or_path).__name__}")
    path = Path(name_or_path)
    if path.is_file():
        return path
    packaged = packaged_configs()
    text = str(name_or_path)
    if text in packaged:
        return packaged[text]
    if path.suffix in (".yaml", ".yml") or "/" in text or "\\" in text:
        return path
    raise ConfigError(
        f"config {text!r}: no such file and no packaged config of that name (packaged: {', '.join(packaged)})"
    )


def load_config(path: str | Path, *, world_size: int | None = None) -> RunConfig:
    """Read a YAML file, or a packaged config by name (:func:`resolve_config`), into a validated
    :class:`RunConfig`; every problem is a :class:`ConfigError`.

    The file is read within :mod:`moe_gmm.config_yaml`'s bounds (size, YAML nodes after aliases,
    duplicate keys), so a wrong or hostile file fails in milliseconds instead of exhausting memory.
    """
    path = resolve_config(path)
    data = load_yaml_bounded(path, missing_hint=f"packaged configs: {', '.join(packaged_configs())}")
    return parse_config(data, world_size=world_size)


def training_memory_bytes(cfg: RunConfig, *, world_size: int = 1) -> int:
    """A lower bound on the bytes one process needs to train ``cfg``'s model: the embeddings and
    routed plus shared experts (attention left out), each held as weight, gradient and AdamW's two
    moments, sharded over ``world_size`` ranks, plus one micro-batch of float32 logits.

    Kept a lower bound so that it never refuses a run that fits; its job is to turn sizes that can
    never be allocated (``hidden_size: 100000000``) into a usage error before the model is built.
    """
    m, t = cfg.model, cfg.training
    per_layer = m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size
    per_layer += 3 * m.hidden_size * m.shared_expert_intermediate_size
    params = 2 * m.vocab_size * m.hidden_size + m.num_hidden_layers * per_layer  # untied embeddings and head
    bytes_per_value = 2 if cfg.dtype == "bf16" else 4
    logits = t.micro_batch_size * t.seq_len * m.vocab_size * 4
    return 4 * params * bytes_per_value // max(1, world_size) + logits


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """Plain nested dict (the YAML shape) of a config."""
    return dataclasses.asdict(cfg)
