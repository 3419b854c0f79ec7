"""make_adamw: the fused AdamW kernel where the device has it, else a fallback."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_gmm import grouped_matmul
from moe_gmm.optim import adamw_kind, make_adamw
from tests.helpers.profiling import op_names


def test_make_adamw_is_fused_on_cpu_and_runs_the_fused_kernel():
    p = torch.nn.Parameter(torch.randn(4, 8))
    p.grad = torch.randn(4, 8)
    fused = make_adamw([p], lr=1e-3, weight_decay=0.1)
    assert adamw_kind(fused) == "fused" and fused.defaults["weight_decay"] == 0.1
    assert "aten::_fused_adamw_" in op_names(fused.step)
    plain = torch.optim.AdamW([p], lr=1e-3)
    assert adamw_kind(plain) == "for-loop"
    assert "aten::_fused_adamw_" not in op_names(plain.step)


def test_make_adamw_falls_back_where_no_fused_kernel_exists():
    # The meta device has neither the fused nor the multi-tensor kernels.
    p = torch.nn.Parameter(torch.empty(4, 8, device="meta"))
    assert adamw_kind(make_adamw([p], lr=1e-3)) == "for-loop"
    with pytest.raises(ValueError, match="fused"):
        make_adamw([p], lr=1e-3, fused=False)


# ------------------------------------------------------------------------------------------------
# Every expert-weight layout x every AdamW implementation, against a float64 AdamW
# ------------------------------------------------------------------------------------------------

E, K, N = 3, 16, 24
COUNTS = [5, 0, 7]  # an empty expert: its gradient is exactly zero, its update weight decay only
LR, WEIGHT_DECAY, BETAS, EPS = 0.05, 0.1, (0.9, 0.999), 1e-8
STEPS = 3


def _layout(name: str, w_EKN: torch.Tensor) -> tuple[torch.nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]:
    """A parameter holding ``w_EKN``'s values in layout ``name``, and how the model reads it as ``[E, K, N]``.

    ``plain``: our ``[E, K, N]``; ``hf_view``: Hugging Face's ``[E, N, K]`` read through a transposed
    view; ``padded_by_hand``: rows padded in storage (not dense, so autograd gives it a contiguous
    gradient); ``transposed_storage``: ``[E, K, N]`` over ``[E, N, K]`` storage (dense, not contiguous).
    """
    if name == "plain":
        return torch.nn.Parameter(w_EKN.clone()), lambda p: p
    if name == "hf_view":
        return torch.nn.Parameter(w_EKN.transpose(1, 2).contiguous()), lambda p: p.transpose(1, 2)
    if name == "padded_by_hand":
        storage = torch.zeros(E, K, N + 5, dtype=w_EKN.dtype)
        storage[..., :N] = w_EKN
        return torch.nn.Parameter(storage[..., :N]), lambda p: p
    if name == "transposed_storage":
        return torch.nn.Parameter(w_EKN.transpose(1, 2).contiguous().transpose(1, 2)), lambda p: p
    raise AssertionError(name)


LAYOUTS = ("plain", "hf_view", "padded_by_hand", "transposed_storage")
DENSE = {"plain": True, "hf_view": True, "padded_by_hand": False, "transposed_storage": True}


def _optimizer(kind: str, param: torch.nn.Parameter) -> torch.optim.AdamW:
    """``fused``: what moe-gmm builds (make_adamw); the others: torch's own, forced."""
    common = {"lr": LR, "weight_decay": WEIGHT_DECAY, "betas": BETAS, "eps": EPS}
    if kind == "fused":
        return make_adamw([param], **common)
    return torch.optim.AdamW([param], foreach=kind == "foreach", **common)


def _adamw_float64(p0: torch.Tensor, grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled-weight-decay Adam (torch.optim.AdamW's definition) in float64 on ``grads``: the final
    parameter, and per element the sum over steps of ``|p| + lr * |update|``, the magnitude each
    step's rounding is relative to."""
    p, m, v = p0.double(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    scale = torch.zeros_like(p)
    b1, b2 = BETAS
    for t, g in enumerate(grads, start=1):
        p = p * (1 - LR * WEIGHT_DECAY)
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        update = (m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + EPS)
        scale += p.abs() + LR * update.abs()
        p = p - LR * update
    return p, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["fused", "foreach", "for-loop"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adamw_updates_every_weight_layout_like_float64(layout, kind, dtype):
    """Three steps on gradients from the grouped matmul's own backward: every element of the parameter
    within a few roundings of float64 AdamW on the same gradients. A kernel that reads the gradient
    with the parameter's strides when they differ is off by up to 2 x lr per step."""
    g = torch.Generator().manual_seed(3)
    w0 = (torch.randn(E, K, N, generator=g) * 0.5).to(dtype)
    param, as_EKN = _layout(layout, w0)
    assert torch.equal(as_EKN(param), w0)
    opt = _optimizer(kind, param)
    assert adamw_kind(opt) == (kind if kind != "fused" or DENSE[layout] else "foreach")
    start = as_EKN(param).detach().clone()
    grads = []
    for _ in range(STEPS):
        x = torch.randn(sum(COUNTS), K, generator=g).to(dtype)
        dy = torch.randn(sum(COUNTS), N, generator=g).to(dtype)
        opt.zero_grad(set_to_none=True)
        (grouped_matmul(x, as_EKN(param), COUNTS) * dy).sum().backward()
        grads.append(as_EKN(param.grad).double())
        opt.step()
    expected, scale = _adamw_float64(start, grads)
    err = (as_EKN(param).detach().double() - expected).abs()
    # Each step rounds the parameter and its update a few times at the dtype's precision.
    tol = 2 * torch.finfo(dtype).eps * scale
    worst = (err / tol).max().item()
    assert worst <= 1.0, f"{layout} / {kind} / {dtype}: an element is {worst:.1f}x its rounding bound off float64"


def test_make_adamw_falls_back_to_foreach_for_a_parameter_that_is_not_dense():
    dense = torch.nn.Parameter(torch.randn(4, 8))
    padded = torch.nn.Parameter(torch.zeros(4, 9)[:, :8])
    assert adamw_kind(make_adamw([dense], lr=1e-3)) == "fused"
    assert adamw_kind(make_adamw([dense, padded], lr=1e-3)) == "foreach"
    groups = [{"params": [dense]}, {"params": [padded], "weight_decay": 0.0}]
    assert adamw_kind(make_adamw(groups, lr=1e-3)) == "foreach"
    assert adamw_kind(make_adamw([("dense", dense), ("padded", padded)], lr=1e-3)) == "foreach"


def test_fused_adamw_refuses_a_gradient_whose_strides_differ_naming_the_parameter():
    """A gradient assigned by hand can differ in layout from a dense parameter; the fused step then
    raises before touching anything."""
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(3, 8, 4).transpose(1, 2))  # dense, not contiguous
    opt = make_adamw(model.named_parameters(), lr=1e-3)
    assert adamw_kind(opt) == "fused"
    model.w.grad = torch.randn(3, 4, 8)  # contiguous: the other strides
    before = model.w.detach().clone()
    with pytest.raises(ValueError, match=r"parameter w .*strides"):
        opt.step()
    assert torch.equal(model.w.detach(), before) and not opt.state
    model.w.grad = torch.empty_like(model.w).copy_(model.w.grad)  # the fix the error names
    opt.step()
    assert not torch.equal(model.w.detach(), before)


def test_make_adamw_names_a_bad_params_entry():
    with pytest.raises(TypeError, match="params"):
        make_adamw([torch.nn.Parameter(torch.randn(2)), "w"], lr=1e-3)


def test_fused_adamw_accepts_a_gradient_differing_only_in_a_size_one_stride():
    """A size-1 dimension's stride is never stepped, so it is no layout difference."""
    w = torch.nn.Parameter(torch.randn(8, 1, 4))
    opt = make_adamw([w], lr=1e-3)
    w.grad = torch.randn(8, 4, 1).transpose(1, 2)  # strides (4, 1, 1) against the parameter's (4, 4, 1)
    assert w.grad.stride() != w.stride()
    ref = torch.nn.Parameter(w.detach().clone())
    ref.grad = w.grad.contiguous()
    reference = torch.optim.AdamW([ref], lr=1e-3, foreach=False)
    opt.step()
    reference.step()
    torch.testing.assert_close(w.detach(), ref.detach(), rtol=1e-6, atol=1e-7)
