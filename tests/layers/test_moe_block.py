"""SparseMoeBlock: float64 reference, fused vs eager, scope of the grouped matmul, bad inputs."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from moe_gmm.layers import MoeBlockConfig, SparseMoeBlock
from moe_gmm.testing import assert_rel_close, reference_moe_block, relative_error, tolerance_for

CONFIG = MoeBlockConfig(
    hidden_size=16,
    num_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=8,
    shared_expert_intermediate_size=12,
)


def _block(**overrides) -> SparseMoeBlock:
    torch.manual_seed(0)
    return SparseMoeBlock(dataclasses.replace(CONFIG, **overrides))


@pytest.mark.parametrize("shared", [12, 0], ids=["shared_expert", "no_shared_expert"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
def test_vs_float64_reference(fused, shared):
    block = _block(use_grouped_expert_matmul=fused, shared_expert_intermediate_size=shared)
    x = torch.randn(2, 9, 16, requires_grad=True)
    out = block(x)
    assert out.shape == x.shape

    names = [n for n, _ in block.named_parameters()]
    leaves = {n: p.detach().double().requires_grad_(True) for n, p in block.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    ref = reference_moe_block(leaves, x64.view(-1, 16), top_k=3).view(x.shape)
    assert_rel_close(out, ref, 1e-5, "out")

    dy = torch.randn(x.shape)
    out.backward(dy)
    ref.backward(dy.double())
    assert_rel_close(x.grad, x64.grad, 1e-5, "d x")
    params = dict(block.named_parameters())
    for n in names:
        assert_rel_close(params[n].grad, leaves[n].grad, 1e-5, f"d {n}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_vs_eager(dtype):
    fused = _block().to(dtype)
    eager = _block(use_grouped_expert_matmul=False).to(dtype)
    eager.load_state_dict(fused.state_dict())
    x = torch.randn(24, 16).to(dtype)
    tol = tolerance_for(dtype)
    results = []
    for block in (fused, eager):
        xi = x.clone().requires_grad_(True)
        out = block(xi)
        out.float().square().sum().backward()
        results.append([out, xi.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=tol.rtol, atol=tol.atol)


class _OpCounter(TorchDispatchMode):
    """Counts every op that reaches the dispatcher, keyed by its overload name."""

    def __init__(self):
        super().__init__()
        self.calls: Counter[str] = Counter()
        self.gmm_args: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.name())
        self.calls[name] += 1
        if name == "moe_gmm::grouped_matmul":
            self.gmm_args.append((tuple(args[0].shape), tuple(args[1].shape), args[3]))
        return func(*args, **(kwargs or {}))


def test_scope_only_routed_experts_use_grouped_matmul():
    block = _block()
    x = torch.randn(10, 16, requires_grad=True)
    shared_window = {}

    def pre(_module, _inputs):
        shared_window["before"] = sum(v for k, v in counter.calls.items() if k.startswith("moe_gmm::grouped_matmul"))

    def post(_module, _inputs, _output):
        shared_window["after"] = sum(v for k, v in counter.calls.items() if k.startswith("moe_gmm::grouped_matmul"))
        shared_window["mm_inside"] = counter.calls["aten::mm"] - shared_window["mm_before"]

    def pre_mm(_module, _inputs):
        pre(_module, _inputs)
        shared_window["mm_before"] = counter.calls["aten::mm"]

    block.shared_expert.register_forward_pre_hook(pre_mm)
    block.shared_expert.register_forward_hook(post)
    with _OpCounter() as counter:
        out = block(x)
    assert counter.calls["moe_gmm::grouped_matmul"] == 2
    (a_x, a_w, a_backend), (b_x, b_w, b_backend) = counter.gmm_args
    assert a_x == (30, 16) and a_w == (8, 16, 16) and b_x == (30, 8) and b_w == (8, 8, 16)
    assert a_backend != "eager" and b_backend != "eager"
    # The shared expert ran its three projections as plain matmuls, none through grouped_matmul.
    assert shared_window["after"] == shared_window["before"]
    assert shared_window["mm_inside"] == 3

    with _OpCounter() as counter:
        out.square().sum().backward()
    assert counter.calls["moe_gmm::grouped_matmul_grad_input"] == 2
    assert counter.calls["moe_gmm::grouped_matmul_grad_weight"] == 2
    assert counter.calls["moe_gmm::grouped_matmul"] == 0


def test_eager_switch_uses_eager_backend():
    block = _block(use_grouped_expert_matmul=False)
    with _OpCounter() as counter:
        block(torch.randn(5, 16))
    assert [a[2] for a in counter.gmm_args] == ["eager", "eager"]


def test_aux_loss_and_stats():
    block = _block(router_aux_loss_coef=0.1)
    x = torch.randn(12, 16)
    block(x)
    assert block.aux_loss is not None and block.aux_loss.ndim == 0 and block.aux_loss > 0
    assert int(block.tokens_per_expert.sum()) == 12 * 3
    assert _block().aux_loss is None


def test_zero_tokens():
    block = _block()
    x = torch.zeros(0, 16, requires_grad=True)
    out = block(x)
    out.sum().backward()
    assert out.shape == (0, 16)


def test_nan_hidden_state_stays_in_its_token():
    # Documented behaviour: no check (it would cost a host sync); NaN stays in that token's output.
    block = _block()
    x = torch.randn(6, 16)
    clean = block(x)
    x[4, 0] = float("nan")
    out = block(x)
    assert torch.isnan(out[4]).all()
    torch.testing.assert_close(out[[0, 1, 2, 3, 5]], clean[[0, 1, 2, 3, 5]])


def test_bad_inputs():
    block = _block()
    with pytest.raises(ValueError, match="hidden_states"):
        block(torch.randn(4, 15))
    with pytest.raises(TypeError, match="hidden_states dtype"):
        block(torch.randn(4, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="hidden_states"):
        block(torch.randn(4, 16).tolist())
    with pytest.raises(TypeError, match="config"):
        SparseMoeBlock({"hidden_size": 16})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoeBlockConfig(num_experts=4, num_experts_per_tok=5)
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        MoeBlockConfig(moe_intermediate_size=0)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        MoeBlockConfig(shared_expert_intermediate_size=-1)
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        MoeBlockConfig(router_aux_loss_coef=-0.5)


def test_fullgraph_compile_forward_and_backward():
    block = _block()
    x = torch.randn(2, 5, 16)
    x_eager, x_compiled = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    expected = block(x_eager)
    expected.square().sum().backward()
    eager_grads = [p.grad.clone() for p in block.parameters()]
    block.zero_grad(set_to_none=True)
    got = torch.compile(block, fullgraph=True, backend="aot_eager")(x_compiled)
    got.square().sum().backward()
    assert_rel_close(got, expected, 1e-6, "compiled block")
    assert_rel_close(x_compiled.grad, x_eager.grad, 1e-6, "compiled d x")
    for p, g in zip(block.parameters(), eager_grads):
        assert_rel_close(p.grad, g, 1e-6, "compiled d param")


@settings(max_examples=10, deadline=None)
@given(
    num_tokens=st.integers(0, 12),
    num_experts=st.integers(1, 6),
    data=st.data(),
    hidden=st.sampled_from([4, 8]),
    inter=st.integers(1, 6),
    shared=st.integers(0, 5),
    seed=st.integers(0, 2**16),
)
def test_random_shapes_vs_reference(num_tokens, num_experts, data, hidden, inter, shared, seed):
    top_k = data.draw(st.integers(1, num_experts))
    _check_against_reference(num_tokens, num_experts, top_k, hidden, inter, shared, seed)


def test_a_gradient_that_cancels_is_as_close_as_the_eager_blocks():
    # A shared expert of one unit: its down_proj gradient is a sum over the tokens that cancels to
    # about 1e-8 (relative error 2.8e-4 against float64 in float32, in every implementation).
    _check_against_reference(num_tokens=11, num_experts=1, top_k=1, hidden=8, inter=1, shared=1, seed=2126)


def _check_against_reference(num_tokens, num_experts, top_k, hidden, inter, shared, seed):
    torch.manual_seed(seed)
    config = MoeBlockConfig(
        hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
        shared_expert_intermediate_size=shared,
    )  # fmt: skip
    block = SparseMoeBlock(config)
    x = torch.randn(num_tokens, hidden, requires_grad=True)
    # The same block on the per-expert loop: how close float32 can get where a gradient cancels.
    eager_block = SparseMoeBlock(dataclasses.replace(config, gmm_backend="eager"))
    eager_block.load_state_dict(block.state_dict())
    x_eager = x.detach().clone().requires_grad_(True)
    eager_block(x_eager).sum().backward()
    eager_grads = {"d x": x_eager.grad, **{f"d {n}": p.grad for n, p in eager_block.named_parameters()}}
    out = block(x)
    leaves = {n: p.detach().double().requires_grad_(True) for n, p in block.named_parameters()}
    x64 = x.detach().double().requires_grad_(True)
    ref = reference_moe_block(leaves, x64, top_k=top_k)
    assert_rel_close(out, ref, 1e-5, "out")
    out.sum().backward()
    if ref.requires_grad:  # with T = 0 and no shared expert the reference never touches a parameter
        ref.sum().backward()

    def check_grad(got, want, what):
        # The reference skips experts without tokens (grad None); with k = 1 and renormalisation the
        # router's grad is exactly zero in float64 and rounding noise in float32: compare absolutely.
        eager = eager_grads[what] if eager_grads[what] is not None else torch.zeros_like(got)
        got = got.grad if got.grad is not None else torch.zeros_like(got)
        want = want.grad if want.grad is not None else torch.zeros_like(want)
        if want.norm() < 1e-12:
            assert got.numel() == 0 or got.abs().max() < 1e-6, what
        elif relative_error(got, want) > 1e-5:
            # A gradient summed from terms much larger than itself keeps fewer float32 digits in any
            # float32 implementation: then it must be as close to float64 as the eager block's, within 2x.
            eager_err = (eager.double() - want).abs().max().item()
            got_err = (got.double() - want).abs().max().item()
            assert got_err <= 2 * eager_err, f"{what}: max abs error {got_err:.3e}, eager block's {eager_err:.3e}"

    check_grad(x, x64, "d x")
    for n, p in block.named_parameters():
        check_grad(p, leaves[n], f"d {n}")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("norm_topk_prob", "no"),
        ("norm_topk_prob", 0),
        ("use_grouped_expert_matmul", "false"),
        ("fused_permute", 1),
        ("hidden_size", True),
        ("hidden_size", 16.0),
        ("num_experts", "8"),
        ("shared_expert_intermediate_size", 8.5),
        ("router_aux_loss_coef", "0.1"),
        ("router_aux_loss_coef", False),
        ("gmm_backend", 3),
    ],
)
def test_config_checks_field_types_on_construction(field, value):
    # At construction, not at the first forward, and naming the option.
    with pytest.raises(TypeError, match=rf"^MoeBlockConfig\.{field}: expected "):
        MoeBlockConfig(**{field: value})


def test_config_accepts_ints_for_floats_and_refuses_non_finite():
    assert MoeBlockConfig(router_aux_loss_coef=0).router_aux_loss_coef == 0
    for bad in (float("nan"), float("inf"), -1e-3):
        with pytest.raises(ValueError, match="router_aux_loss_coef"):
            MoeBlockConfig(router_aux_loss_coef=bad)
