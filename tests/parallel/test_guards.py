"""EP guards on real gloo ranks: an optimizer over replaced parameters, replicas that drift apart."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from torch import nn

from moe_gmm.parallel import EPPlan, apply_expert_parallel, parallelize_moe, replicate_moe
from moe_gmm.parallel.guards import _REPLACED, check_optimizer, record_replaced, verify_replicas
from moe_gmm.parallel.launch import run_ranks
from tests.helpers.ep_models import PATTERN, tiny_moe_stack
from tests.helpers.mesh_runs import error_of as _error
from tests.helpers.mesh_runs import mesh

EXPERT_NAMES = [f"layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]


def _train_step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    """One step on this rank's own rows, with no gradient reduction of its own."""
    x = torch.randn(6, 16, generator=torch.Generator().manual_seed(rank))
    optimizer.zero_grad()
    model(x).square().mean().backward()
    optimizer.step()


def _worker(rank: int, world: int) -> dict:
    group, plan, out = dist.group.WORLD, EPPlan(world, [PATTERN]), {}

    # A bare apply_expert_parallel: an optimizer from before it, one from after it.
    model = tiny_moe_stack()
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    apply_expert_parallel(model, group, plan)
    out["stale"] = _error(lambda: check_optimizer(early))
    experts_before = model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    out["stale_step"] = _error(lambda: _train_step(model, early, rank))
    out["late_fresh_replicas"] = _error(lambda: verify_replicas(model, group))
    late = torch.optim.SGD(model.parameters(), lr=0.1)
    out["late"] = _error(lambda: check_optimizer(late, model))
    _train_step(model, late, rank)  # each rank's own rows, replicated gradients never reduced
    out["experts_moved"] = not torch.equal(model.layers[0].mlp.experts.gate_up_proj, experts_before)
    out["drift"] = _error(lambda: verify_replicas(model, group, what="step 1"))
    dense_only = torch.optim.SGD([p for n, p in model.named_parameters() if ".experts." not in n], lr=0.1)
    out["dense_only"] = _error(lambda: check_optimizer(dense_only, model))

    # replicate_moe keeps the replicas equal; its handle builds the optimizer on the new parameters.
    model = tiny_moe_stack()
    early = torch.optim.AdamW(model.parameters())
    par = replicate_moe(model, mesh(1, world), plan)
    out["ddp_stale"] = _error(lambda: check_optimizer(early))
    opt = par.optimizer(torch.optim.AdamW, lr=1e-2)
    out["ddp_handle"] = _error(lambda: check_optimizer(opt, par.module))
    for _ in range(2):
        _train_step(par.model, opt, rank)
    out["ddp_replicas"] = _error(lambda: verify_replicas(par.module, par.mesh.data_mesh.get_group()))
    out["ddp_params_are_the_handles"] = [id(p) for p in par.parameters()] == [id(p) for p in model.parameters()]

    # parallelize_moe (FSDP2) replaces every parameter, dense ones included.
    model = tiny_moe_stack()
    count = len(list(model.parameters()))
    early = torch.optim.SGD(model.parameters(), lr=0.1)
    par = parallelize_moe(model, mesh(1, world), plan)
    out["fsdp_stale"] = _error(lambda: check_optimizer(early))
    out["fsdp_count"] = count
    out["fsdp_handle"] = _error(lambda: check_optimizer(par.optimizer(torch.optim.SGD, lr=0.1), par.module))
    out["optimizer_cls"] = _error(lambda: par.optimizer("adamw"))
    return out


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    return run_ranks(_worker, 2, timeout_s=240)


@pytest.mark.distributed
def test_an_optimizer_built_before_sharding_is_refused_by_name_and_at_its_first_step(reports):
    for r in reports:
        assert r["stale"].startswith(
            "ValueError: optimizer holds 4 parameter(s) that expert-parallel sharding replaced, so stepping them "
            "never changes the model: " + ", ".join(f"{n} (replaced by apply_expert_parallel)" for n in EXPERT_NAMES)
        ), r["stale"]
        assert "build the optimizer after sharding" in r["stale"]
        assert r["stale_step"] == r["stale"]  # the global step pre-hook, before anything moved
        assert r["late"] == "<no error>" and r["experts_moved"]
        assert r["dense_only"] == "ValueError: optimizer does not hold 4 trainable parameter(s) of the model: " + (
            ", ".join(EXPERT_NAMES)
        )


@pytest.mark.distributed
def test_mesh_handles_build_the_optimizer_on_the_sharded_parameters(reports):
    for r in reports:
        assert r["ddp_stale"].startswith("ValueError: optimizer holds 4 parameter(s)"), r["ddp_stale"]
        assert r["ddp_handle"] == "<no error>" and r["ddp_params_are_the_handles"]
        # Under FSDP2 every parameter is new: the early optimizer's are all counted, the first 8 named.
        count = r["fsdp_count"]
        assert r["fsdp_stale"].startswith(f"ValueError: optimizer holds {count} parameter(s)"), r["fsdp_stale"]
        assert (
            r["fsdp_stale"].count("(replaced by parallelize_moe)") == 8 and f"and {count - 8} more" in r["fsdp_stale"]
        )
        assert r["fsdp_handle"] == "<no error>"
        assert r["optimizer_cls"] == "TypeError: cls must be a torch.optim.Optimizer subclass, got 'adamw'"


@pytest.mark.distributed
def test_replicas_that_were_never_reduced_are_caught(reports):
    for r in reports:
        assert r["late_fresh_replicas"] == "<no error>"
        drift = r["drift"]
        assert drift.startswith("ValueError: step 1: replicas differ across ranks (shape, dtype, sha256): ")
        # The first replicated parameter: the first layer's router, then the ranks and their checksums.
        assert "layers.0.mlp." in drift and "rank 0 has" in drift and "rank 1 has" in drift, drift
        assert "reduce the replicated gradients over the group every step" in drift
        assert r["ddp_replicas"] == "<no error>"  # DDP reduced them: equal after two steps


def test_check_optimizer_argument_errors():
    with pytest.raises(TypeError, match=r"^optimizer must be a torch.optim.Optimizer, got list$"):
        check_optimizer([nn.Parameter(torch.zeros(1))])
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(TypeError, match=r"^model must be an nn.Module or None, got dict$"):
        check_optimizer(opt, {})
    with pytest.raises(TypeError, match=r"^model must be an nn.Module, got str$"):
        verify_replicas("model")


def test_remembering_a_replaced_parameter_never_keeps_it_alive():
    param = nn.Parameter(torch.zeros(3))
    record_replaced([("w", param)], "a test")
    assert _REPLACED[param] == "w (replaced by a test)"
    size = len(_REPLACED)
    del param
    gc.collect()
    assert len(_REPLACED) == size - 1
