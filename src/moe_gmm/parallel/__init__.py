"""Expert parallelism over ``torch.distributed``: plan, dispatchers, sharded checkpoints.

Typical use (every rank of the EP group)::

    plan = EPPlan.from_config(cfg.parallel)            # or EPPlan(ep, ["model.layers.{*}.mlp.experts"])
    apply_expert_parallel(model, ep_group, plan)       # shards experts, swaps their forward
    optimizer = torch.optim.AdamW(model.parameters())  # after sharding
    loss.backward(); sync_gradients(model, ep_group); optimizer.step()
"""

from moe_gmm.parallel.apply import (
    apply_expert_parallel,
    expert_parallel_groups,
    expert_parallel_modules,
    sync_gradients,
)
from moe_gmm.parallel.comm import CollectiveError
from moe_gmm.parallel.dispatcher import AllToAllDispatcher, OverlappedAllToAllDispatcher
from moe_gmm.parallel.plan import EPPlan

__all__ = [
    "AllToAllDispatcher",
    "CollectiveError",
    "EPPlan",
    "OverlappedAllToAllDispatcher",
    "apply_expert_parallel",
    "expert_parallel_groups",
    "expert_parallel_modules",
    "sync_gradients",
]
