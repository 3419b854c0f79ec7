"""The small interface every grouped-matmul backend implements.

Legend: M rows (tokens after permute), K input features, N output features, E experts.

A backend receives inputs the contract layer (``ops/grouped_matmul.py``) has already validated:
``x_MK`` and ``w_EKN`` share dtype and device, ``group_ends_E`` is an integer tensor on that device
holding inclusive cumulative row ends (non-decreasing, last == M). ``w_EKN`` may be any strided
view (e.g. the transpose of an ``[E, N, K]`` parameter); a backend must not copy it per call
unless its kernel cannot read that layout, and must say so in ``notes``.

Every backend returns freshly computed tensors and guarantees:
- every output element is written (no uninitialised rows);
- ``grad_weight`` of an expert with zero rows is exactly zero.

The ops call a backend through ``run_forward`` / ``run_grad_input`` / ``run_grad_weight``: an empty
problem (M, K or N of 0) is answered there without the kernel, and every result is checked against
the shape, dtype and device the op promises (metadata only: no sync, so it is always on).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

# forward(x_MK, w_EKN, group_ends_E) -> y_MN
ForwardFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# grad_input(dy_MN, w_EKN, group_ends_E) -> dx_MK
GradInputFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# grad_weight(x_MK, dy_MN, group_ends_E) -> dw_EKN
GradWeightFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# refusal(x_MK, w_EKN) -> None when the backend can take these inputs, else the reason it cannot
RefusalFn = Callable[[torch.Tensor, torch.Tensor], "str | None"]


@dataclass(frozen=True)
class GmmBackend:
    """A grouped-matmul implementation and what it can do."""

    name: str
    devices: frozenset[str]
    dtypes: frozenset[torch.dtype]
    forward: ForwardFn
    grad_input: GradInputFn
    grad_weight: GradWeightFn
    supports_backward: bool = True
    supports_compile: bool = True
    # Returns None when usable in this process, else why not (missing package, no device...).
    unavailable_reason: Callable[[], str | None] = lambda: None
    # Extra per-input refusal beyond device and dtype (alignment, size limits...).
    input_refusal: RefusalFn | None = None
    notes: str = ""
    tags: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if not self.name or not self.name.isidentifier():
            raise ValueError(f"backend name must be a non-empty identifier, got {self.name!r}")
        if not self.devices:
            raise ValueError(f"backend {self.name!r} must declare at least one device type")
        if not self.dtypes:
            raise ValueError(f"backend {self.name!r} must declare at least one dtype")
        for fn_name in ("forward", "grad_input", "grad_weight"):
            if not callable(getattr(self, fn_name)):
                raise TypeError(f"backend {self.name!r}: {fn_name} must be callable")

    def refusal(self, x_MK: torch.Tensor, w_EKN: torch.Tensor) -> str | None:
        """Why this backend cannot run these inputs, or None if it can."""
        reason = self.unavailable_reason()
        if reason is not None:
            return reason
        if x_MK.device.type not in self.devices:
            return f"device {x_MK.device.type!r} not in {sorted(self.devices)}"
        if x_MK.dtype not in self.dtypes:
            supported = sorted(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"dtype {str(x_MK.dtype).removeprefix('torch.')} not in {supported}"
        if self.input_refusal is not None:
            return self.input_refusal(x_MK, w_EKN)
        return None

    def op_refusal(self, x_MK: torch.Tensor, w_EKN: torch.Tensor) -> str | None:
        """Why the ops cannot run these inputs here: :meth:`refusal`, less the kernel's shape limits
        for an empty problem, which the run_* methods answer without the kernel."""
        if not _degenerate(x_MK.shape[0], *w_EKN.shape[1:]):
            return self.refusal(x_MK, w_EKN)
        return replace(self, input_refusal=None).refusal(x_MK, w_EKN)

    def run_forward(self, x_MK: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
        """``forward`` with empty problems answered here and the result checked."""
        shape = (x_MK.shape[0], w_EKN.shape[2])
        if _degenerate(*shape, x_MK.shape[1]):
            return _empty_result(shape, x_MK, reduced=x_MK.shape[1])
        return self._checked("forward", self.forward(x_MK, w_EKN, group_ends_E), shape, x_MK)

    def run_grad_input(self, dy_MN: torch.Tensor, w_EKN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
        """``grad_input`` with empty problems answered here and the result checked."""
        shape = (dy_MN.shape[0], w_EKN.shape[1])
        if _degenerate(*shape, dy_MN.shape[1]):
            return _empty_result(shape, dy_MN, reduced=dy_MN.shape[1])
        return self._checked("grad_input", self.grad_input(dy_MN, w_EKN, group_ends_E), shape, dy_MN)

    def run_grad_weight(self, x_MK: torch.Tensor, dy_MN: torch.Tensor, group_ends_E: torch.Tensor) -> torch.Tensor:
        """``grad_weight`` with empty problems answered here and the result checked."""
        shape = (group_ends_E.shape[0], x_MK.shape[1], dy_MN.shape[1])
        if _degenerate(x_MK.shape[0], *shape[1:]):
            return _empty_result(shape, x_MK, reduced=x_MK.shape[0])
        return self._checked("grad_weight", self.grad_weight(x_MK, dy_MN, group_ends_E), shape, x_MK)

    def _checked(self, what: str, out: object, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        # A wrong result would otherwise travel on unnoticed: the fake kernel promised this shape.
        expected = f"a {str(like.dtype).removeprefix('torch.')} tensor of shape {shape} on {like.device}"
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"backend {self.name!r} {what} returned {type(out).__name__}, expected {expected}")
        if tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device:
            raise RuntimeError(
                f"backend {self.name!r} {what} returned a {str(out.dtype).removeprefix('torch.')} tensor of "
                f"shape {tuple(out.shape)} on {out.device}, expected {expected}"
            )
        return out


def _degenerate(*sizes: int) -> bool:
    return 0 in sizes


def _empty_result(shape: tuple[int, ...], like: torch.Tensor, *, reduced: int) -> torch.Tensor:
    """The result of a product with a zero-sized dimension: empty, or zeros when only the reduced one is."""
    if reduced == 0 and 0 not in shape:
        return like.new_zeros(shape)
    return like.new_empty(shape)


def counts_from_ends(group_ends_E: torch.Tensor) -> torch.Tensor:
    """Rows per expert from inclusive cumulative ends (stays on the ends' device)."""
    starts_E = torch.cat([group_ends_E.new_zeros(1), group_ends_E[:-1]])
    return group_ends_E - starts_E


# Attribute of a group-ends tensor holding ``(its version, its host bounds)``: the bounds are read
# once per layer, not once per matmul and strategy (an in-place change bumps the version).
_BOUNDS_ATTR = "_moe_gmm_host_bounds"


def cached_bounds(group_ends_E: torch.Tensor) -> list[int] | None:
    """The host bounds remembered for these ends by :func:`remember_bounds`, if still current."""
    entry = getattr(group_ends_E, _BOUNDS_ATTR, None)
    if entry is not None and entry[0] == group_ends_E._version:
        return entry[1]
    return None


def remember_bounds(group_ends_E: torch.Tensor, bounds: list[int]) -> None:
    """Keep ``bounds`` with the ends (not for inference tensors, which have no version to check)."""
    if not group_ends_E.is_inference():
        setattr(group_ends_E, _BOUNDS_ATTR, (group_ends_E._version, bounds))


def host_bounds(group_ends_E: torch.Tensor) -> list[int]:
    """``[0, end_0, ..., end_{E-1}]`` as Python ints.

    Host sync: reads the group ends back from the device, unless the layer's normalisation or an
    earlier matmul already did (:func:`cached_bounds`). Loop-style backends need it to slice.
    """
    bounds = cached_bounds(group_ends_E)
    if bounds is None:
        bounds = [0, *group_ends_E.tolist()]
        remember_bounds(group_ends_E, bounds)
    return bounds
