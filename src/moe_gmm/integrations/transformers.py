"""Run Hugging Face MoE models' routed experts on moe-gmm's grouped matmul.

Hugging Face (transformers >= 5) experts modules store ``gate_up_proj [E, 2I, H]`` (rows ``[:I]``
gate, ``[I:]`` up) and ``down_proj [E, H, I]`` and dispatch their forward through
``transformers.integrations.moe.ExpertsInterface``. :func:`register_moe_gmm_experts` adds the
implementation ``"moe_gmm"`` there::

    from moe_gmm.integrations.transformers import register_moe_gmm_experts

    register_moe_gmm_experts()
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="moe_gmm")
    # or, on a loaded model: model.set_experts_implementation("moe_gmm")

It runs ``permute -> GMM -> SwiGLU -> GMM -> unpermute`` on the module's own parameters, passing
``.transpose(1, 2)`` views to the grouped matmul: no weight is copied per step and gradients land
on the Hugging Face parameters. Attention, dense MLPs, routers and shared experts are untouched.

The state-dict converters map between Hugging Face's experts layout and
:class:`~moe_gmm.layers.SparseMoeBlock`'s (``[E, H, 2I]`` / ``[E, I, H]``); every other key passes
through unchanged, so a Qwen3.5-MoE sparse block's state dict loads into a ``SparseMoeBlock``.

transformers is imported lazily: importing this module does not need it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from moe_gmm.integrations.support import expert_mlp_support, module_mlp
from moe_gmm.layers.moe_block import MoeBlockConfig
from moe_gmm.ops.expert_mlp import routed_experts

__all__ = [
    "ExpertsDescription",
    "describe_experts",
    "hf_to_moe_gmm_state_dict",
    "make_moe_gmm_experts_forward",
    "moe_block_config_from_hf",
    "moe_gmm_to_hf_state_dict",
    "register_moe_gmm_experts",
]

# ``<prefix>experts.gate_up_proj`` / ``<prefix>experts.down_proj``: the stacked 3-D expert weights.
_STACKED_KEY = re.compile(r"^(?P<prefix>(?:.*\.)?experts\.)(?P<name>gate_up_proj|down_proj)$")
# ``<prefix>experts.<e>.{gate,up,down}_proj.weight``: per-expert nn.Linear weights (hub checkpoints).
_PER_EXPERT_KEY = re.compile(
    r"^(?P<prefix>(?:.*\.)?experts\.)(?P<e>\d+)\.(?P<name>gate_proj|up_proj|down_proj)\.weight$"
)


# --------------------------------------------------------------------------------------------
# The experts forward registered in transformers.
# --------------------------------------------------------------------------------------------


def make_moe_gmm_experts_forward(*, backend: str | None = None, fused: bool = True) -> Callable[..., torch.Tensor]:
    """An experts forward ``fn(self, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``.

    ``backend`` forces a grouped-matmul backend (default: ``$MOE_GMM_BACKEND`` or auto);
    ``fused=False`` runs the eager per-expert loop. What runs is decided by
    :func:`~moe_gmm.integrations.support.expert_mlp_support`, the rule expert parallelism shares:
    plain SwiGLU experts (Qwen3.5-MoE, Qwen3-MoE, Mixtral, OLMoE, ...) take
    :func:`~moe_gmm.ops.expert_mlp`; other gates (clamped, interleaved halves, other activations)
    and post-expert norms plug the module's own ``_apply_gate`` / ``post_expert_norm`` into the same
    pipeline (:func:`~moe_gmm.ops.expert_mlp.routed_experts`). Modules the rule refuses (biases,
    no gate) run it too, with the biases added and the module's own gate or activation.
    """

    def moe_gmm_experts_forward(
        self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if getattr(self, "_is_expert_parallel", False):
            raise NotImplementedError(
                "experts_implementation='moe_gmm' does not run under transformers' expert parallelism; "
                "use moe_gmm.parallel (apply_expert_parallel) instead"
            )
        first = self.gate_up_proj if self.has_gate else self.up_proj
        second = self.down_proj
        if not self.is_transposed:
            # [E, out, in] -> [E, in, out] views, read in place by the grouped matmul.
            first, second = first.transpose(1, 2), second.transpose(1, 2)
        # Same rule as transformers' grouped_mm path: the input follows the weights' dtype (autocast).
        x_TH = hidden_states.to(first.dtype)
        # Refused modules (biases, no gate) run the same pipeline with their biases and activation.
        parts = module_mlp(self, expert_mlp_support(self))
        out_TH, _ = routed_experts(
            x_TH, top_k_index, top_k_weights, first, second, fused=fused, backend=backend,
            validate_routing=False,  # ids come from the model's router top-k: in range, no host sync
            **parts,
        )  # fmt: skip
        return out_TH.to(hidden_states.dtype)

    moe_gmm_experts_forward.moe_gmm_settings = {"fused": fused, "backend": backend}  # read by describe_experts
    return moe_gmm_experts_forward


def register_moe_gmm_experts(name: str = "moe_gmm", *, backend: str | None = None, fused: bool = True) -> str:
    """Register the moe-gmm experts forward in transformers' ``ExpertsInterface`` under ``name``.

    Global and idempotent (a second call replaces an entry this function made). Returns ``name``,
    the value for ``experts_implementation=``. Raises ``ValueError`` for a name transformers or
    another library already uses (``"eager"``, ``"grouped_mm"``...): the registry is global, so
    taking one over would change every model that asks for it. Raises ``ImportError`` when
    transformers is missing or too old.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    try:
        from transformers.integrations.moe import ExpertsInterface
    except ImportError as exc:  # transformers absent, or < 5 (no experts interface)
        raise ImportError("register_moe_gmm_experts needs transformers>=5.24 (pip install 'moe-gmm[hf]')") from exc
    registered = ExpertsInterface()
    # "eager" is transformers' reference loop: it is never in the mapping, but an entry would replace it.
    if name == "eager" or (name in registered and not getattr(registered[name], _OURS, False)):
        raise ValueError(
            f"name={name!r} is an experts implementation transformers or another library registered; "
            f"choose another name (taken: {sorted({'eager', *registered})})"
        )
    forward = make_moe_gmm_experts_forward(backend=backend, fused=fused)
    setattr(forward, _OURS, True)
    ExpertsInterface.register(name, forward)
    return name


# Marks the forwards registered by register_moe_gmm_experts, which may replace one another.
_OURS = "_moe_gmm_experts_forward"


# --------------------------------------------------------------------------------------------
# Which implementation and backend each experts module runs.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExpertsDescription:
    """One routed-experts module: what runs its forward and, where moe-gmm does, on which backend."""

    name: str  # the module's path in the model
    implementation: str  # e.g. "moe_gmm", "eager", "grouped_mm", "GroupedExperts", "moe_gmm expert parallel"
    backends: dict[str, str]  # {"gate_up_proj": "cpu", "down_proj": "cpu"}; empty when moe-gmm does not run it

    @property
    def backend(self) -> str:
        """The grouped-matmul backend ("-" when moe-gmm does not run the module; both when they differ)."""
        names = list(dict.fromkeys(self.backends.values()))
        if len(names) <= 1:
            return names[0] if names else "-"
        return ", ".join(f"{proj} {name}" for proj, name in self.backends.items())

    def __str__(self) -> str:
        return f"{self.name or '<model>'}: {self.implementation}, backend {self.backend}"


def _backend_name(weight_EKN: torch.Tensor, fused: bool, backend: str | None) -> str:
    from moe_gmm.ops.backends import explain

    if not fused:
        return "eager"
    if hasattr(weight_EKN, "to_local"):  # parallelize_moe's DTensor experts: the op runs on the local rows
        weight_EKN = weight_EKN.to_local()
    choice = explain(weight_EKN.new_empty(1, weight_EKN.shape[1]), weight_EKN, backend=backend)
    if choice.backend is not None:
        return choice.backend
    return "none: " + "; ".join(
        f"{n} {r}" for n, r in choice.refusals.items() if n == choice.requested or n in choice.auto_order
    )


def _moe_gmm_settings(module: torch.nn.Module) -> tuple[str, dict[str, Any] | None]:
    """(implementation name, moe-gmm's fused/backend settings or None) of one experts module."""
    from moe_gmm.layers.experts import GroupedExperts

    shard = getattr(module, "ep_shard", None)
    if shard is not None:
        return "moe_gmm expert parallel", {"fused": shard.layout.fused, "backend": shard.layout.backend}
    if isinstance(module, GroupedExperts):
        if module.fused_permute:
            return "GroupedExperts (fused permute, triton)", None
        return "GroupedExperts", {"fused": module.use_grouped_expert_matmul, "backend": module.backend}
    name = getattr(module.config, "_experts_implementation", None) or "eager"
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError:  # pragma: no cover - a module with an experts config implies transformers
        return name, None
    forward = ALL_EXPERTS_FUNCTIONS.get(name) if name in ALL_EXPERTS_FUNCTIONS else None
    return name, getattr(forward, "moe_gmm_settings", None)


def _is_experts_module(module: torch.nn.Module) -> bool:
    from moe_gmm.layers.experts import GroupedExperts

    if isinstance(module, GroupedExperts) or getattr(module, "ep_shard", None) is not None:
        return True
    # transformers' experts modules, as set up by its use_experts_implementation decorator.
    return hasattr(module, "has_gate") and hasattr(getattr(module, "config", None), "_experts_implementation")


def describe_experts(model: torch.nn.Module) -> list[ExpertsDescription]:
    """Every routed-experts module of ``model`` with its implementation and, when moe-gmm runs it,
    the grouped-matmul backend of each projection for the weights' device, dtype and shape now.

    Covers Hugging Face experts modules (``experts_implementation`` "moe_gmm" and any other),
    moe-gmm's :class:`~moe_gmm.layers.GroupedExperts` and modules sharded by
    :func:`moe_gmm.parallel.apply_expert_parallel`. ``str()`` of an entry is one readable line.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    from moe_gmm.layers.experts import GroupedExperts

    out = []
    for name, module in model.named_modules():
        if not _is_experts_module(module):
            continue
        implementation, settings = _moe_gmm_settings(module)
        backends: dict[str, str] = {}
        if settings is not None:
            if isinstance(module, GroupedExperts):
                first, second, first_name = module.gate_up_proj, module.down_proj, "gate_up_proj"
            else:
                has_gate = getattr(module, "has_gate", True)
                first_name = "gate_up_proj" if has_gate else "up_proj"
                first, second = getattr(module, first_name), module.down_proj
                shard = getattr(module, "ep_shard", None)
                in_out = shard.layout.in_out if shard is not None else getattr(module, "is_transposed", False)
                if not in_out:
                    first, second = first.transpose(1, 2), second.transpose(1, 2)
            for proj, weight in ((first_name, first), ("down_proj", second)):
                backends[proj] = _backend_name(weight, settings["fused"], settings["backend"])
        out.append(ExpertsDescription(name, implementation, backends))
    return out


# --------------------------------------------------------------------------------------------
# Config and state-dict conversion.
# --------------------------------------------------------------------------------------------


def moe_block_config_from_hf(hf_config: Any, **overrides: Any) -> MoeBlockConfig:
    """A :class:`MoeBlockConfig` from a Hugging Face MoE text config (Qwen3.5-MoE, Qwen3-MoE, ...).

    Reads ``hidden_size``, ``num_experts`` (or ``num_local_experts``), ``num_experts_per_tok``,
    ``moe_intermediate_size`` (or ``intermediate_size``), ``shared_expert_intermediate_size``
    (0 when absent), ``norm_topk_prob`` (True when absent, as Qwen3.5-MoE always renormalises) and
    ``router_aux_loss_coef``; ``overrides`` win.
    """
    if getattr(hf_config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"hf_config.hidden_act must be 'silu' for a SwiGLU block, got {hf_config.hidden_act!r}")

    def first(*names: str, default: Any = None) -> Any:
        for n in names:
            if getattr(hf_config, n, None) is not None:
                return getattr(hf_config, n)
        if default is None:
            raise ValueError(f"hf_config has none of {names}")
        return default

    fields = {
        "hidden_size": first("hidden_size"),
        "num_experts": first("num_experts", "num_local_experts"),
        "num_experts_per_tok": first("num_experts_per_tok"),
        "moe_intermediate_size": first("moe_intermediate_size", "intermediate_size"),
        "shared_expert_intermediate_size": first("shared_expert_intermediate_size", default=0),
        "norm_topk_prob": bool(first("norm_topk_prob", default=True)),
        "router_aux_loss_coef": float(first("router_aux_loss_coef", default=0.0)),
    }
    fields.update(overrides)
    return MoeBlockConfig(**fields)


def hf_to_moe_gmm_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face experts layout -> moe-gmm layout; other keys pass through unchanged.

    ``*experts.gate_up_proj [E, 2I, H]`` -> ``[E, H, 2I]`` and ``*experts.down_proj [E, H, I]`` ->
    ``[E, I, H]`` (contiguous copies). Per-expert checkpoint keys
    ``*experts.<e>.{gate,up,down}_proj.weight`` are stacked into the same two tensors.
    """
    out: dict[str, torch.Tensor] = {}
    per_expert: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, value in state_dict.items():
        if m := _STACKED_KEY.match(key):
            out[key] = _transposed(key, value)
        elif m := _PER_EXPERT_KEY.match(key):
            per_expert.setdefault(m["prefix"], {}).setdefault(m["name"], {})[int(m["e"])] = value
        else:
            out[key] = value
    for prefix, parts in per_expert.items():
        num_experts = 1 + max(e for experts in parts.values() for e in experts)
        stacks = {}
        for name in ("gate_proj", "up_proj", "down_proj"):
            experts = parts.get(name, {})
            if sorted(experts) != list(range(num_experts)):
                raise ValueError(
                    f"state_dict has incomplete per-expert weights under {prefix!r}: {name} for experts "
                    f"{sorted(experts)}, expected 0..{num_experts - 1}"
                )
            stacks[name] = torch.stack([experts[e] for e in range(num_experts)])
        # nn.Linear weights [out, in]: gate/up [I, H] -> [E, H, 2I]; down [H, I] -> [E, I, H].
        gate_up_E2IH = torch.cat((stacks["gate_proj"], stacks["up_proj"]), dim=1)
        out[prefix + "gate_up_proj"] = gate_up_E2IH.transpose(1, 2).contiguous()
        out[prefix + "down_proj"] = stacks["down_proj"].transpose(1, 2).contiguous()
    return out


def moe_gmm_to_hf_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """moe-gmm layout -> Hugging Face experts layout (the inverse transposes); other keys pass through."""
    return {key: (_transposed(key, value) if _STACKED_KEY.match(key) else value) for key, value in state_dict.items()}


def _transposed(key: str, value: torch.Tensor) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() != 3:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"state_dict[{key!r}] must be a 3-D [E, ., .] tensor, got {shape}")
    return value.transpose(1, 2).contiguous()
