"""Pure functions with autograd; no nn.Module lives here."""

from moe_gmm.ops.backends import registered_backends as _registered_backends
from moe_gmm.ops.expert_mlp import expert_mlp
from moe_gmm.ops.grouped_matmul import grouped_matmul, normalize_group_list
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.ops.swiglu import swiglu

# The built-in backends are registered at import, outside any trace: torch.compile(fullgraph=True)
# cannot import a module, so a first grouped matmul under compile would fail if they loaded lazily.
_registered_backends()

__all__ = ["expert_mlp", "grouped_matmul", "normalize_group_list", "permute", "swiglu", "unpermute"]
