"""Gradient clipping by the global norm when the gradients live on several meshes.

``torch.nn.utils.clip_grad_norm_`` needs every gradient on one mesh; an MoE model has dense
gradients sharded over all data ranks, expert gradients sharded over ``(dp, ep)`` (FSDP) or plain
expert shards whose norm must be summed over the EP group (DDP). Each group of gradients gets its
own norm (reduced over its own mesh or group), and the groups' norms combine as
``(sum_g norm_g ** p) ** (1 / p)`` (the maximum for ``p = inf``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["clip_grad_norm_", "total_grad_norm"]


def _expert_groups(model: nn.Module) -> dict[int, dist.ProcessGroup | None]:
    """``id(param) -> EP group`` for the plain (non-DTensor) expert shards of ``model``."""
    from moe_gmm.parallel.apply import expert_parallel_modules  # apply imports nothing from here

    groups = {}
    for module in expert_parallel_modules(model).values():
        for name in ("gate_up_proj", "down_proj"):
            groups[id(getattr(module, name))] = module.ep_dispatcher.group
    return groups


def _check(max_norm: float | None, norm_type: float) -> float:
    if max_norm is not None and (
        isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not 0.0 < max_norm < math.inf
    ):
        raise ValueError(f"max_norm must be a finite float > 0, got {max_norm!r}")
    if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)) or not norm_type > 0:
        raise ValueError(f"norm_type must be a float > 0 (or math.inf), got {norm_type!r}")
    return float(norm_type)


def total_grad_norm(model: nn.Module, norm_type: float = 2.0) -> torch.Tensor:
    """The norm of every gradient of ``model`` as if they were one vector (collective over its meshes).

    Every rank of every mesh or group the gradients live on must call it.
    """
    p = _check(None, norm_type)
    experts = _expert_groups(model)
    meshes: dict[tuple, list[torch.Tensor]] = {}
    groups: dict[int, tuple[dist.ProcessGroup | None, list[torch.Tensor]]] = {}
    local: list[torch.Tensor] = []
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        if isinstance(grad, DTensor):
            meshes.setdefault((grad.device_mesh, grad.placements), []).append(grad)
        elif id(param) in experts:
            group = experts[id(param)]
            groups.setdefault(id(group), (group, []))[1].append(grad)
        else:
            local.append(grad)
    parts: list[torch.Tensor] = []
    for grads in meshes.values():
        norm = torch.nn.utils.get_total_norm(grads, p)
        parts.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    for group, grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, p)
        share = norm.clone() if math.isinf(p) else norm.double() ** p
        dist.all_reduce(share, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM, group=group)
        parts.append(share if math.isinf(p) else share ** (1.0 / p))
    if local:
        parts.append(torch.nn.utils.get_total_norm(local, p))
    if not parts:
        return torch.tensor(0.0)
    device = parts[0].device
    stacked = torch.stack([t.to(device=device, dtype=torch.float64) for t in parts])
    return stacked.max() if math.isinf(p) else (stacked**p).sum() ** (1.0 / p)


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient of ``model`` so that their global norm is at most ``max_norm``.

    Equal to ``torch.nn.utils.clip_grad_norm_`` of the single-process model: the norm covers dense
    and expert gradients on every mesh. Returns the norm before clipping (float64). Collective.
    """
    p = _check(max_norm, norm_type)
    total = total_grad_norm(model, p)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is None:
                continue
            grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
            grad.mul_(coef.to(device=grad.device, dtype=grad.dtype))
    return total
