"""A small residual stack of ``SparseMoeBlock``s named like a decoder, for the EP tests."""

from __future__ import annotations

import torch
from torch import nn

from moe_gmm.layers import MoeBlockConfig, SparseMoeBlock

PATTERN = "layers.{*}.mlp.experts"


class MoeLayer(nn.Module):
    """One residual MoE layer (a called module, so FSDP can wrap it: ``layers.{i}.mlp``)."""

    def __init__(self, cfg: MoeBlockConfig):
        super().__init__()
        self.mlp = SparseMoeBlock(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x)


class TinyMoeStack(nn.Module):
    """Residual stack of MoE blocks plus a dense MLP, named like a decoder (``layers.{i}.mlp``)."""

    def __init__(self, num_experts: int = 8, top_k: int = 2, num_layers: int = 2, hidden: int = 16):
        super().__init__()
        cfg = MoeBlockConfig(
            hidden_size=hidden,
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=8,
        )
        self.layers = nn.ModuleList(MoeLayer(cfg) for _ in range(num_layers))
        self.dense = nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh())

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.dense(x)


def tiny_moe_stack(seed: int = 0, **kwargs) -> TinyMoeStack:
    torch.manual_seed(seed)  # the same replica on every rank
    return TinyMoeStack(**kwargs)
