"""The one rule for "can moe-gmm's expert MLP replace this experts module's math exactly".

Every path that swaps in our experts asks :func:`expert_mlp_support` and runs the answer with
:func:`run_expert_mlp`: the Hugging Face ``experts_implementation="moe_gmm"`` forward and
:func:`~moe_gmm.parallel.apply_expert_parallel`. What runs is one of two MLPs over rows grouped
by expert, both on the module's ``gate_up_proj`` / ``down_proj`` only:

- ``"swiglu"``: ``GMM -> silu(gate) * up -> GMM`` (:func:`~moe_gmm.ops.expert_mlp`), for
  :class:`~moe_gmm.layers.GroupedExperts` and Hugging Face experts with concatenated ``[gate; up]``
  halves, SiLU and transformers' default ``_apply_gate``;
- ``"module_gate"``: ``GMM -> module._apply_gate -> GMM [-> module.post_expert_norm]`` (the same
  pipeline with the module's gate plugged in, :func:`module_mlp`), for other gates (clamped SwiGLU as in DeepSeek-V4 or BailingHybrid, other activations, interleaved
  halves) and post-expert norms. It calls the module's own code on rows, as transformers' ``grouped_mm`` experts do, so
  the math is the module's by construction.

Refused, with the reason: modules that are not experts modules, per-expert biases (parameters
outside ``gate_up_proj`` / ``down_proj``, which expert parallelism does not shard) and experts
without a gate (``up_proj`` only). The Hugging Face path runs those through its own fallback.

transformers is imported lazily: this module does not need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from moe_gmm.ops.expert_mlp import expert_mlp

__all__ = ["Support", "expert_mlp_support", "module_mlp", "run_expert_mlp"]

MlpKind = Literal["swiglu", "module_gate"]


@dataclass(frozen=True)
class Support:
    """The answer of :func:`expert_mlp_support`: ``mlp`` is what runs (``None``: refused), ``reason`` says why."""

    mlp: MlpKind | None
    reason: str

    @property
    def ok(self) -> bool:
        return self.mlp is not None


def _is_silu(act: object) -> bool:
    return act is F.silu or isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _has_default_gate(module: nn.Module) -> bool:
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # without transformers no class can carry its default gate
        return False
    return getattr(type(module), "_apply_gate", None) is _default_apply_gate


def expert_mlp_support(module: nn.Module) -> Support:
    """Whether (and how) moe-gmm's expert MLP computes ``module``'s experts exactly; see the module doc."""
    from moe_gmm.layers.experts import GroupedExperts  # layers import ops only; no cycle

    name = type(module).__name__
    if isinstance(module, GroupedExperts):
        return Support("swiglu", "moe-gmm's own SwiGLU experts")
    if not all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed")):
        return Support(None, f"{name} is neither GroupedExperts nor a Hugging Face experts module")
    if module.has_bias:
        return Support(None, f"{name} has per-expert biases (has_bias=True), which our expert MLP lacks")
    if not module.has_gate:
        return Support(None, f"{name} has no gate (has_gate=False: up_proj -> act_fn -> down_proj)")
    norm = ", then its post_expert_norm" if getattr(module, "has_post_expert_norm", False) else ""
    act = getattr(module, "act_fn", None)
    if not norm and getattr(module, "is_concatenated", True) and _has_default_gate(module) and _is_silu(act):
        return Support("swiglu", "[gate; up] halves, SiLU, the default gate")
    if not _has_default_gate(module):
        why = f"its own {name}._apply_gate"
    elif not getattr(module, "is_concatenated", True):
        why = "the default gate on interleaved [gate, up] columns"
    else:
        why = f"the default gate with act_fn={getattr(act, '__name__', type(act).__name__)}"
    return Support("module_gate", f"{why}{norm}")


def module_mlp(module: nn.Module, support: Support) -> dict[str, Any]:
    """The activation, biases and post-norm that make :func:`~moe_gmm.ops.expert_mlp` compute ``module``'s
    experts: nothing for ``"swiglu"`` (the fused op), the module's own ``_apply_gate`` (and
    ``post_expert_norm``) for ``"module_gate"``; for a refused Hugging Face module (biases, no gate)
    the same with its biases and ``act_fn``, which only the single-process drop-in runs."""
    if support.mlp == "swiglu":
        return {}
    has_gate = getattr(module, "has_gate", True)
    parts: dict[str, Any] = {"activation": module._apply_gate if has_gate else module.act_fn}
    if getattr(module, "has_bias", False):
        parts["biases"] = (module.gate_up_proj_bias if has_gate else module.up_proj_bias, module.down_proj_bias)
    if getattr(module, "has_post_expert_norm", False):
        parts["post"] = module.post_expert_norm
    return parts


def run_expert_mlp(
    module: nn.Module,
    support: Support,
    x_RH: torch.Tensor,
    counts_E: torch.Tensor,
    gate_up_EH2I: torch.Tensor,
    down_EIH: torch.Tensor,
    *,
    fused: bool = True,
    backend: str | None = None,
    validate: bool = False,
) -> torch.Tensor:
    """``module``'s expert MLP on rows grouped by expert, as ``support`` (from :func:`expert_mlp_support`) says.

    ``gate_up_EH2I`` / ``down_EIH`` are ``[E, in, out]`` views of the module's weights (or their
    expert-parallel shards); ``counts_E`` rows per expert.
    """
    if not support.ok:
        raise ValueError(f"module cannot run on moe-gmm's expert MLP: {support.reason}")
    return expert_mlp(
        x_RH, counts_E, gate_up_EH2I, down_EIH, fused=fused, backend=backend, validate=validate,
        **module_mlp(module, support),
    )  # fmt: skip
