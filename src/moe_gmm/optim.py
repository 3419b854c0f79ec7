"""The optimizer moe-gmm trains with: AdamW on the fastest kernel the parameters' devices have.

Build it one way, everywhere (after any sharding, so it holds the parameters that train)::

    optimizer = make_adamw(model.parameters(), lr=1e-3, weight_decay=0.1)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["adamw_kind", "make_adamw"]


def make_adamw(params: Iterable[Any], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)`` on the fused kernel where it is both available and safe,
    else ``foreach=True`` where the device has the fused or the multi-tensor kernels, else torch's
    default loop.

    Why not the default: the for-loop AdamW on CPU runs about a dozen element-wise ops per parameter,
    each a pass over its memory; the fused kernel updates a parameter and its two moments in one pass.

    Why not always fused: torch's fused CPU kernel walks a parameter and its gradient as if they had
    the same strides. Autograd gives a gradient its parameter's strides only when the parameter is
    non-overlapping and dense; any other parameter (rows padded in storage, an overlapping view) gets a
    contiguous gradient, and the fused kernel would update the wrong elements. So any such parameter
    makes the whole optimizer ``foreach``, which indexes both tensors by their own strides. A
    gradient assigned by hand can break the rule on a dense parameter too: a fused optimizer built
    here checks every gradient's strides before each step and raises a ``ValueError`` naming the
    parameter rather than update it wrongly.

    ``params`` is what ``torch.optim.AdamW`` takes: parameters, ``(name, parameter)`` pairs (the
    names then appear in errors) or parameter-group dicts. ``fused`` / ``foreach`` are chosen here
    and refused as keyword arguments.
    """
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices

    if "fused" in kwargs or "foreach" in kwargs:
        raise ValueError(f"make_adamw chooses fused/foreach itself; got {sorted({'fused', 'foreach'} & set(kwargs))}")
    params = list(params)
    tensors = _param_tensors(params)
    devices = {p.device.type for p in tensors}
    fused_devices = bool(tensors) and devices <= set(_get_fused_kernels_supported_devices())
    if fused_devices and all(_fused_safe(p) for p in tensors):
        opt = torch.optim.AdamW(params, fused=True, **kwargs)
        opt.register_step_pre_hook(_check_grad_strides)
        return opt
    # Where the fused kernel exists but a layout rules it out (CPU included), the multi-tensor ops
    # still run: each indexes a parameter and its gradient by their own strides.
    if fused_devices or (tensors and devices <= set(_get_foreach_kernels_supported_devices())):
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def adamw_kind(opt: torch.optim.Optimizer) -> str:
    """``"fused"``, ``"foreach"`` or ``"for-loop"``: the AdamW implementation ``opt`` runs."""
    if opt.defaults.get("fused"):
        return "fused"
    return "foreach" if opt.defaults.get("foreach") else "for-loop"


def _param_tensors(params: Sequence[Any]) -> list[torch.Tensor]:
    """The tensors in ``params``, whichever of torch's three forms each entry takes."""
    tensors = []
    for entry in params:
        group = entry["params"] if isinstance(entry, dict) else [entry]
        if isinstance(group, torch.Tensor):
            group = [group]
        for item in group:
            tensor = item[1] if isinstance(item, tuple) and len(item) == 2 else item
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(
                    "params must hold tensors, (name, tensor) pairs or parameter groups, "
                    f"got an entry of type {type(tensor).__name__}"
                )
            tensors.append(tensor)
    return tensors


def _fused_safe(p: torch.Tensor) -> bool:
    """Whether the fused kernel can update ``p``: floating point, and laid out so that autograd gives
    its gradient the same strides."""
    return p.is_floating_point() and _non_overlapping_and_dense(p)


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its storage span exactly once in some order of its dimensions:
    the layouts for which autograd keeps a parameter's strides in its gradient."""
    if t.numel() == 0:
        return True
    expected = 1
    for stride, size in sorted((st, s) for s, st in zip(t.shape, t.stride()) if s != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _check_grad_strides(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of a fused AdamW: refuse a gradient whose strides differ from its parameter's,
    which the fused kernel would read at the wrong elements."""
    del args, kwargs
    for g, group in enumerate(opt.param_groups):
        names = group.get("param_names")
        for i, p in enumerate(group["params"]):
            grad = p.grad
            if grad is None or _same_layout(grad, p):
                continue
            name = names[i] if names else f"param_groups[{g}]['params'][{i}]"
            raise ValueError(
                f"parameter {name} (shape {tuple(p.shape)}, strides {p.stride()}) has a gradient with strides "
                f"{grad.stride()}; the fused AdamW kernel would update the wrong elements. Give the gradient "
                "its parameter's layout (torch.empty_like(p).copy_(grad)) or build the optimizer with "
                "make_adamw after the parameters take their final layout"
            )


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` step through memory alike; a size-1 dimension's stride is never used."""
    return all(sa == sb or size == 1 for size, sa, sb in zip(b.shape, a.stride(), b.stride()))
