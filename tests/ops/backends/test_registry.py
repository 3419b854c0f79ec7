"""The backend registry: names, capabilities, auto selection and refusal reasons."""

from __future__ import annotations

import pytest
import torch

import moe_gmm
from moe_gmm.ops.backends import (
    AUTO_PRIORITY,
    GmmBackend,
    available_backends,
    get_backend,
    register_backend,
    registered_backends,
    select_backend,
    unregister_backend,
)
from moe_gmm.ops.backends import eager


def _x_w(dtype=torch.float32, k=16, n=16):
    return torch.randn(4, k, dtype=dtype), torch.randn(2, k, n, dtype=dtype)


def test_builtins_registered_and_eager_always_available():
    names = registered_backends()
    assert {"eager", "torch"} <= set(names)
    assert "eager" in available_backends()
    for name in AUTO_PRIORITY["cpu"]:
        assert name in names, f"auto priority names an unregistered backend {name!r}"


def test_auto_on_cpu_takes_the_first_accepting_backend():
    x, w = _x_w()
    first = next(n for n in AUTO_PRIORITY["cpu"] if get_backend(n).refusal(x, w) is None)
    assert select_backend(x, w, "auto").name == first
    assert select_backend(x, w, None).name == first


def test_auto_falls_back_to_eager_for_float64():
    x, w = _x_w(torch.float64)
    assert select_backend(x, w).name == "eager"


def test_declared_capabilities_are_well_formed():
    for backend in registered_backends().values():
        assert backend.devices and backend.dtypes
        assert isinstance(backend.supports_backward, bool) and isinstance(backend.supports_compile, bool)


def test_no_backend_accepts_lists_every_refusal(monkeypatch):
    monkeypatch.setitem(AUTO_PRIORITY, "cpu", ("torch",))
    x, w = _x_w(torch.float64)
    with pytest.raises(ValueError, match=r"no grouped-matmul backend accepts device=cpu.*torch: dtype float64 not in"):
        select_backend(x, w)


def test_register_and_use_a_custom_backend():
    calls = []

    def forward(x, w, ends):
        calls.append("forward")
        return eager.forward(x, w, ends)

    custom = GmmBackend(
        name="counting",
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        forward=forward,
        grad_input=eager.grad_input,
        grad_weight=eager.grad_weight,
    )
    register_backend(custom)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_backend(custom)
        x, w = _x_w()
        y = moe_gmm.grouped_matmul(x, w, [1, 3], backend="counting")
        assert calls == ["forward"]
        torch.testing.assert_close(y, moe_gmm.grouped_matmul(x, w, [1, 3], fused=False))
    finally:
        unregister_backend("counting")
    assert "counting" not in registered_backends()


def test_backend_spec_is_validated():
    with pytest.raises(ValueError, match="identifier"):
        GmmBackend(name="bad name", devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                   forward=eager.forward, grad_input=eager.grad_input, grad_weight=eager.grad_weight)
    with pytest.raises(ValueError, match="device"):
        GmmBackend(name="x", devices=frozenset(), dtypes=frozenset({torch.float32}),
                   forward=eager.forward, grad_input=eager.grad_input, grad_weight=eager.grad_weight)
    with pytest.raises(TypeError, match="GmmBackend"):
        register_backend("eager")
    with pytest.raises(ValueError, match="cannot be unregistered"):
        unregister_backend("eager")
