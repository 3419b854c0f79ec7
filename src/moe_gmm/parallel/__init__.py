"""Expert parallelism over ``torch.distributed``: plan, dispatchers, DeviceMesh + FSDP2 / DDP, DCP checkpoints.

Typical use (every rank; ``torchrun --nproc-per-node dp*ep``)::

    mesh = init_device_mesh("cuda", (dp, ep), mesh_dim_names=("dp", "ep"))
    par = parallelize_moe(model, mesh, EPPlan(ep, ["model.layers.{*}.mlp.experts"]))
    optimizer = make_adamw(par.model.parameters(), lr=1e-3)   # moe_gmm.optim; after parallelizing
    for batch in my_share_of_the_global_batch:
        loss_sum = loss_fn(par.model(batch.x), batch.y, reduction="sum")
        par.normalize_loss(loss_sum, batch.num_tokens).backward()  # / tokens over all ranks
        par.clip_grad_norm_(1.0)                                 # norm over every mesh
        optimizer.step(); optimizer.zero_grad()
    save_checkpoint("ckpt/", par, optimizer)                    # signed DCP: loads at any (dp, ep)
    export_hf(par, "hf/")                                        # signed safetensors for from_pretrained

Experts are DTensor ``Shard(0)`` on ``mesh["ep"]`` and FSDP over ``dp``; dense layers FSDP over all
ranks; every reduction a sum, so the gradients equal one process on the concatenated batch.
``replicate_moe`` (same arguments and handle) keeps dense parameters whole under DDP.
Build the optimizer after parallelizing, on the sharded parameters: ``make_adamw(par.model.parameters(), lr=...)``.
``examples/ep_train.py`` runs it under torchrun.

Guards (:mod:`moe_gmm.parallel.guards`): an optimizer over parameters that sharding replaced fails
at its first ``step()`` (or ``check_optimizer(optimizer, model)``); ``verify_replicas(model, group)``
(every N steps, at checkpoints) raises when replicas drifted apart.
"""

from moe_gmm.parallel.apply import apply_expert_parallel, expert_parallel_modules
from moe_gmm.parallel.clip import clip_grad_norm_
from moe_gmm.parallel.comm import CollectiveError
from moe_gmm.parallel.dcp import export_hf, import_hf, load_checkpoint, save_checkpoint
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
    "expert_parallel_modules",
    "export_hf",
    "import_hf",
    "load_checkpoint",
    "parallelize_moe",
    "replicate_moe",
    "save_checkpoint",
    "verify_replicas",
]
