"""The optimizer moe-gmm trains with: AdamW on the fastest kernel the parameters' devices have."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["adamw_kind", "make_adamw"]


def make_adamw(params: Iterable[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **kwargs)`` with the fused kernel where every parameter's device has
    one, else ``foreach=True`` where it has the multi-tensor kernels, else torch's default.

    The default AdamW on CPU runs about a dozen element-wise ops per parameter, each a pass over its
    memory; the fused kernel updates a parameter and its two moments in one pass.
    """
    from torch.optim.optimizer import _get_foreach_kernels_supported_devices, _get_fused_kernels_supported_devices

    if "fused" in kwargs or "foreach" in kwargs:
        raise ValueError(f"make_adamw chooses fused/foreach itself; got {sorted({'fused', 'foreach'} & set(kwargs))}")
    params = list(params)
    devices = {p.device.type for p in params}
    if params and devices <= set(_get_fused_kernels_supported_devices()) and all(p.is_floating_point() for p in params):
        return torch.optim.AdamW(params, fused=True, **kwargs)
    if params and devices <= set(_get_foreach_kernels_supported_devices()):
        return torch.optim.AdamW(params, foreach=True, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def adamw_kind(opt: torch.optim.Optimizer) -> str:
    """``"fused"``, ``"foreach"`` or ``"for-loop"``: the AdamW implementation ``opt`` runs."""
    if opt.defaults.get("fused"):
        return "fused"
    return "foreach" if opt.defaults.get("foreach") else "for-loop"
