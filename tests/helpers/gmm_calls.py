"""Count moe-gmm's grouped-matmul custom-op calls: proof of which experts implementation ran."""

from __future__ import annotations

from collections import Counter

from torch.utils._python_dispatch import TorchDispatchMode


class GmmCalls(TorchDispatchMode):
    """``calls["moe_gmm::grouped_matmul"]`` etc.: the ``moe_gmm::*`` ops dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        if name.startswith("moe_gmm::"):
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))
