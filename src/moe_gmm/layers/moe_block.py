"""The sparse MoE block: top-k router, routed experts on the grouped matmul, gated shared expert.

Legend: T tokens, H hidden, E experts, k experts per token.

Data flow (forward; autograd mirrors it)::

    x[T,H] -+- shared_expert(x) * sigmoid(shared_expert_gate(x)) -----------------------+
            +- gate: logits -> softmax(fp32) -> top-k -> renorm -> (probs[T,k], ids[T,k]) |
               experts: permute -> GMM(gate_up_proj) -> swiglu -> GMM(down_proj)          |
                        -> unpermute(., probs) -> [T,H] ------------------------------ + -+

Only the routed experts' two matmuls run on ``grouped_matmul``; the router, the shared expert and
its gate are plain ``nn.Linear``. Each phase carries a ``torch.profiler.record_function`` label
(``moe::router``, ``moe::permute``, ``moe::gmm``, ``moe::swiglu``, ``moe::unpermute``,
``moe::shared_expert``) for time breakdowns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from moe_gmm._validation import check_field_types
from moe_gmm.layers.experts import GroupedExperts
from moe_gmm.layers.router import TopKRouter, load_balancing_loss
from moe_gmm.ops.eager_path import label

__all__ = ["MoeBlockConfig", "SharedExpertMLP", "SparseMoeBlock"]


@dataclass
class MoeBlockConfig:
    """Hyper-parameters of one :class:`SparseMoeBlock` (defaults: a small Qwen3.5-like block).

    ``shared_expert_intermediate_size = 0`` builds no shared expert (Qwen3-MoE, Mixtral).
    ``router_aux_loss_coef > 0`` makes each forward store the scaled load-balancing loss in
    ``block.aux_loss`` (add it to the training loss yourself).
    """

    hidden_size: int = 256
    num_experts: int = 16
    num_experts_per_tok: int = 4
    moe_intermediate_size: int = 128
    shared_expert_intermediate_size: int = 128
    norm_topk_prob: bool = True
    use_grouped_expert_matmul: bool = True
    gmm_backend: str | None = None
    router_aux_loss_coef: float = 0.0
    # Fuse permute / unpermute into the grouped matmuls (triton gather/scatter kernels; see GroupedExperts).
    fused_permute: bool = False

    def __post_init__(self) -> None:
        # Types first: a string 'false' or an int 1 would otherwise pass as truthy or fail at the first forward.
        check_field_types(self)
        for name in ("hidden_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"shared_expert_intermediate_size must be an int >= 0, got {self.shared_expert_intermediate_size}"
            )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok must be <= num_experts = {self.num_experts}, got {self.num_experts_per_tok}"
            )
        if not 0.0 <= self.router_aux_loss_coef < math.inf:
            raise ValueError(f"router_aux_loss_coef must be finite and >= 0, got {self.router_aux_loss_coef!r}")


class SharedExpertMLP(nn.Module):
    """Plain SwiGLU MLP ``down(silu(gate(x)) * up(x))`` on ``nn.Linear`` (no grouped matmul)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    """Routed experts plus a sigmoid-gated shared expert; ``forward(x [..., H]) -> [..., H]``.

    Parameter names match Hugging Face's ``Qwen3_5MoeSparseMoeBlock`` except for the routed
    experts' layout (``experts.gate_up_proj [E, H, 2I]``, ``experts.down_proj [E, I, H]``, the
    transposes of Hugging Face's); ``moe_gmm.integrations.transformers`` converts state dicts.

    After each forward: ``aux_loss`` (scaled load-balancing loss, or None when the coefficient is 0)
    and ``tokens_per_expert`` (detached ``[E]`` counts) describe the routing.
    """

    def __init__(self, config: MoeBlockConfig) -> None:
        super().__init__()
        if not isinstance(config, MoeBlockConfig):
            raise TypeError(f"config must be a MoeBlockConfig, got {type(config).__name__}")
        self.config = config
        self.gate = TopKRouter(
            config.hidden_size, config.num_experts, config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob
        )
        self.experts = GroupedExperts(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            use_grouped_expert_matmul=config.use_grouped_expert_matmul,
            backend=config.gmm_backend,
            validate_routing=False,  # the router's top-k yields ids in [0, E)
            fused_permute=config.fused_permute,
        )
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = SharedExpertMLP(config.hidden_size, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = None
            self.shared_expert_gate = None
        self.aux_loss: torch.Tensor | None = None

    @property
    def tokens_per_expert(self) -> torch.Tensor | None:
        return self.experts.last_tokens_per_expert

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``hidden_states [..., H]`` (e.g. ``[B, S, H]``) -> same shape and dtype."""
        hidden = self.config.hidden_size
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != hidden:
            raise ValueError(f"hidden_states must have shape [..., {hidden}], got {tuple(hidden_states.shape)}")
        param_dtype = self.gate.weight.dtype
        if hidden_states.dtype != param_dtype:
            raise TypeError(
                f"hidden_states dtype must match the block's parameters ({param_dtype}), got {hidden_states.dtype}"
            )
        x_TH = hidden_states.reshape(-1, hidden)

        with label("moe::router"):
            logits_TE, weights_Tk, indices_Tk = self.gate(x_TH)
            self.aux_loss = (
                self.config.router_aux_loss_coef * load_balancing_loss(logits_TE, indices_Tk)
                if self.config.router_aux_loss_coef > 0
                else None
            )
        out_TH = self.experts(x_TH, indices_Tk, weights_Tk)

        if self.shared_expert is not None:
            with label("moe::shared_expert"):
                shared_TH = self.shared_expert(x_TH) * torch.sigmoid(self.shared_expert_gate(x_TH))
            out_TH = out_TH + shared_TH
        return out_TH.view(hidden_states.shape)
