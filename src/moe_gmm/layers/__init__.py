"""nn.Modules built from the ops: router, grouped experts, sparse MoE block."""

from moe_gmm.layers.experts import GroupedExperts
from moe_gmm.layers.moe_block import MoeBlockConfig, SharedExpertMLP, SparseMoeBlock
from moe_gmm.layers.router import TopKRouter, load_balancing_loss

__all__ = ["GroupedExperts", "MoeBlockConfig", "SharedExpertMLP", "SparseMoeBlock", "TopKRouter", "load_balancing_loss"]
