"""The backend registry: the only place that knows every backend name.

``auto`` walks a per-device priority list and takes the first backend that accepts the inputs;
when none does, the error lists every backend with the reason it was refused. An explicit
``backend=`` beats the ``MOE_GMM_BACKEND`` environment variable, which beats ``auto``.

Each distinct choice (device, dtype, weight shape, what was asked, what was picked) is logged once
at INFO on the ``moe_gmm`` logger (``MOE_GMM_LOG=info`` shows it); :func:`explain` returns the
choice with every backend's reason as a :class:`BackendChoice`.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from moe_gmm.log import logger
from moe_gmm.ops.backends.base import GmmBackend

__all__ = [
    "AUTO_PRIORITY",
    "BACKEND_ENV_VAR",
    "BackendChoice",
    "GmmBackend",
    "available_backends",
    "explain",
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _requested(name: str | None) -> tuple[str, str]:
    """(the name asked for, who asked: the argument, the environment or nobody)."""
    if name is not None:
        return name, "argument"
    from_env = os.environ.get(BACKEND_ENV_VAR)
    return (from_env, f"${BACKEND_ENV_VAR}") if from_env else ("auto", "default")


# (device, dtype, weight shape, asked, picked) already logged: one line per layer shape, not per call.
_logged_choices: set[tuple] = set()


def _log_choice(x_MK: torch.Tensor, w_EKN: torch.Tensor, asked: str, picked: str, refusals: list[str]) -> None:
    # Under torch.compile the choice is made while tracing; a log call there would break the graph.
    if torch.compiler.is_compiling() or not logger.isEnabledFor(logging.INFO):
        return
    key = (str(x_MK.device), x_MK.dtype, tuple(w_EKN.shape), asked, picked)
    if key in _logged_choices:
        return
    _logged_choices.add(key)
    why = "named" if asked != "auto" else "auto"
    if refusals:
        why += "; refused before it: " + "; ".join(refusals)
    logger.info(
        "grouped_matmul on %s %s, weight %s: backend %r (%s)",
        x_MK.device,
        _dtype_name(x_MK.dtype),
        list(w_EKN.shape),
        picked,
        why,
    )


Problem = tuple[torch.Tensor, torch.Tensor]  # (x_MK, w_EKN): one matmul a backend must accept


def _refusal(backend: GmmBackend, problems: Sequence[Problem]) -> str | None:
    """Why ``backend`` cannot run every one of ``problems`` (the first reason), or None."""
    for x_MK, w_EKN in problems:
        reason = backend.op_refusal(x_MK, w_EKN)
        if reason is not None:
            return reason
    return None


def _verdicts(problems: Sequence[Problem], names: Sequence[str], *, first_only: bool) -> dict[str, str | None]:
    """``{name: refusal reason or None}`` in ``names`` order: the one loop behind selection and
    :func:`explain`; ``first_only`` stops at the first backend that accepts (what selection needs)."""
    verdicts: dict[str, str | None] = {}
    for name in names:
        backend = _registry.get(name)
        verdicts[name] = "not registered" if backend is None else _refusal(backend, problems)
        if first_only and verdicts[name] is None:
            break
    return verdicts


def _named_backend(problems: Sequence[Problem], name: str) -> GmmBackend:
    """The backend registered as ``name``, if it accepts every problem."""
    backend = get_backend(name)
    reason = _refusal(backend, problems)
    if reason is not None:
        raise ValueError(f"backend={name!r} cannot run these inputs: {reason}; available here: {available_backends()}")
    for x_MK, w_EKN in problems:
        _log_choice(x_MK, w_EKN, name, backend.name, [])
    return backend


def select_backend(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, name: str | None = None, *, also: Sequence[Problem] = ()
) -> GmmBackend:
    """The backend to run ``x_MK @ w_EKN`` on: ``name`` if given, else ``$MOE_GMM_BACKEND``, else auto.

    ``also`` lists further matmuls of the same layer (``(x, w)`` of the right shapes; a strided
    stand-in is enough): the backend chosen must accept every one, so a layer chooses once.
    """
    _load_builtins()
    name, source = _requested(name)
    problems = ((x_MK, w_EKN), *also)
    if name != "auto":
        try:
            return _named_backend(problems, name)
        except ValueError as exc:
            if source == "argument":
                raise
            # The caller passed nothing: the message must say where the name came from.
            raise ValueError(f"{source}: {exc}") from None
    verdicts = _verdicts(problems, AUTO_PRIORITY.get(x_MK.device.type, _DEFAULT_PRIORITY), first_only=True)
    refusals = [f"{n}: {reason}" for n, reason in verdicts.items() if reason is not None]
    picked = next((n for n, reason in verdicts.items() if reason is None), None)
    if picked is None:
        raise ValueError(
            f"no grouped-matmul backend accepts device={x_MK.device.type}, dtype={x_MK.dtype}: " + "; ".join(refusals)
        )
    for x, w in problems:  # one line per weight shape, as when each matmul chose alone
        _log_choice(x, w, name, picked, refusals)
    return _registry[picked]


@dataclass(frozen=True)
class BackendChoice:
    """Which grouped-matmul backend runs given inputs, and what every registered backend says to them.

    ``candidates`` maps each backend name to its refusal reason (None: it accepts the inputs), in
    the order ``auto`` tries them on this device, then the backends ``auto`` never tries there.
    """

    backend: str | None  # the backend that runs; None when the one asked for, or every candidate, refuses
    requested: str  # "auto" or the name asked for
    source: str  # who asked: "argument", "$MOE_GMM_BACKEND" or "default"
    device: str
    dtype: str
    weight_shape: tuple[int, ...]
    auto_order: tuple[str, ...]
    candidates: dict[str, str | None]

    @property
    def refusals(self) -> dict[str, str]:
        """``{name: reason}`` of every backend that cannot run these inputs."""
        return {name: reason for name, reason in self.candidates.items() if reason is not None}

    def __str__(self) -> str:
        where = f"grouped_matmul on {self.device} {self.dtype}, weight {list(self.weight_shape)}"
        if self.requested == "auto":
            how = f"auto, first to accept of {', '.join(self.auto_order)}"
        else:
            how = f"{self.requested!r} named by the {'argument' if self.source == 'argument' else self.source}"
        head = f"{where}: backend {self.backend!r} ({how})" if self.backend else f"{where}: no backend runs ({how})"
        width = max(map(len, self.candidates), default=0)
        lines = [head]
        for name, reason in self.candidates.items():
            if name == self.backend:
                verdict = "runs"
            elif reason is not None:
                verdict = f"refuses: {reason}"
            elif self.requested != "auto":
                verdict = "accepts (not asked for)"
            elif name in self.auto_order:
                verdict = "accepts (later in the auto order)"
            else:
                verdict = f"accepts (auto never tries it on {self.device.split(':')[0]})"
            lines.append(f"  {name:<{width}}  {verdict}")
        return "\n".join(lines)


def explain(
    x: torch.Tensor,
    weight: torch.Tensor,
    group_list: torch.Tensor | Sequence[int] | None = None,
    *,
    backend: str | None = None,
) -> BackendChoice:
    """Which backend ``grouped_matmul(x, weight, group_list, backend=backend)`` runs on, and why the
    others do not; ``str()`` of the result is a readable table.

    Checks the operands (and ``group_list`` when given) as :func:`~moe_gmm.grouped_matmul` does and
    raises the same errors; a backend refusing the inputs is reported, not raised.
    """
    from moe_gmm.ops.grouped_matmul import _check_operands, normalize_group_list

    _check_operands(x, weight)
    if group_list is not None:
        normalize_group_list(group_list, num_experts=weight.shape[0], num_rows=x.shape[0], device=x.device)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    _load_builtins()
    requested, source = _requested(backend)
    if requested != "auto":
        get_backend(requested)  # an unknown name is an error, as in grouped_matmul
    order = AUTO_PRIORITY.get(x.device.type, _DEFAULT_PRIORITY)
    names = [n for n in order if n in _registry] + sorted(n for n in _registry if n not in order)
    candidates = _verdicts(((x, weight),), names, first_only=False)
    if requested == "auto":
        chosen = next((name for name in names if name in order and candidates[name] is None), None)
    else:
        chosen = requested if candidates[requested] is None else None
    return BackendChoice(
        backend=chosen,
        requested=requested,
        source=source,
        device=str(x.device),
        dtype=_dtype_name(x.dtype),
        weight_shape=tuple(weight.shape),
        auto_order=tuple(n for n in order if n in _registry),
        candidates=candidates,
    )
