"""The support rule (``moe_gmm.integrations.support``) and both paths that apply it.

Real Hugging Face experts modules from tiny models: plain SwiGLU, clamped custom gates
(DeepSeek-V4, BailingHybrid), another activation (Gemma 4), a post-expert norm (Muse Spark), biases
(gpt-oss) and gate-less experts (Nemotron-H). Each either runs exactly (moe_gmm vs the module's
eager forward and vs a float64 run, forward and backward, with empty experts and uneven groups)
or is refused with its reason; under expert parallelism a clamped DeepSeek-V4 model equals the
single-process eager model and a refused module raises the rule's reason.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from moe_gmm.integrations.support import Support, expert_mlp_support, run_expert_mlp
from moe_gmm.integrations.transformers import register_moe_gmm_experts
from moe_gmm.layers import GroupedExperts
from moe_gmm.ops.expert_mlp import expert_mlp
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.parallel import EPPlan, apply_expert_parallel
from moe_gmm.parallel.apply import expert_parameter_ids
from moe_gmm.parallel.launch import run_ranks
from moe_gmm.testing import assert_rel_close, relative_error
from tests.helpers.gmm_calls import GmmCalls
from tests.helpers.hf_moe_families import build, discover_families, is_experts_module

LIMIT = 1e-5
FAMILIES = {f.name: f for f in discover_families()}
# family -> (config overrides, what the rule answers); the limits make the clamps bite at init scale.
CASES = {
    "qwen3_moe": ({}, "swiglu"),
    "deepseek_v4": ({"swiglu_limit": 0.05}, "module_gate"),
    "bailing_hybrid": ({"swiglu_limits": [0.02, 0.02]}, "module_gate"),
    "minimax_m3_vl": ({"swiglu_limit": 0.05}, "module_gate"),
    "gemma4": ({}, "module_gate"),
    "muse_spark": ({}, "module_gate"),
    "gpt_oss": ({"swiglu_limit": 0.05}, None),
    "nemotron_h": ({}, None),
}
REFUSAL = {"gpt_oss": "has per-expert biases (has_bias=True)", "nemotron_h": "has no gate (has_gate=False"}


@pytest.fixture(scope="module", autouse=True)
def _registered():
    register_moe_gmm_experts()


def _model_and_experts(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    model = build(FAMILIES[name], "eager", **CASES[name][0])
    return model, next(m for m in model.modules() if is_experts_module(m))


def _width(experts: torch.nn.Module) -> int:
    """The experts' input (= output) width, which need not be the model's hidden size."""
    return experts.down_proj.shape[2 if experts.is_transposed else 1]


def _routing(num_tokens: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 ids that leave expert 0 empty and load the others unevenly, and their weights."""
    g = torch.Generator().manual_seed(seed)
    first = 1 + torch.randint(0, num_experts - 1, (num_tokens,), generator=g) ** 2 % (num_experts - 1)
    second = 1 + (first % (num_experts - 1))
    return torch.stack([first, second], 1), torch.rand(num_tokens, 2, generator=g)


def _experts_call(model, experts, impl: str, x, ids, weights):
    """Output and gradients (input, routing weights, every experts parameter) of one experts call."""
    model.set_experts_implementation(impl)
    x, weights = x.detach().clone().requires_grad_(), weights.detach().clone().requires_grad_()
    experts.zero_grad(set_to_none=True)
    with GmmCalls() as counter:
        out = experts(x, ids, weights)
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
    grads = {"x": x.grad, "weights": weights.grad}
    grads.update({n: p.grad for n, p in experts.named_parameters() if p.grad is not None})
    return out.detach(), grads, counter.calls["moe_gmm::grouped_matmul"]


def _check_exact(model, experts, x, ids, weights) -> None:
    out_ref, grads_ref, calls_ref = _experts_call(model, experts, "eager", x, ids, weights)
    out, grads, calls = _experts_call(model, experts, "moe_gmm", x, ids, weights)
    assert calls_ref == 0 and calls == 2, (calls_ref, calls)  # each run is the implementation it claims
    assert_rel_close(out, out_ref, LIMIT, "output vs eager")
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        assert_rel_close(g, grads_ref[n], LIMIT, f"d {n} vs eager")
    model.double()  # the float64 truth: the module's own eager code
    out64, grads64, _ = _experts_call(model, experts, "eager", x.double(), ids, weights.double())
    model.float()
    assert_rel_close(out.double(), out64, LIMIT, "output vs float64")
    for n, g in grads.items():
        assert_rel_close(g.double(), grads64[n], LIMIT, f"d {n} vs float64")


@pytest.mark.parametrize("name", list(CASES))
def test_rule_answers_and_reasons(name):
    _, experts = _model_and_experts(name)
    support = expert_mlp_support(experts)
    assert support.mlp == CASES[name][1], support
    assert support.ok == (support.mlp is not None) and support.reason
    if name in REFUSAL:
        assert REFUSAL[name] in support.reason and type(experts).__name__ in support.reason
    if name in ("deepseek_v4", "bailing_hybrid", "minimax_m3_vl"):
        assert f"{type(experts).__name__}._apply_gate" in support.reason
    if name == "muse_spark":
        assert "post_expert_norm" in support.reason


@pytest.mark.parametrize("name", list(CASES))
def test_every_case_runs_exactly_on_moe_gmm(name):
    """Accepted or refused, ``experts_implementation="moe_gmm"`` computes the module's math."""
    model, experts = _model_and_experts(name)
    ids, weights = _routing(13, experts.num_experts, seed=1)
    x = torch.randn(13, _width(experts), generator=torch.Generator().manual_seed(2))
    _check_exact(model, experts, x, ids, weights)


@pytest.mark.parametrize("name", ["deepseek_v4", "bailing_hybrid", "minimax_m3_vl"])
def test_clamps_bite_so_plain_swiglu_would_be_wrong(name):
    """The clamped gates are active at these limits: plain SwiGLU (what EP ran before) differs."""
    model, experts = _model_and_experts(name)
    ids, weights = _routing(13, experts.num_experts, seed=1)
    x = torch.randn(13, _width(experts), generator=torch.Generator().manual_seed(2))
    model.set_experts_implementation("eager")
    with torch.no_grad():
        eager = experts(x, ids, weights)
        permuted, row_map, counts = permute(x, ids, experts.num_experts)
        gate_up, down = experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2)
        plain = unpermute(expert_mlp(permuted, counts, gate_up, down), row_map, weights)
        ours = unpermute(
            run_expert_mlp(experts, expert_mlp_support(experts), permuted, counts, gate_up, down), row_map, weights
        )
    assert relative_error(plain, eager) > 1e-2
    assert relative_error(ours, eager) < LIMIT


@settings(max_examples=8, deadline=None)
@given(num_tokens=st.integers(1, 24), seed=st.integers(0, 2**16))
def test_clamped_gate_exact_for_random_routing(num_tokens, seed):
    model, experts = _model_and_experts("deepseek_v4")
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts.num_experts, generator=g)[:2] for _ in range(num_tokens)])
    x = torch.randn(num_tokens, _width(experts), generator=g)
    _check_exact(model, experts, x, ids, torch.rand(num_tokens, 2, generator=g))


def test_grouped_experts_and_foreign_modules():
    experts = GroupedExperts(num_experts=4, hidden_size=8, intermediate_size=4)
    assert expert_mlp_support(experts) == Support("swiglu", "moe-gmm's own SwiGLU experts")
    refused = expert_mlp_support(torch.nn.Linear(4, 4))
    assert not refused.ok and "neither GroupedExperts nor a Hugging Face experts module" in refused.reason
    x = torch.zeros(2, 4)
    with pytest.raises(ValueError, match="cannot run on moe-gmm's expert MLP: Linear is neither"):
        run_expert_mlp(torch.nn.Linear(4, 4), refused, x, torch.tensor([2]), torch.zeros(1, 4, 4), torch.zeros(1, 2, 4))


# ---------------------------------------------------------------------------------------------
# Expert parallelism applies the same rule
# ---------------------------------------------------------------------------------------------

EP_PATTERN = "model.layers.{*}.mlp.experts"


def _ep_errors(rank: int, ep: int, name: str, ids: torch.Tensor) -> tuple[list[str], dict[str, float]]:
    """EP (moe_gmm experts, clamped gate) vs the single-process eager model on the concatenated batch."""
    family, limit = FAMILIES[name], {"swiglu_limit": 0.05}
    ref = build(family, "eager", **limit)
    ref_loss = ref(input_ids=ids, labels=ids).loss  # mean over the concatenated batch
    ref_loss.backward()
    ref_params = dict(ref.named_parameters())

    model = build(family, "moe_gmm", state=ref.state_dict(), **limit)
    matched = apply_expert_parallel(model, None, EPPlan(ep, [EP_PATTERN]))
    loss = model(input_ids=ids[rank : rank + 1], labels=ids[rank : rank + 1]).loss
    loss.backward()
    experts = expert_parameter_ids(model)
    for p in model.parameters():  # the same order on every rank: the all-reduces pair up
        if p.grad is None:  # unused here; a zero keeps every rank's all-reduces the same
            p.grad = torch.zeros_like(p)
        if id(p) not in experts:  # each rank holds its tokens' part of a replicated gradient
            torch.distributed.all_reduce(p.grad)
        p.grad /= ep  # each rank's loss is a mean over its equally many tokens
    losses = [torch.zeros(()) for _ in range(ep)]
    torch.distributed.all_gather(losses, loss.detach())
    errs = {"loss": relative_error(torch.stack(losses).mean(), ref_loss.detach())}
    for pname, p in model.named_parameters():
        expected = ref_params[pname].grad
        if expected is None:  # unused parameters got zeros above
            expected = torch.zeros_like(ref_params[pname])
        if p.shape != expected.shape:  # an expert shard: experts [r * E / ep, (r + 1) * E / ep)
            local = expected.shape[0] // ep
            expected = expected[rank * local : (rank + 1) * local]
        errs[pname] = relative_error(p.grad, expected)
    return matched, errs


def _ep_worker(rank: int, ep: int) -> dict:
    register_moe_gmm_experts()
    ids = torch.randint(3, 128, (ep, 12), generator=torch.Generator().manual_seed(5))
    report = {name: _ep_errors(rank, ep, name, ids) for name in ("minimax_m3_vl", "deepseek_v4")}
    refused = {}
    for name, pattern in (("gpt_oss", EP_PATTERN), ("nemotron_h", "model.layers.{*}.mixer.experts")):
        try:
            apply_expert_parallel(build(FAMILIES[name], "moe_gmm"), None, EPPlan(ep, [pattern]))
            refused[name] = "<no error>"
        except ValueError as err:
            refused[name] = str(err)
    return {"families": report, "refused": refused}


@pytest.mark.distributed
def test_expert_parallel_applies_the_rule():
    """Clamped custom gates run exactly under EP; refused modules raise the rule's reason.

    MiniMax-M3's loss and every gradient must match. DeepSeek-V4's loss (off by 4e-4 when EP ran
    plain SwiGLU) and expert gradients must; its hash-routed layer's router and hyper-connection
    scales get gradients that cancel to rounding noise at init, in fp32 eager too.
    """
    reports = run_ranks(_ep_worker, 2, timeout_s=200)
    for rank, report in enumerate(reports):
        for name, (matched, errs) in report["families"].items():
            assert matched == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"], (name, matched)
            checked = (
                errs if name == "minimax_m3_vl" else {k: e for k, e in errs.items() if k == "loss" or ".experts." in k}
            )
            assert len(checked) >= 5, (name, sorted(checked))
            worst = max(checked, key=checked.get)
            assert checked[worst] < LIMIT, f"rank {rank} {name} {worst}: {checked[worst]:.2e}"
        for name, reason in REFUSAL.items():
            assert "cannot run on moe-gmm's expert MLP" in report["refused"][name], report["refused"][name]
            assert reason in report["refused"][name]
