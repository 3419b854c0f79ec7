"""Guards against the expert-parallel mistakes that otherwise train on without a word.

- **An optimizer built before sharding.** ``apply_expert_parallel`` / ``parallelize_moe`` /
  ``replicate_moe`` put new parameter objects into the model; an optimizer built earlier keeps
  stepping the old ones, so the experts (and under FSDP every layer) never change. Every replaced
  parameter is remembered (weakly) here; :func:`check_optimizer` names the stale ones, and a
  global optimizer step pre-hook runs the same check at the first ``step()`` of every optimizer.
- **Replicas that drift apart.** Replicated parameters stay equal only if their gradients are
  reduced over the ranks (``replicate_moe`` / ``parallelize_moe`` do it; after a bare
  ``apply_expert_parallel`` the training loop must). :func:`verify_replicas` compares the sha256
  of their bytes across a group (one pass over each replica), cheaply enough to call every few
  hundred steps or at every checkpoint.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from moe_gmm.parallel.verify import first_difference_across, tensor_records

__all__ = ["check_optimizer", "record_replaced", "replicated_tensors", "verify_replicas"]

# Old parameter -> "<name> (replaced by <what>)". Weak keys: remembering a parameter never keeps it alive.
_REPLACED: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Optimizers whose first step was checked; later steps cost nothing.
_CHECKED: weakref.WeakSet = weakref.WeakSet()
_HOOK: list[Any] = []
_SHOWN = 8


def record_replaced(params: Iterable[tuple[str, torch.Tensor]], by: str) -> None:
    """Remember ``(name, old_parameter)`` pairs a sharding step took out of the model."""
    for name, param in params:
        _REPLACED[param] = f"{name} (replaced by {by})"
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_check_first_step))


def _check_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer not in _CHECKED:
        check_optimizer(optimizer)
        _CHECKED.add(optimizer)


def _listed(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def check_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module | None = None) -> None:
    """Raise ``ValueError`` if ``optimizer`` would not train the (sharded) model.

    Always: the optimizer holds parameters that expert-parallel sharding replaced (built before
    ``apply_expert_parallel`` / ``parallelize_moe`` / ``replicate_moe``); they are never read
    again, so stepping them changes nothing. With ``model``: also every trainable parameter of
    ``model`` must be in the optimizer (pass it when this optimizer is meant to train all of them).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if model is not None and not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or None, got {type(model).__name__}")
    held = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [_REPLACED[p] for p in held if p in _REPLACED]
    if stale:
        raise ValueError(
            f"optimizer holds {len(stale)} parameter(s) that expert-parallel sharding replaced, so stepping "
            f"them never changes the model: {_listed(stale)}; build the optimizer after sharding, from "
            "model.parameters(), e.g. make_adamw(model.parameters(), lr=...)"
        )
    if model is not None:
        ids = {id(p) for p in held}
        missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in ids]
        if missing:
            raise ValueError(
                f"optimizer does not hold {len(missing)} trainable parameter(s) of the model: {_listed(missing)}"
            )


def replicated_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters and buffers every rank of an EP group holds whole: all but the sharded experts'
    and the DTensors (whose parts differ by design)."""
    from moe_gmm.parallel.apply import expert_parameter_ids

    experts = expert_parameter_ids(model)
    named = [*model.named_parameters(), *model.named_buffers()]
    return [(n, t) for n, t in named if id(t) not in experts and not hasattr(t, "to_local")]


def verify_replicas(model: nn.Module, group: dist.ProcessGroup | None = None, *, what: str = "verify_replicas") -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless the replicated tensors are bitwise equal.

    ``group``: the ranks that hold the same replicas (the EP group after a bare
    ``apply_expert_parallel``; all ranks of the mesh after ``replicate_moe``). Collective: one
    gather of a sha256 per tensor (each rank hashes a CPU copy of every replica). The error names
    the first tensor that differs and which ranks hold which digest: their gradients were not
    reduced over ``group`` (or they were changed on some ranks only).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    difference = first_difference_across(tensor_records(replicated_tensors(model)), group, "replica verification")
    if difference is not None:
        raise ValueError(
            f"{what}: replicas differ across ranks (shape, dtype, sha256): {difference}; reduce the "
            "replicated gradients over the group every step (replicate_moe / parallelize_moe do it)"
        )
