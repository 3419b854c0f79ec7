"""Top-k softmax router (Qwen3.5-MoE style) with an optional Switch-style load-balancing loss.

Legend: T tokens, H hidden, E experts, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TopKRouter", "load_balancing_loss"]


def load_balancing_loss(logits_TE: torch.Tensor, indices_Tk: torch.Tensor) -> torch.Tensor:
    """Switch-Transformer auxiliary loss ``E * sum_e f_e * P_e`` as a float32 scalar.

    ``f_e`` = slots routed to expert e divided by T (so ``sum_e f_e = k``), ``P_e`` = mean softmax
    probability of e over the tokens. Equals Hugging Face's ``load_balancing_loss_func`` for one
    layer without an attention mask: ``k`` under perfectly uniform routing. Differentiable through
    ``P`` only (the counts are piecewise constant). Returns 0 for T = 0.
    """
    num_tokens, num_experts = logits_TE.shape
    if num_tokens == 0:
        return logits_TE.new_zeros((), dtype=torch.float32)
    probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
    counts_E = torch.bincount(indices_Tk.reshape(-1), minlength=num_experts).to(torch.float32)
    return num_experts * torch.sum(counts_E / num_tokens * probs_TE.mean(dim=0))


class TopKRouter(nn.Module):
    """``logits = x @ weight.T`` -> softmax in float32 -> top-k -> (optionally) renormalise.

    Parameter ``weight [E, H]`` (``gate.weight`` inside :class:`~moe_gmm.layers.SparseMoeBlock`,
    the same name and layout as Hugging Face's Qwen3.5-MoE router).

    NaN in the logits (from NaN hidden states) is not checked, because that would cost a host sync
    per step: ``topk`` still returns ids in ``[0, E)``, so the NaN stays confined to that token's
    routing weights and output row in the forward pass.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool = True) -> None:
        super().__init__()
        for name, value in (("hidden_size", hidden_size), ("num_experts", num_experts), ("top_k", top_k)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if top_k > num_experts:
            raise ValueError(f"top_k must be <= num_experts = {num_experts}, got {top_k}")
        self.hidden_size = hidden_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.hidden_size**-0.5)

    def forward(self, x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Returns ``(logits_TE in x's dtype, weights_Tk float32, indices_Tk int64)``."""
        if x_TH.dim() != 2 or x_TH.shape[1] != self.hidden_size:
            raise ValueError(f"x_TH must have shape [T, {self.hidden_size}], got {tuple(x_TH.shape)}")
        logits_TE = F.linear(x_TH, self.weight)
        probs_TE = torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        weights_Tk, indices_Tk = torch.topk(probs_TE, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights_Tk = weights_Tk / weights_Tk.sum(dim=-1, keepdim=True)
        return logits_TE, weights_Tk, indices_Tk

    def tokens_per_expert(self, indices_Tk: torch.Tensor) -> torch.Tensor:
        """``[E]`` int64 count of (token, slot) pairs routed to each expert."""
        return torch.bincount(indices_Tk.reshape(-1), minlength=self.num_experts)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"norm_topk_prob={self.norm_topk_prob}"
        )
