"""Pure functions with autograd; no nn.Module lives here."""

from moe_gmm.ops.expert_mlp import expert_mlp
from moe_gmm.ops.grouped_matmul import grouped_matmul, normalize_group_list
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.ops.swiglu import swiglu

__all__ = ["expert_mlp", "grouped_matmul", "normalize_group_list", "permute", "swiglu", "unpermute"]
