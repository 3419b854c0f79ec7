"""moe-gmm: Mixture-of-Experts training operators built around one grouped matmul."""

from moe_gmm.layers import GroupedExperts, MoeBlockConfig, SparseMoeBlock, TopKRouter
from moe_gmm.ops.backends import GmmBackend, available_backends, register_backend, registered_backends
from moe_gmm.ops.expert_mlp import expert_mlp
from moe_gmm.ops.grouped_matmul import grouped_matmul
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.ops.swiglu import swiglu

__version__ = "0.1.0"

__all__ = [
    "GmmBackend",
    "GroupedExperts",
    "MoeBlockConfig",
    "SparseMoeBlock",
    "TopKRouter",
    "__version__",
    "available_backends",
    "expert_mlp",
    "grouped_matmul",
    "permute",
    "register_backend",
    "registered_backends",
    "swiglu",
    "unpermute",
]
