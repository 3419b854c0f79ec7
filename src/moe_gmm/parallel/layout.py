"""Which modules are routed-experts modules, how their weights are laid out, and how they are sharded.

Two kinds of experts modules are understood, both with the call signature
``forward(hidden_TH, top_k_index_Tk, top_k_weights_Tk) -> out_TH`` and two 3-D parameters:

=====================================  ==========================  ===========================
module                                 ``gate_up_proj``            ``down_proj``
=====================================  ==========================  ===========================
``moe_gmm.layers.GroupedExperts``      ``[E, H, 2I]`` (in, out)    ``[E, I, H]``
Hugging Face experts (``is_transposed  ``[E, 2I, H]`` (out, in)    ``[E, H, I]``
= False``, e.g. Qwen3.5-MoE)
Hugging Face experts, ``is_transposed  ``[E, H, 2I]``              ``[E, I, H]``
=====================================  ==========================  ===========================

The dispatcher needs ``[E, H, 2I]`` / ``[E, I, H]`` views (a transpose, never a copy). Checkpoints
are written in the Hugging Face layout (``[E, 2I, H]`` / ``[E, H, I]`` for ours; a Hugging Face
module's own parameters as they are). Sharding is along E in
contiguous blocks: rank r of an EP group of size ep owns experts ``[r * E / ep, (r + 1) * E / ep)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["EXPERT_PARAMS", "ExpertShard", "ExpertsLayout", "experts_layout"]

EXPERT_PARAMS = ("gate_up_proj", "down_proj")


@dataclass(frozen=True)
class ExpertsLayout:
    """How one experts module stores its weights.

    ``in_out``: parameters are ``[E, in, out]``; otherwise ``[E, out, in]`` (``nn.Linear`` order).
    ``hf_transpose``: the Hugging Face checkpoint stores the transpose of the parameter (true for
    ours, false for Hugging Face modules, whose parameters are the checkpoint layout).
    ``fused`` / ``backend`` are the grouped-matmul settings to run it with.
    """

    num_experts: int
    in_out: bool
    hf_transpose: bool
    fused: bool = True
    backend: str | None = None

    def mlp_weights(self, module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gate_up [E_local, H, 2I], down [E_local, I, H])`` views of the module's parameters."""
        gate_up, down = module.gate_up_proj, module.down_proj
        if self.in_out:
            return gate_up, down
        return gate_up.transpose(1, 2), down.transpose(1, 2)

    def to_hf(self, param: torch.Tensor) -> torch.Tensor:
        """A parameter in the Hugging Face checkpoint layout (a view)."""
        return param.transpose(1, 2) if self.hf_transpose else param

    def from_hf(self, tensor: torch.Tensor) -> torch.Tensor:
        """Inverse of :meth:`to_hf` (a view)."""
        return tensor.transpose(1, 2) if self.hf_transpose else tensor


@dataclass(frozen=True)
class ExpertShard:
    """Attached to a sharded experts module as ``module.ep_shard``: which experts this rank holds."""

    num_experts: int
    ep_rank: int
    ep_size: int
    layout: ExpertsLayout

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def first_expert(self) -> int:
        return self.ep_rank * self.num_local_experts


def experts_layout(module: nn.Module) -> tuple[ExpertsLayout | None, str]:
    """``(layout, "")`` for a routed-experts module, ``(None, reason)`` for anything else."""
    gate_up = getattr(module, "gate_up_proj", None)
    down = getattr(module, "down_proj", None)
    if not (isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)):
        return None, "it has no 3-D gate_up_proj / down_proj parameters (a dense MLP or a container?)"
    if gate_up.dim() != 3 or down.dim() != 3:
        return None, (
            f"gate_up_proj / down_proj are {gate_up.dim()}-D / {down.dim()}-D, expected 3-D [E, ., .] "
            "(a dense MLP such as a shared expert?)"
        )
    num_experts = int(getattr(module, "num_experts", gate_up.shape[0]))
    if gate_up.shape[0] != num_experts or down.shape[0] != num_experts:
        return (
            None,
            f"gate_up_proj / down_proj lead with {gate_up.shape[0]} / {down.shape[0]}, not num_experts={num_experts}",
        )

    from moe_gmm.layers.experts import GroupedExperts  # layers import ops only; no cycle

    if isinstance(module, GroupedExperts):
        return ExpertsLayout(
            num_experts,
            in_out=True,
            hf_transpose=True,
            fused=module.use_grouped_expert_matmul,
            backend=module.backend if module.use_grouped_expert_matmul else None,
        ), ""
    # A Hugging Face experts module (``@use_experts_implementation``); whether our expert MLP can
    # run its math is moe_gmm.integrations.support's rule, asked by apply_expert_parallel.
    if not hasattr(module, "is_transposed"):
        return None, f"{type(module).__name__} is neither GroupedExperts nor a Hugging Face experts module"
    return ExpertsLayout(num_experts, in_out=bool(module.is_transposed), hf_transpose=False), ""
