"""The distributed side of ``moe-gmm train`` under ``torchrun --nproc-per-node N``.

The N ranks form a ``(dp, ep)`` DeviceMesh (``parallel.expert_parallel_size`` = ep, dp = N / ep,
``parallel.data_parallel_shard`` if set must agree) and the model is parallelized on it with
:func:`moe_gmm.parallel.parallelize_moe`: experts sharded over ``ep`` as DTensors, FSDP2 over the
rest. Every rank holds different data: rank r trains on rows ``[r B/N, (r+1) B/N)`` of each global
batch and backpropagates its mean loss divided by N, so the summed gradients are those of one
process on the whole batch and an N-rank run reproduces the 1-process losses up to summation
order. Checkpoints are DCP directories (:mod:`moe_gmm.parallel.dcp`), so a run resumes at any
other (dp, ep).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from moe_gmm.config import ConfigError, RunConfig, validate_config
from moe_gmm.parallel.mesh import ParallelizedMoe

__all__ = ["Runtime", "clip_grad_norm", "local_rows", "mean_over_ranks", "parallelize", "scale_loss", "setup_runtime"]


@dataclass
class Runtime:
    """Where this process stands: rank, world size, and the ``(dp, ep)`` DeviceMesh (None: one process)."""

    rank: int = 0
    world: int = 1
    mesh: Any = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """``(dp, ep)``: the mesh's sizes, ``(1, 1)`` for one process."""
        if self.mesh is None:
            return (1, 1)
        dp, ep = self.mesh.shape
        return (dp, ep)


def setup_runtime(cfg: RunConfig) -> Runtime:
    """Check the mesh shape against ``$WORLD_SIZE``, join the process group and build the mesh when N > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    validate_config(cfg, world_size=world)
    if world == 1:
        return Runtime()
    if cfg.training.micro_batch_size % world:
        raise ConfigError(
            f"training.micro_batch_size: {cfg.training.micro_batch_size} must be divisible by the "
            f"number of processes {world} (each rank takes an equal slice of the batch)"
        )
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        backend = "nccl" if cfg.device == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=timedelta(seconds=120))
    if cfg.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    ep = cfg.parallel.expert_parallel_size
    mesh = init_device_mesh(cfg.device, (world // ep, ep), mesh_dim_names=("dp", "ep"))
    return Runtime(rank=dist.get_rank(), world=dist.get_world_size(), mesh=mesh)


def parallelize(
    model: torch.nn.Module, rt: Runtime, cfg: RunConfig, *, fused: bool, backend: str | None
) -> ParallelizedMoe | None:
    """``parallelize_moe`` on the run's mesh with the ``parallel.ep_plan`` (None for one process)."""
    if not rt.distributed:
        return None
    from moe_gmm.parallel.fsdp import parallelize_moe
    from moe_gmm.parallel.plan import EPPlan

    par = parallelize_moe(model, rt.mesh, EPPlan.from_config(cfg.parallel))
    modules = dict(model.named_modules())
    for name in par.experts:
        # The sharded forward reads the grouped-matmul settings from the shard's layout: the eager
        # path (and a configured backend) is chosen there.
        shard = modules[name].ep_shard
        modules[name].ep_shard = dataclasses.replace(
            shard, layout=dataclasses.replace(shard.layout, fused=fused, backend=backend if fused else None)
        )
    return par


def local_rows(ids_BS: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """This rank's equal slice of the global batch's rows."""
    if not rt.distributed:
        return ids_BS
    per_rank = ids_BS.shape[0] // rt.world
    return ids_BS[rt.rank * per_rank : (rt.rank + 1) * per_rank]


def scale_loss(loss_mean: torch.Tensor, par: ParallelizedMoe | None) -> torch.Tensor:
    """This rank's share of the global mean loss (every reduction is a sum; equal rows per rank)."""
    return loss_mean if par is None else par.average_loss(loss_mean)


def clip_grad_norm(model: torch.nn.Module, max_norm: float, par: ParallelizedMoe | None) -> None:
    """``torch.nn.utils.clip_grad_norm_`` over the whole model, its norm taken across every mesh."""
    if par is None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        par.clip_grad_norm_(max_norm)


def mean_over_ranks(value: float, rt: Runtime, device: torch.device) -> float:
    """The mean of a per-rank scalar (the global batch's mean loss when rows per rank are equal)."""
    if not rt.distributed:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t) / rt.world
