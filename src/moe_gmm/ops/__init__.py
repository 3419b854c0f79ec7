"""Pure functions with autograd; no nn.Module lives here."""

from moe_gmm.ops.grouped_matmul import grouped_matmul, normalize_group_list

__all__ = ["grouped_matmul", "normalize_group_list"]
