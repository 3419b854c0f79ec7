"""Expert parallelism over ``torch.distributed``: plan, dispatchers, sharded checkpoints, DeviceMesh + FSDP2.

Typical use (every rank of the EP group)::

    plan = EPPlan.from_config(cfg.parallel)            # or EPPlan(ep, ["model.layers.{*}.mlp.experts"])
    apply_expert_parallel(model, ep_group, plan)       # shards experts, swaps their forward
    optimizer = torch.optim.AdamW(model.parameters())  # after sharding
    loss.backward(); sync_gradients(model, ep_group); optimizer.step()
    save_ep_checkpoint(model, "ckpt/", ep_group)       # Hugging Face layout, loads at any EP size

With more ranks than the EP size, ``expert_parallel_groups(ep)`` builds the EP groups and the
expert-data-parallel groups, and ``sync_gradients(model, ep_group, dense_group=dist.group.WORLD,
expert_dp_group=...)`` reduces over both. ``examples/ep_train.py`` runs all of it under torchrun.

On a DeviceMesh with FSDP2 (or DDP: ``replicate_moe``, same arguments and handle)::

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    par = parallelize_moe(model, mesh, EPPlan(ep, ["model.layers.{*}.mlp.experts"]))
    optimizer = torch.optim.AdamW(par.model.parameters())      # after parallelizing
    for batch in my_share_of_the_global_batch:
        loss_sum = loss_fn(par.model(batch.x), batch.y, reduction="sum")
        par.normalize_loss(loss_sum, batch.num_tokens).backward()  # / tokens over all ranks
        par.clip_grad_norm_(1.0)                                 # norm over every mesh
        optimizer.step(); optimizer.zero_grad()

Experts are DTensor ``Shard(0)`` on ``mesh["ep"]`` and FSDP over ``dp``; dense layers FSDP over all
ranks; every reduction a sum, so the gradients equal one process on the concatenated batch.
``par.optimizer(torch.optim.AdamW, lr=...)`` builds the optimizer on the sharded parameters.

Guards (:mod:`moe_gmm.parallel.guards`): an optimizer over parameters that sharding replaced fails
at its first ``step()`` (or ``check_optimizer(optimizer, model)``); ``verify_replicas(model, group)``
(every N steps, at checkpoints) raises when replicas drifted apart.
"""

from moe_gmm.parallel.apply import (
    apply_expert_parallel,
    expert_parallel_groups,
    expert_parallel_modules,
    sync_gradients,
)
from moe_gmm.parallel.checkpoint import load_ep_checkpoint, save_ep_checkpoint
from moe_gmm.parallel.clip import clip_grad_norm_
from moe_gmm.parallel.comm import CollectiveError
from moe_gmm.parallel.ddp import replicate_moe
from moe_gmm.parallel.dispatcher import AllToAllDispatcher, OverlappedAllToAllDispatcher
from moe_gmm.parallel.fsdp import parallelize_moe
from moe_gmm.parallel.guards import check_optimizer, verify_replicas
from moe_gmm.parallel.mesh import MoeMesh, ParallelizedMoe
from moe_gmm.parallel.plan import EPPlan

__all__ = [
    "AllToAllDispatcher",
    "CollectiveError",
    "EPPlan",
    "MoeMesh",
    "OverlappedAllToAllDispatcher",
    "ParallelizedMoe",
    "apply_expert_parallel",
    "check_optimizer",
    "clip_grad_norm_",
    "expert_parallel_groups",
    "expert_parallel_modules",
    "load_ep_checkpoint",
    "parallelize_moe",
    "replicate_moe",
    "save_ep_checkpoint",
    "sync_gradients",
    "verify_replicas",
]
