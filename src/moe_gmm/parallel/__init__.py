"""Expert parallelism over ``torch.distributed``: plan, dispatchers, sharded checkpoints.

Typical use (every rank of the EP group)::

    plan = EPPlan.from_config(cfg.parallel)            # or EPPlan(ep, ["model.layers.{*}.mlp.experts"])
    apply_expert_parallel(model, ep_group, plan)       # shards experts, swaps their forward
    optimizer = torch.optim.AdamW(model.parameters())  # after sharding
    loss.backward(); sync_gradients(model, ep_group); optimizer.step()
    save_ep_checkpoint(model, "ckpt/", ep_group)       # Hugging Face layout, loads at any EP size

With more ranks than the EP size, ``expert_parallel_groups(ep)`` builds the EP groups and the
expert-data-parallel groups, and ``sync_gradients(model, ep_group, dense_group=dist.group.WORLD,
expert_dp_group=...)`` reduces over both. ``examples/ep_train.py`` runs all of it under torchrun.
"""

from moe_gmm.parallel.apply import (
    apply_expert_parallel,
    expert_parallel_groups,
    expert_parallel_modules,
    sync_gradients,
)
from moe_gmm.parallel.checkpoint import load_ep_checkpoint, save_ep_checkpoint
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
    "load_ep_checkpoint",
    "save_ep_checkpoint",
    "sync_gradients",
]
