"""The backend registry: names, capabilities, auto selection and refusal reasons."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import moe_gmm
from moe_gmm.ops.backends import (
    AUTO_PRIORITY,
    GmmBackend,
    available_backends,
    eager,
    get_backend,
    register_backend,
    registered_backends,
    select_backend,
    unregister_backend,
)


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
        GmmBackend(
            name="bad name",
            devices=frozenset({"cpu"}),
            dtypes=frozenset({torch.float32}),
            forward=eager.forward,
            grad_input=eager.grad_input,
            grad_weight=eager.grad_weight,
        )
    with pytest.raises(ValueError, match="device"):
        GmmBackend(
            name="x",
            devices=frozenset(),
            dtypes=frozenset({torch.float32}),
            forward=eager.forward,
            grad_input=eager.grad_input,
            grad_weight=eager.grad_weight,
        )
    with pytest.raises(TypeError, match="GmmBackend"):
        register_backend("eager")
    with pytest.raises(ValueError, match="cannot be unregistered"):
        unregister_backend("eager")


# ---------------------------------------------------------------------------------------------
# explain() and the backend log
# ---------------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    e=st.integers(1, 4),
    k=st.integers(1, 40),
    n=st.integers(1, 40),
)
def test_explain_names_the_backend_select_backend_picks_and_every_refusal(dtype, e, k, n):
    x, w = torch.randn(3, k).to(dtype), torch.randn(e, k, n).to(dtype)
    choice = moe_gmm.explain(x, w)
    assert choice.backend == moe_gmm.select_backend(x, w).name
    assert list(choice.candidates) == [
        *AUTO_PRIORITY["cpu"],
        *sorted(set(registered_backends()) - set(AUTO_PRIORITY["cpu"])),
    ]
    for name, reason in choice.candidates.items():
        assert reason == get_backend(name).refusal(x, w)
    assert set(choice.refusals) == {n for n, r in choice.candidates.items() if r is not None}
    text = str(choice)
    assert text.splitlines()[0] == (
        f"grouped_matmul on cpu {str(dtype).removeprefix('torch.')}, weight {[e, k, n]}: backend {choice.backend!r} "
        f"(auto, first to accept of {', '.join(AUTO_PRIORITY['cpu'])})"
    )
    assert re.search(rf"^  {choice.backend} +runs$", text, re.MULTILINE), text
    for name, reason in choice.refusals.items():
        assert f"refuses: {reason}" in text


def test_explain_reports_a_refused_named_backend_without_raising():
    x, w = _x_w(torch.bfloat16, k=8, n=4)  # grouped_mm needs multiples of 8 in bf16
    choice = moe_gmm.explain(x, w, [1, 3], backend="torch")
    assert choice.backend is None and choice.requested == "torch" and choice.source == "argument"
    assert "K and N multiples of 8" in choice.refusals["torch"]
    assert "no backend runs ('torch' named by the argument)" in str(choice)
    with pytest.raises(ValueError, match="backend='torch' cannot run these inputs"):
        moe_gmm.grouped_matmul(x, w, [1, 3], backend="torch")


def test_explain_follows_the_environment_variable(monkeypatch):
    monkeypatch.setenv("MOE_GMM_BACKEND", "eager")
    x, w = _x_w()
    choice = moe_gmm.explain(x, w)
    assert (choice.backend, choice.requested, choice.source) == ("eager", "eager", "$MOE_GMM_BACKEND")
    assert "'eager' named by the $MOE_GMM_BACKEND" in str(choice)


def test_explain_checks_its_inputs_as_grouped_matmul_does():
    x, w = _x_w()
    with pytest.raises(ValueError, match=r"sum\(group_list\) must equal x.shape\[0\] = 4, got 5"):
        moe_gmm.explain(x, w, [2, 3])
    with pytest.raises(ValueError, match="group_list must have one entry per expert: expected length 2"):
        moe_gmm.explain(x, w, [4])
    with pytest.raises(ValueError, match=r"x.shape\[1\] \(K\) must equal weight.shape\[1\]"):
        moe_gmm.explain(x, torch.randn(2, 8, 16))
    with pytest.raises(TypeError, match="x and weight must share a dtype"):
        moe_gmm.explain(x, w.double())
    with pytest.raises(ValueError, match="backend='nope' is not a registered backend"):
        moe_gmm.explain(x, w, backend="nope")
    with pytest.raises(TypeError, match="backend must be a str or None, got int"):
        moe_gmm.explain(x, w, backend=3)


def test_each_distinct_choice_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="moe_gmm")
    # A weight shape no other test uses: the log remembers choices for the whole process.
    x, w = torch.randn(6, 24), torch.randn(3, 24, 40)
    for counts in ([2, 2, 2], [6, 0, 0], [0, 1, 5]):
        moe_gmm.grouped_matmul(x, w, counts)
    moe_gmm.grouped_matmul(x[:3], w, [1, 1, 1])  # another M, the same layer: no new line
    moe_gmm.grouped_matmul(x.double(), w.double(), [2, 2, 2])
    moe_gmm.grouped_matmul(x, w, [2, 2, 2], fused=False)
    lines = [r.getMessage() for r in caplog.records if r.name == "moe_gmm" and "weight [3, 24, 40]" in r.getMessage()]
    auto = moe_gmm.select_backend(x, w).name
    assert lines == [
        f"grouped_matmul on cpu float32, weight [3, 24, 40]: backend {auto!r} (auto)",
        "grouped_matmul on cpu float64, weight [3, 24, 40]: backend 'eager' (auto; refused before it: "
        + "; ".join(f"{n}: {get_backend(n).refusal(x.double(), w.double())}" for n in AUTO_PRIORITY["cpu"][:-1])
        + ")",
        "grouped_matmul on cpu float32, weight [3, 24, 40]: backend 'eager' (named)",
    ]


def test_nothing_is_logged_when_info_is_off(caplog):
    caplog.set_level(logging.WARNING, logger="moe_gmm")
    x, w = torch.randn(4, 24), torch.randn(2, 24, 48)
    moe_gmm.grouped_matmul(x, w, [1, 3])
    assert not [r for r in caplog.records if r.name == "moe_gmm"]
