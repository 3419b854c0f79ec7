"""TopKRouter vs the float64 reference and Hugging Face's load-balancing loss."""

from __future__ import annotations

import pytest
import torch

from moe_gmm.layers import TopKRouter, load_balancing_loss
from moe_gmm.testing import assert_rel_close, reference_router


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_matches_reference(norm_topk_prob):
    router = TopKRouter(16, 8, 3, norm_topk_prob=norm_topk_prob)
    x = torch.randn(20, 16, requires_grad=True)
    logits, weights, ids = router(x)
    assert logits.shape == (20, 8) and weights.dtype == torch.float32 and ids.dtype == torch.int64
    x64 = x.detach().double().requires_grad_(True)
    w64 = router.weight.detach().double().requires_grad_(True)
    ref_w, ref_ids = reference_router(x64, w64, 3, norm_topk_prob)
    assert torch.equal(ids, ref_ids)
    assert_rel_close(weights, ref_w, 1e-6, "weights")
    if norm_topk_prob:
        torch.testing.assert_close(weights.sum(-1), torch.ones(20))
    dw = torch.randn(20, 3)
    weights.backward(dw)
    ref_w.backward(dw.double())
    assert_rel_close(x.grad, x64.grad, 1e-5, "d x")
    assert_rel_close(router.weight.grad, w64.grad, 1e-5, "d gate")


def test_bf16_softmax_in_float32():
    router = TopKRouter(16, 8, 2).to(torch.bfloat16)
    logits, weights, _ = router(torch.randn(5, 16, dtype=torch.bfloat16))
    assert logits.dtype == torch.bfloat16 and weights.dtype == torch.float32


def test_aux_loss_matches_transformers():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    router = TopKRouter(16, 8, 2)
    x = torch.randn(50, 16)
    logits, _, ids = router(x)
    ours = load_balancing_loss(logits, ids)
    theirs = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    torch.testing.assert_close(ours, theirs.to(ours.dtype), rtol=1e-6, atol=1e-6)
    # gradient reaches the router through the mean probabilities
    router.weight.grad = None
    load_balancing_loss(*router(x)[::2]).backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


def test_aux_loss_uniform_routing_is_top_k():
    logits = torch.zeros(8, 4)
    ids = torch.tensor([[0, 1], [2, 3]] * 4)
    torch.testing.assert_close(load_balancing_loss(logits, ids), torch.tensor(2.0))
    assert load_balancing_loss(torch.zeros(0, 4), torch.zeros(0, 2, dtype=torch.int64)).item() == 0.0


def test_tokens_per_expert():
    router = TopKRouter(4, 5, 2)
    counts = router.tokens_per_expert(torch.tensor([[0, 4], [4, 1]]))
    assert counts.tolist() == [1, 1, 0, 0, 2]


def test_nan_stays_in_its_token():
    router = TopKRouter(8, 6, 2)
    x = torch.randn(4, 8)
    x[2, 3] = float("nan")
    _, weights, ids = router(x)
    assert bool(((ids >= 0) & (ids < 6)).all())
    assert torch.isnan(weights[2]).all() and torch.isfinite(weights[[0, 1, 3]]).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="top_k"):
        TopKRouter(8, 4, 5)
    with pytest.raises(ValueError, match="num_experts"):
        TopKRouter(8, 0, 1)
    with pytest.raises(ValueError, match="hidden_size"):
        TopKRouter(True, 4, 1)
    with pytest.raises(ValueError, match="x_TH"):
        TopKRouter(8, 4, 2)(torch.randn(3, 7))
