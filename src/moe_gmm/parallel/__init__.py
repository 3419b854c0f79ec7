"""Expert parallelism over ``torch.distributed``: plan, dispatchers, sharded checkpoints."""

from moe_gmm.parallel.comm import CollectiveError
from moe_gmm.parallel.plan import EPPlan

__all__ = ["CollectiveError", "EPPlan"]
