"""``apply_expert_parallel`` on a stack of ``SparseMoeBlock``s: setup errors, equality with the
single-process model (outputs, input / router / shared-expert / expert grads), and three training
steps, on real gloo ranks. One spawn per EP size holds all of it.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_gmm.parallel import EPPlan, apply_expert_parallel, expert_parallel_modules, replicate_moe
from moe_gmm.parallel.launch import run_ranks
from moe_gmm.testing import relative_error
from tests.helpers.ep_models import PATTERN
from tests.helpers.ep_models import tiny_moe_stack as _model
from tests.helpers.mesh_runs import mesh

pytestmark = pytest.mark.distributed

LIMIT = 1e-5


def _setup_errors(rank: int, ep: int) -> dict[str, str]:
    """Each bad setup must raise ValueError on every rank at once (the next case would hang otherwise)."""
    cases = {
        "shared_expert": lambda: (_model(), EPPlan(ep, ["layers.{*}.mlp.shared_expert"])),
        "dense_mlp": lambda: (_model(), EPPlan(ep, ["dense"])),
        "no_match": lambda: (_model(), EPPlan(ep, ["model.layers.{*}.mlp.experts"])),
        "two_patterns": lambda: (_model(), EPPlan(ep, [PATTERN, "layers.{0-0}.mlp.experts"])),
        "ep_size": lambda: (_model(), EPPlan(ep * 2, [PATTERN])),
        "indivisible": lambda: (_model(num_experts=ep + 1, top_k=1), EPPlan(ep, [PATTERN])),
        # rank 1 builds a model with twice the experts: caught at setup, on every rank
        "ranks_disagree_E": lambda: (_model(num_experts=8 * (1 + (rank == 1))), EPPlan(ep, [PATTERN])),
        "ranks_disagree_plan": lambda: (_model(), EPPlan(ep, [PATTERN], "alltoall_overlap" if rank else "alltoall")),
    }
    errors = {}
    for name, build in cases.items():
        model, plan = build()
        try:
            apply_expert_parallel(model, None, plan)
            errors[name] = "<no error>"
        except ValueError as err:
            errors[name] = str(err)
    model = _model()
    apply_expert_parallel(model, None, EPPlan(ep, [PATTERN]))
    try:
        apply_expert_parallel(model, None, EPPlan(ep, [PATTERN]))
        errors["twice"] = "<no error>"
    except ValueError as err:
        errors["twice"] = str(err)
    return errors


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _equality(rank: int, ep: int, dispatcher: str) -> dict[str, float]:
    """Summed loss: expert grads (the dispatcher's backward) and summed replicated grads equal one process's."""
    ref_model = _model(seed=1)
    g = torch.Generator().manual_seed(2)
    tokens = [6 + r for r in range(ep)]  # uneven batches
    x_all = torch.randn(sum(tokens), 16, generator=g)
    w_all = torch.randn(sum(tokens), 16, generator=g)
    x_ref = x_all.clone().requires_grad_(True)
    out_ref = ref_model(x_ref)
    (out_ref * w_all).sum().backward()
    ref = _grads(ref_model)

    model = _model(seed=1)
    apply_expert_parallel(model, None, EPPlan(ep, [PATTERN], dispatcher))
    lo, hi = sum(tokens[:rank]), sum(tokens[: rank + 1])
    x = x_all[lo:hi].clone().requires_grad_(True)
    out = model(x)
    (out * w_all[lo:hi]).sum().backward()
    sharded = {f"{n}.{p}" for n in expert_parallel_modules(model) for p in ("gate_up_proj", "down_proj")}
    for name, p in model.named_parameters():
        if name not in sharded:  # each rank holds its tokens' part of a replicated gradient
            dist.all_reduce(p.grad)
    errs = {"out": relative_error(out, out_ref[lo:hi]), "x.grad": relative_error(x.grad, x_ref.grad[lo:hi])}
    for name, p in model.named_parameters():
        expected = ref[name]
        if name in sharded:
            local = expected.shape[0] // ep
            assert p.shape[0] == local, (name, p.shape)
            expected = expected[rank * local : (rank + 1) * local]
        errs[name] = relative_error(p.grad, expected)
    return errs


def _training(rank: int, world: int, dispatcher: str, ep: int | None = None, steps: int = 3) -> dict[str, float]:
    """Mean loss, SGD with momentum: 3 EP steps == 3 single-process steps on the concatenated batches.

    ``ep < world`` runs data parallelism across EP groups (``world / ep`` replicas of each shard), on
    a ``(world / ep, ep)`` mesh under ``replicate_moe`` (DDP for the dense part, plain expert shards).
    """
    ep = ep or world
    g = torch.Generator().manual_seed(3)
    per_rank = 8
    batches = [
        (torch.randn(world * per_rank, 16, generator=g), torch.randn(world * per_rank, 16, generator=g))
        for _ in range(steps)
    ]
    ref_model = _model(seed=4)
    model = copy.deepcopy(ref_model)
    par = replicate_moe(model, mesh(world // ep, ep), EPPlan(ep, [PATTERN], dispatcher))
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    for x, y in batches:
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref_model(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        par.average_loss(nn.functional.mse_loss(par.model(x[rows]), y[rows])).backward()
        opt.step()
    sharded = {f"{n}.{p}" for n in expert_parallel_modules(model) for p in ("gate_up_proj", "down_proj")}
    ref = dict(ref_model.named_parameters())
    init = dict(_model(seed=4).named_parameters())
    # The comparison means something only if training moved every parameter.
    errs = {"min_move": min(relative_error(ref[n], init[n]) for n in ref)}
    ep_rank = rank % ep
    for name, p in model.named_parameters():
        expected = ref[name].detach()
        if name in sharded:
            local = expected.shape[0] // ep
            expected = expected[ep_rank * local : (ep_rank + 1) * local]
        errs[name] = relative_error(p.detach(), expected)
    return errs


def _model_worker(rank: int, ep: int, train: bool) -> dict:
    torch.use_deterministic_algorithms(True)
    report = {
        "setup_errors": _setup_errors(rank, ep),
        "equal_alltoall": _equality(rank, ep, "alltoall"),
        "equal_overlap": _equality(rank, ep, "alltoall_overlap"),
    }
    if train:
        report["train_alltoall"] = _training(rank, ep, "alltoall")
        report["train_overlap"] = _training(rank, ep, "alltoall_overlap")
    else:  # 2 data-parallel replicas of an EP-2 group
        report["train_dp2_ep2"] = _training(rank, ep, "alltoall", ep=2)
    return report


EXPECTED_SETUP_ERRORS = {
    "shared_expert": "not a routed-experts module",
    "dense_mlp": "not a routed-experts module",
    "no_match": "matches no module",
    "two_patterns": "is matched by both",
    "ep_size": "expert_parallel_size=",
    "indivisible": "is not divisible by the EP size",
    "ranks_disagree_E": "ranks disagree",
    "ranks_disagree_plan": "ranks disagree",
    "twice": "already expert-parallel",
}


# Training steps at EP 2; the 4-rank spawn trains 2 data-parallel replicas of EP 2 instead.
@pytest.mark.parametrize(("ep", "train"), [(2, True), (4, False)])
def test_expert_parallel_model(ep, train):
    for rank, report in enumerate(run_ranks(_model_worker, ep, train, timeout_s=150)):
        for case, needle in EXPECTED_SETUP_ERRORS.items():
            assert needle in report["setup_errors"][case], f"rank {rank} {case}: {report['setup_errors'][case]}"
        sections = ("equal_alltoall", "equal_overlap") + (
            ("train_alltoall", "train_overlap") if train else ("train_dp2_ep2",)
        )
        for section in sections:
            if section.startswith("train"):
                assert report[section].pop("min_move") > 1e-4, "training did not move some parameter"
            for name, err in report[section].items():
                assert err < LIMIT, f"EP={ep} rank {rank} {section} {name}: relative error {err:.2e}"
        # the router and shared expert are checked too, not only the experts
        assert any(".gate.weight" in n for n in report["equal_alltoall"])
        assert any("shared_expert" in n for n in report["equal_overlap"])
