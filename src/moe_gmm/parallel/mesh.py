"""The roles of a DeviceMesh's dims for MoE training, and the handle the parallelizers return.

A mesh has one expert-parallel dim (``ep``, any size, 1 included) and one or more data dims (the
rest, e.g. ``dp``). Every rank holds different data, so the *data ranks* are all ranks of the mesh:
dense parameters are reduced over all of them, expert shards over the ranks holding the same shard
(the data dims, "expert-data-parallel").

Gradient scaling ("sum" scheme): every reduction is a plain sum, on every backend (gloo has no
``PREMUL_SUM``) and every group size, so the loss each rank backpropagates must already be its share
of the global loss: its summed loss divided by the global token count
(:meth:`ParallelizedMoe.normalize_loss`), or, with equally many tokens per rank, its mean loss
divided by the number of data ranks (:meth:`ParallelizedMoe.average_loss`). The summed gradients
then equal single-process training on the concatenated batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from moe_gmm.parallel.clip import clip_grad_norm_

__all__ = ["MoeMesh", "ParallelizedMoe"]


@dataclass(frozen=True)
class MoeMesh:
    """A named DeviceMesh split into its expert-parallel dim and its data dims.

    The sub-meshes are built on first use (a collective the first time: every rank reads them in
    the same order, which ``parallelize_moe`` / ``replicate_moe`` do) and kept.
    """

    mesh: DeviceMesh
    ep_dim: str = "ep"

    def __post_init__(self) -> None:
        if not isinstance(self.mesh, DeviceMesh):
            raise TypeError(f"mesh must be a torch.distributed.DeviceMesh, got {type(self.mesh).__name__}")
        names = self.mesh.mesh_dim_names
        if not names:
            raise ValueError("mesh must have named dims, e.g. init_device_mesh(..., mesh_dim_names=('dp', 'ep'))")
        if self.ep_dim not in names:
            raise ValueError(f"ep_dim must name a dim of the mesh {names}, got {self.ep_dim!r}")
        if len(names) < 2:
            raise ValueError(
                f"mesh must have a data dim besides {self.ep_dim!r} (size 1 is fine), got dims {names}: "
                "e.g. init_device_mesh('cuda', (1, ep), mesh_dim_names=('dp', 'ep'))"
            )

    @property
    def dp_dims(self) -> tuple[str, ...]:
        return tuple(n for n in self.mesh.mesh_dim_names if n != self.ep_dim)

    @cached_property
    def ep_mesh(self) -> DeviceMesh:
        return self.mesh[self.ep_dim]

    @cached_property
    def expert_dp_mesh(self) -> DeviceMesh:
        """The ranks holding the same expert shard (the data dims, flattened when several)."""
        dims = self.dp_dims
        return self.mesh[dims[0]] if len(dims) == 1 else self.mesh[dims]._flatten("_".join(dims))

    @cached_property
    def data_mesh(self) -> DeviceMesh:
        """Every rank of the mesh as one flat dim: dense parameters are reduced over all of them."""
        return self.mesh._flatten("_".join(self.mesh.mesh_dim_names))

    @property
    def num_data_ranks(self) -> int:
        return self.mesh.size()


@dataclass
class ParallelizedMoe:
    """What :func:`parallelize_moe` / :func:`replicate_moe` return.

    ``model``: the module to call (the FSDP-wrapped model itself, or the ``DistributedDataParallel``
    wrapper); build the optimizer from ``model.parameters()`` afterwards (every parameter is a new
    object), or with :meth:`optimizer`. ``module``: the model without a DDP wrapper (the original
    parameter names). ``experts``: the sharded experts modules' names.
    """

    model: nn.Module
    module: nn.Module
    mesh: MoeMesh
    experts: list[str]

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters to optimize: the sharded ones, never those the model had before."""
        return self.module.parameters()

    def optimizer(self, cls: type[torch.optim.Optimizer], **kwargs: Any) -> torch.optim.Optimizer:
        """``cls(self.parameters(), **kwargs)`` for an optimizer class; moe-gmm's AdamW is
        ``make_adamw(par.parameters(), lr=...)`` (:mod:`moe_gmm.optim`)."""
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise TypeError(f"cls must be a torch.optim.Optimizer subclass, got {cls!r}")
        return cls(self.parameters(), **kwargs)

    def normalize_loss(self, loss_sum: torch.Tensor, num_tokens: int | torch.Tensor) -> torch.Tensor:
        """This rank's share of the global mean loss: ``loss_sum / (tokens summed over every data rank)``.

        ``loss_sum``: the loss summed over this rank's tokens (``reduction="sum"``); ``num_tokens``:
        how many tokens it sums over (those not ignored). Collective over the data ranks (one scalar
        all-reduce, no host sync). Uneven counts per rank are fine.
        """
        if not isinstance(loss_sum, torch.Tensor):
            raise TypeError(f"loss_sum must be a torch.Tensor, got {type(loss_sum).__name__}")
        count = torch.as_tensor(num_tokens, dtype=torch.float64, device=loss_sum.device).clone()
        if count.dim() != 0:
            raise ValueError(f"num_tokens must be a scalar, got shape {tuple(count.shape)}")
        dist.all_reduce(count, group=self.mesh.data_mesh.get_group())
        return loss_sum / count.to(loss_sum.dtype)

    def average_loss(self, loss_mean: torch.Tensor) -> torch.Tensor:
        """This rank's share of the global loss when every rank averages over equally many tokens."""
        return loss_mean / self.mesh.num_data_ranks

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """:func:`moe_gmm.parallel.clip.clip_grad_norm_` over this model's meshes; returns the total norm."""
        return clip_grad_norm_(self.module, max_norm, norm_type)
