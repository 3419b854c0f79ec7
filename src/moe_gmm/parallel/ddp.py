"""``replicate_moe``: expert parallelism on a DeviceMesh with ``DistributedDataParallel`` for the rest.

For models that fit on every rank apart from their experts: dense parameters stay whole and are
kept in step by DDP over every rank of the mesh; expert shards (plain tensors, rank r of ``ep``
owning experts ``[r * E / ep, (r + 1) * E / ep)``) are hidden from DDP (it would otherwise
broadcast rank 0's shard over the other EP ranks' at start-up) and their gradients are summed
over the data dims (the ranks holding the same shard) as autograd produces them.

Every reduction is a plain sum, as with :func:`~moe_gmm.parallel.fsdp.parallelize_moe`: the loss
carries the scaling (:meth:`~moe_gmm.parallel.mesh.ParallelizedMoe.normalize_loss`), so the same
training loop runs under either.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from moe_gmm.parallel.apply import apply_expert_parallel
from moe_gmm.parallel.comm import collective
from moe_gmm.parallel.layout import EXPERT_PARAMS
from moe_gmm.parallel.mesh import MoeMesh, ParallelizedMoe
from moe_gmm.parallel.plan import EPPlan
from moe_gmm.parallel.verify import match_and_verify

__all__ = ["replicate_moe"]


def _sum_hook(group, bucket):  # unannotated: DDP compares the annotations with the live classes
    """DDP's all-reduce without its division by the group size (the loss is already scaled)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _expert_grad_reducer(group: dist.ProcessGroup):
    def reduce(grad: torch.Tensor) -> torch.Tensor:
        # A tensor hook sees only this backward's contribution, so accumulation over micro-batches
        # sums reduced contributions instead of reducing the running sum again.
        reduced = grad.clone()
        with collective("expert gradient all-reduce", group):
            dist.all_reduce(reduced, group=group)
        return reduced

    return reduce


def replicate_moe(
    model: nn.Module, mesh: DeviceMesh, plan: EPPlan, *, ep_dim: str = "ep", **ddp_kwargs: Any
) -> ParallelizedMoe:
    """Shard the experts of ``model`` over ``mesh[ep_dim]`` and wrap the rest in DDP over all of ``mesh``.

    Returns a :class:`~moe_gmm.parallel.mesh.ParallelizedMoe` whose ``model`` is the
    ``DistributedDataParallel`` wrapper (call it) and ``module`` the model inside. Build the
    optimizer afterwards, backpropagate ``normalize_loss(loss_sum, num_tokens)`` (or
    ``average_loss``), clip with ``clip_grad_norm_``. ``ddp_kwargs`` go to
    ``DistributedDataParallel`` (not ``process_group``: that is the mesh's).

    Collective over the whole mesh; the same setup checks as ``parallelize_moe`` (every tensor's
    sha256 compared across all ranks before sharding, expert weights whole).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, EPPlan):
        raise TypeError(f"plan must be an EPPlan, got {type(plan).__name__}")
    if "process_group" in ddp_kwargs or "device_mesh" in ddp_kwargs:
        raise ValueError("ddp_kwargs must not set process_group / device_mesh: replicate_moe uses all ranks of mesh")
    moe_mesh = MoeMesh(mesh, ep_dim)
    ep_size = moe_mesh.ep_mesh.size()
    if plan.expert_parallel_size != ep_size:
        raise ValueError(
            f"plan.expert_parallel_size must equal the size of mesh[{ep_dim!r}] = {ep_size}, "
            f"got {plan.expert_parallel_size}"
        )
    data_group = moe_mesh.data_mesh.get_group()
    experts = match_and_verify(model, data_group, plan, what="replicate_moe")
    apply_expert_parallel(model, moe_mesh.ep_mesh.get_group(), plan, verify=False)  # verified above

    modules = dict(model.named_modules())
    expert_dp_group = moe_mesh.expert_dp_mesh.get_group()
    reduce = _expert_grad_reducer(expert_dp_group) if moe_mesh.expert_dp_mesh.size() > 1 else None
    for name in experts:
        for pname in EXPERT_PARAMS:
            param = getattr(modules[name], pname)
            if reduce is not None and param.requires_grad:
                param.register_hook(reduce)
    ignored = [f"{name}.{pname}" for name in experts for pname in EXPERT_PARAMS]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    ddp = DistributedDataParallel(model, process_group=data_group, **ddp_kwargs)
    ddp.register_comm_hook(data_group, _sum_hook)
    return ParallelizedMoe(model=ddp, module=model, mesh=moe_mesh, experts=experts)
