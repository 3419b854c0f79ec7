"""moe-gmm: Mixture-of-Experts training operators built around one grouped matmul."""

from moe_gmm.layers import GroupedExperts, MoeBlockConfig, SparseMoeBlock, TopKRouter
from moe_gmm.log import enable_logging
from moe_gmm.ops.backends import (
    BackendChoice,
    GmmBackend,
    available_backends,
    explain,
    register_backend,
    registered_backends,
    select_backend,
)
from moe_gmm.ops.expert_mlp import expert_mlp
from moe_gmm.ops.grouped_matmul import grouped_matmul
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.ops.swiglu import swiglu

__version__ = "0.1.0"

__all__ = [
    "BackendChoice",
    "GmmBackend",
    "GroupedExperts",
    "MoeBlockConfig",
    "SparseMoeBlock",
    "TopKRouter",
    "__version__",
    "available_backends",
    "enable_logging",
    "expert_mlp",
    "explain",
    "grouped_matmul",
    "permute",
    "register_backend",
    "registered_backends",
    "select_backend",
    "swiglu",
    "unpermute",
]
