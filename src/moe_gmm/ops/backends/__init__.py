"""The backend registry: the only place that knows every backend name.

``auto`` walks a per-device priority list and takes the first backend that accepts the inputs;
when none does, the error lists every backend with the reason it was refused. An explicit
``backend=`` beats the ``MOE_GMM_BACKEND`` environment variable, which beats ``auto``.
"""

from __future__ import annotations

import importlib
import os

import torch

from moe_gmm.ops.backends.base import GmmBackend

__all__ = [
    "AUTO_PRIORITY",
    "BACKEND_ENV_VAR",
    "GmmBackend",
    "available_backends",
    "get_backend",
    "register_backend",
    "registered_backends",
    "select_backend",
    "unregister_backend",
]

BACKEND_ENV_VAR = "MOE_GMM_BACKEND"

# Built-in backends, imported when ``moe_gmm.ops`` is (``_load_builtins``, after the ops modules,
# which the backends import); each touches its optional package (triton, torch_npu) only when asked
# whether it can run.
_BUILTIN_MODULES: dict[str, str] = {
    "eager": "moe_gmm.ops.backends.eager",
    "cpu": "moe_gmm.ops.backends.cpu",
    "torch": "moe_gmm.ops.backends.torch_grouped_mm",
    "triton": "moe_gmm.ops.backends.triton",
    "npu": "moe_gmm.ops.backends.npu",
}

# Device type -> backends ``auto`` tries, best first. ``eager`` is last everywhere: it always works.
# cuda: torch's grouped_mm (CUTLASS) takes bf16 with K, N multiples of 8 on sm80+; triton takes
# the rest (fp16, fp32, unaligned shapes) with one launch instead of eager's loop of E matmuls.
# The order between torch and triton is not yet measured (benchmarks/gpu_check.py measures it).
# cpu: triton only runs in the interpreter there, far slower than any other backend, so it is
# never picked automatically.
AUTO_PRIORITY: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu", "torch", "eager"),
    "cuda": ("torch", "triton", "eager"),
    # npu: the vendor kernel whenever torch_npu and a device are present (untested on hardware here).
    "npu": ("npu", "eager"),
}
_DEFAULT_PRIORITY: tuple[str, ...] = ("eager",)

_registry: dict[str, GmmBackend] = {}
_builtins_loaded = False


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for name, module_path in _BUILTIN_MODULES.items():
        if name not in _registry:
            _registry[name] = importlib.import_module(module_path).BACKEND


def register_backend(backend: GmmBackend, *, replace: bool = False) -> None:
    """Add a backend (for example one of your own) under ``backend.name``."""
    if not isinstance(backend, GmmBackend):
        raise TypeError(f"backend must be a GmmBackend, got {type(backend).__name__}")
    _load_builtins()
    if backend.name in _registry and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True to override it")
    _registry[backend.name] = backend


def unregister_backend(name: str) -> None:
    """Remove a backend added with :func:`register_backend` (``eager`` cannot be removed)."""
    _load_builtins()
    if name == "eager":
        raise ValueError("the eager reference backend cannot be unregistered")
    if name not in _registry:
        raise ValueError(f"backend {name!r} is not registered; registered: {sorted(_registry)}")
    del _registry[name]


def registered_backends() -> dict[str, GmmBackend]:
    _load_builtins()
    return dict(_registry)


def get_backend(name: str) -> GmmBackend:
    _load_builtins()
    if name not in _registry:
        raise ValueError(f"backend={name!r} is not a registered backend; registered: {sorted(_registry)}")
    return _registry[name]


def available_backends() -> list[str]:
    """Names of the backends usable in this process (packages present, device reachable)."""
    _load_builtins()
    return sorted(name for name, b in _registry.items() if b.unavailable_reason() is None)


def select_backend(x_MK: torch.Tensor, w_EKN: torch.Tensor, name: str | None = None) -> GmmBackend:
    """The backend to run ``x_MK @ w_EKN`` on: ``name`` if given, else ``$MOE_GMM_BACKEND``, else auto."""
    _load_builtins()
    if name is None:
        name = os.environ.get(BACKEND_ENV_VAR) or "auto"
    if name != "auto":
        backend = get_backend(name)
        reason = backend.op_refusal(x_MK, w_EKN)
        if reason is not None:
            raise ValueError(
                f"backend={name!r} cannot run these inputs: {reason}; available here: {available_backends()}"
            )
        return backend
    priority = AUTO_PRIORITY.get(x_MK.device.type, _DEFAULT_PRIORITY)
    refusals = []
    for candidate in priority:
        backend = _registry.get(candidate)
        if backend is None:
            refusals.append(f"{candidate}: not registered")
            continue
        reason = backend.op_refusal(x_MK, w_EKN)
        if reason is None:
            return backend
        refusals.append(f"{candidate}: {reason}")
    raise ValueError(
        f"no grouped-matmul backend accepts device={x_MK.device.type}, dtype={x_MK.dtype}: " + "; ".join(refusals)
    )
