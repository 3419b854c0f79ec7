"""moe-gmm: Mixture-of-Experts training operators built around one grouped matmul."""

from moe_gmm.ops.backends import available_backends, register_backend, registered_backends
from moe_gmm.ops.grouped_matmul import grouped_matmul

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "available_backends",
    "grouped_matmul",
    "register_backend",
    "registered_backends",
]
