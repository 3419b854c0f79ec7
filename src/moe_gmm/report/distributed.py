"""The expert-parallel side of ``moe-gmm train`` under ``torchrun --nproc-per-node N``.

Every rank of the EP group holds ``E / N`` experts of every matched experts module
(``parallel.ep_plan.apply_modules``) and a full copy of everything else. Rank r trains on rows
``[r B/N, (r+1) B/N)`` of each global batch; :func:`moe_gmm.parallel.sync_gradients` then makes
the gradients those of one process training on the whole batch, so an N-rank run reproduces the
1-process losses up to summation order.

In this version the EP group is the whole world (``parallel.expert_parallel_size`` must equal
the number of processes); data parallelism across EP groups is not wired.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from moe_gmm.config import ConfigError, RunConfig, validate_config

__all__ = ["Runtime", "apply_ep", "clip_grad_norm", "finish_backward", "local_rows", "mean_over_ranks", "setup_runtime"]


@dataclass
class Runtime:
    """Where this process stands: rank, world size, and the EP process group (None: one process)."""

    rank: int = 0
    world: int = 1
    group: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1


def setup_runtime(cfg: RunConfig) -> Runtime:
    """Validate the EP size against ``$WORLD_SIZE`` and join the process group when N > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_config(cfg, world_size=world)
    ep = cfg.parallel.expert_parallel_size
    if world == 1:
        return Runtime()
    if ep != world:
        raise ConfigError(
            f"parallel.expert_parallel_size: {ep} must equal the number of processes {world} "
            "(data parallelism across EP groups is not supported by `moe-gmm train`)"
        )
    if cfg.training.micro_batch_size % world:
        raise ConfigError(
            f"training.micro_batch_size: {cfg.training.micro_batch_size} must be divisible by the "
            f"number of processes {world} (each rank takes an equal slice of the batch)"
        )
    import torch.distributed as dist

    if not dist.is_initialized():
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=120))
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return Runtime(rank=dist.get_rank(), world=dist.get_world_size(), group=dist.group.WORLD)


def apply_ep(model: torch.nn.Module, rt: Runtime, cfg: RunConfig, *, fused: bool, backend: str | None) -> None:
    """Shard the experts modules named by ``parallel.ep_plan`` over the EP group (no-op for one process)."""
    if not rt.distributed:
        return
    from moe_gmm.parallel.apply import apply_expert_parallel
    from moe_gmm.parallel.plan import EPPlan

    for module in _matched(model, apply_expert_parallel(model, rt.group, EPPlan.from_config(cfg.parallel))):
        # The sharded forward reads the grouped-matmul settings from the shard's layout; the eager
        # path (and a configured backend) is chosen there, as moe_gmm.parallel documents.
        shard = module.ep_shard
        module.ep_shard = dataclasses.replace(
            shard, layout=dataclasses.replace(shard.layout, fused=fused, backend=backend if fused else None)
        )


def _matched(model: torch.nn.Module, names: list[str]) -> list[torch.nn.Module]:
    modules = dict(model.named_modules())
    return [modules[n] for n in names]


def local_rows(ids_BS: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """This rank's equal slice of the global batch's rows."""
    if not rt.distributed:
        return ids_BS
    per_rank = ids_BS.shape[0] // rt.world
    return ids_BS[rt.rank * per_rank : (rt.rank + 1) * per_rank]


def finish_backward(model: torch.nn.Module, rt: Runtime) -> None:
    """Reduce replicated gradients and scale expert ones (mean loss, equal rows per rank)."""
    if rt.distributed:
        from moe_gmm.parallel.apply import sync_gradients

        sync_gradients(model, rt.group, average=True)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, rt: Runtime) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over the whole (sharded) model.

    Replicated gradients are identical on every rank after :func:`finish_backward`; expert shards
    differ, so their squared norms are summed across ranks before the common scale is applied.
    """
    if not rt.distributed:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        return
    import torch.distributed as dist

    from moe_gmm.parallel.apply import expert_parameter_ids

    experts = expert_parameter_ids(model)
    grads = [(id(p) in experts, p.grad) for p in model.parameters() if p.grad is not None]
    sq_experts = torch.zeros((), dtype=torch.float64, device=grads[0][1].device)
    sq_replicated = torch.zeros_like(sq_experts)
    for is_expert, g in grads:
        sq = g.detach().double().pow(2).sum()
        if is_expert:
            sq_experts += sq
        else:
            sq_replicated += sq
    dist.all_reduce(sq_experts, group=rt.group)
    total = float((sq_experts + sq_replicated).sqrt())
    coef = max_norm / (total + 1e-6)  # the same formula as torch's clip_grad_norm_
    if coef < 1.0:
        for _, g in grads:
            g.mul_(coef)


def mean_over_ranks(value: float, rt: Runtime, device: torch.device) -> float:
    """The mean of a per-rank scalar (the global batch's mean loss when rows per rank are equal)."""
    if not rt.distributed:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=rt.group)
    return float(t) / rt.world
