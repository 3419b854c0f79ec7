"""Mesh-parallel training vs one process, run inside ``run_ranks`` ranks (one spawn per world size).

Each run trains the same model twice on every rank: once in one process on the batch concatenated
over all ranks (the reference), once parallelized on the mesh with this rank's share, and reports
relative errors of gradients (after step 1), clipped gradients and parameters (after the last
step), plus the sha256 of every full parameter so the test can compare replicas across
ranks. The tests assert; these functions only measure.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from moe_gmm.checksum import tensor_digest
from moe_gmm.parallel import EPPlan, apply_expert_parallel
from moe_gmm.parallel.ddp import replicate_moe
from moe_gmm.parallel.fsdp import parallelize_moe
from moe_gmm.parallel.mesh import ParallelizedMoe
from moe_gmm.testing import relative_error
from tests.helpers.ep_models import PATTERN, tiny_moe_stack

HF_PATTERN = "model.layers.{*}.mlp.experts"
STACK_EXPERTS = ["layers.0.mlp.experts", "layers.1.mlp.experts"]
HF_EXPERTS = ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
LIMIT = 1e-5
STEPS = 3
LR = 1e-2


def qwen3_moe(seed: int = 0, **overrides) -> nn.Module:
    """A tiny random Qwen3-MoE causal LM running the moe_gmm experts (2 layers, E=8, top-2)."""
    import transformers

    from moe_gmm.integrations.transformers import register_moe_gmm_experts

    register_moe_gmm_experts()
    kwargs = {
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 16,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "experts_implementation": "moe_gmm",
    } | overrides  # fmt: skip
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kwargs)).float()


def mesh(dp: int, ep: int):
    return init_device_mesh("cpu", (dp, ep), mesh_dim_names=("dp", "ep"))


# --------------------------------------------------------------------------------------------
# The two models' batches and losses. ``share`` is None for the reference (whole batch).
# --------------------------------------------------------------------------------------------


def stack_batches(world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Uneven rows per rank (5 + r), so the loss normalisation by the global count is exercised."""
    g = torch.Generator().manual_seed(11)
    rows = sum(5 + r for r in range(world))
    return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 16, generator=g)) for _ in range(STEPS)]


def stack_loss(model: nn.Module, batch, share: tuple[int, ParallelizedMoe] | None) -> torch.Tensor:
    x, y = batch
    if share is None:
        return nn.functional.mse_loss(model(x), y, reduction="sum") / y.numel()
    rank, par = share
    lo = sum(5 + r for r in range(rank))
    x, y = x[lo : lo + 5 + rank], y[lo : lo + 5 + rank]
    return par.normalize_loss(nn.functional.mse_loss(model(x), y, reduction="sum"), y.numel())


def hf_batches(world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(12)
    return [torch.randint(0, 64, (world, 8), generator=g) for _ in range(STEPS)]


def hf_loss(model: nn.Module, ids: torch.Tensor, share: tuple[int, ParallelizedMoe] | None) -> torch.Tensor:
    if share is None:  # the mean over all ranks' (equally many) shifted tokens
        return model(input_ids=ids, labels=ids).loss
    rank, par = share
    mine = ids[rank : rank + 1]
    return par.average_loss(model(input_ids=mine, labels=mine).loss)


# --------------------------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------------------------


def _full(par: ParallelizedMoe, name: str, t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank: DTensors gathered, plain expert shards gathered over ep."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    if name.rpartition(".")[0] in par.experts:
        group = par.mesh.ep_mesh.get_group()
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)
    return t


def _compare(par: ParallelizedMoe, ref: nn.Module, what: str) -> dict[str, float]:
    mine = dict(par.module.named_parameters())
    errs = {}
    for name, p in ref.named_parameters():
        ours, theirs = (mine[name].grad, p.grad) if what == "grad" else (mine[name].detach(), p.detach())
        errs[name] = relative_error(_full(par, name, ours), theirs)
    return errs


def _expert_ratio(par: ParallelizedMoe, ref: nn.Module) -> float:
    """max over experts e of | |g_e| / |ref_e| - 1 |; an expert without tokens must get exact zeros (else inf)."""
    mine = dict(par.module.named_parameters())
    worst = 0.0
    for name, p in ref.named_parameters():
        if name.rpartition(".")[0] not in par.experts:
            continue
        full = _full(par, name, mine[name].grad)
        for e in range(p.shape[0]):
            want, got = p.grad[e].norm().item(), full[e].norm().item()
            worst = max(worst, abs(got / want - 1.0) if want else (0.0 if got == 0.0 else math.inf))
    return worst


def train_vs_one_process(
    rank: int,
    build: Callable[[], nn.Module],
    parallelize: Callable[..., ParallelizedMoe],
    device_mesh,
    plan: EPPlan,
    batches: list,
    loss_fn: Callable,
    clip: float | None = None,
) -> dict:
    ref, model = build(), build()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    par = parallelize(model, device_mesh, plan)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)
    opt = torch.optim.AdamW(par.model.parameters(), lr=LR)  # after parallelizing: new parameters
    report: dict = {"experts": list(par.experts)}
    for step, batch in enumerate(batches):
        ref_opt.zero_grad()
        loss_fn(ref, batch, None).backward()
        opt.zero_grad()
        loss_fn(par.model, batch, (rank, par)).backward()
        if step == 0:
            report["grad"] = _compare(par, ref, "grad")
            report["expert_ratio"] = _expert_ratio(par, ref)
        if clip is not None:
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            norm = par.clip_grad_norm_(clip)
            if step == 0:
                report["clip_norm"] = (norm.item(), ref_norm.item())
                report["clipped_grad"] = _compare(par, ref, "grad")
        ref_opt.step()
        opt.step()
    report["param"] = _compare(par, ref, "param")
    report["min_move"] = min(relative_error(p, init[n]) for n, p in ref.named_parameters())
    mine = dict(par.module.named_parameters())
    report["checksums"] = {n: tensor_digest(_full(par, n, mine[n].detach())) for n in init}
    return report


def stack_run(rank: int, world: int, dp: int, ep: int, parallelize=parallelize_moe, clip: float | None = None) -> dict:
    return train_vs_one_process(
        rank, lambda: tiny_moe_stack(seed=3), parallelize, mesh(dp, ep), EPPlan(ep, [PATTERN]),
        stack_batches(world), stack_loss, clip,
    )  # fmt: skip


def hf_run(rank: int, world: int, dp: int, ep: int, parallelize=parallelize_moe) -> dict:
    return train_vs_one_process(
        rank, lambda: qwen3_moe(seed=4), parallelize, mesh(dp, ep), EPPlan(ep, [HF_PATTERN]),
        hf_batches(world), hf_loss,
    )  # fmt: skip


def _setup_errors_2x2(rank: int) -> dict[str, str]:
    """dp = 2 x ep = 2: rank 3 alone holds another expert or a swap; the whole mesh refuses it."""
    plan = EPPlan(2, [PATTERN])
    models = differing_models(rank == 3)
    entries = {"fsdp": parallelize_moe, "ddp": replicate_moe}
    return {
        f"{entry}_{case}": error_of(lambda run=run, build=models[case]: run(build(), mesh(2, 2), plan))
        for entry, run in entries.items()
        for case in ("expert", "expert_swap251", "swap251", "identical")
    }


def four_rank_worker(rank: int, world: int) -> dict:
    """Everything measured on 4 ranks, in one spawn."""
    torch.use_deterministic_algorithms(True)
    return {
        "setup_errors_2x2": _setup_errors_2x2(rank),
        "fsdp_stack_2x2": stack_run(rank, world, 2, 2, clip=0.05),
        "fsdp_stack_1x4": stack_run(rank, world, 1, 4),
        "fsdp_stack_4x1": stack_run(rank, world, 4, 1),
        "fsdp_hf_2x2": hf_run(rank, world, 2, 2),
        "ddp_stack_2x2": stack_run(rank, world, 2, 2, parallelize=replicate_moe, clip=0.05),
    }


def error_of(call: Callable[[], object]) -> str:
    """``'TypeError: message'`` / ``'ValueError: message'`` of ``call``, or ``'<no error>'``."""
    try:
        call()
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "<no error>"


# Two elements this far apart carry the same weight in a position-weighted sum modulo 251: a swap of
# them is what such a checksum cannot see, and what the replica comparison must.
SWAP_DISTANCE = 251


def swapped(t: torch.Tensor, first: int, distance: int = SWAP_DISTANCE) -> None:
    """Swap the flat elements ``first`` and ``first + distance`` of ``t`` in place (no values change)."""
    with torch.no_grad():
        flat = t.view(-1)
        flat[[first, first + distance]] = flat[[first + distance, first]].clone()


def _one_expert_differs(model: nn.Module) -> nn.Module:
    """Expert 5 of the second layer's ``down_proj`` drawn again: the expert rank 1 of ep = 2 owns."""
    with torch.no_grad():
        weight = model.layers[1].mlp.experts.down_proj
        weight[5].copy_(torch.randn(weight[5].shape, generator=torch.Generator().manual_seed(99)))
    return model


def _swap(name: str, first: int) -> Callable[[nn.Module], nn.Module]:
    def edit(model: nn.Module) -> nn.Module:
        swapped(dict(model.named_parameters())[name], first)
        return model

    return edit


def differing_models(odd: bool) -> dict[str, Callable[[], nn.Module]]:
    """Models that differ where ``odd`` is true, one way each; the others build the same model."""
    same = lambda model: model  # noqa: E731
    return {
        "top_k": lambda: tiny_moe_stack(seed=3, top_k=3 if odd else 2),
        "seed": lambda: tiny_moe_stack(seed=4 if odd else 3),
        "dtype": lambda: tiny_moe_stack(seed=3).to(torch.float64 if odd else torch.float32),
        "expert": lambda: (_one_expert_differs if odd else same)(tiny_moe_stack(seed=3)),
        "swap251": lambda: (_swap("dense.0.weight", 2) if odd else same)(tiny_moe_stack(seed=3)),
        "expert_swap251": lambda: (
            _swap("layers.0.mlp.experts.gate_up_proj", 7) if odd else same
        )(tiny_moe_stack(seed=3)),
        "identical": lambda: tiny_moe_stack(seed=3),
    }


def _setup_errors(rank: int) -> dict[str, str]:
    """Models that differ on rank 1, through each entry point; every rank must raise the same error."""
    plan = EPPlan(2, [PATTERN])
    entries = {
        "apply": lambda model: apply_expert_parallel(model, None, plan),
        "fsdp": lambda model: parallelize_moe(model, mesh(1, 2), plan),
        "ddp": lambda model: replicate_moe(model, mesh(1, 2), plan),
    }
    errors = {}
    for entry, run in entries.items():
        for case, build in differing_models(rank == 1).items():
            errors[f"{entry}_{case}"] = error_of(lambda run=run, build=build: run(build()))
    hf_top_k = 3 if rank == 1 else 2
    errors["fsdp_hf_top_k"] = error_of(
        lambda: parallelize_moe(qwen3_moe(num_experts_per_tok=hf_top_k), mesh(1, 2), EPPlan(2, [HF_PATTERN]))
    )
    return errors


def _usage_errors() -> dict[str, str]:
    plan = EPPlan(2, [PATTERN])
    model = tiny_moe_stack(seed=3)
    par = parallelize_moe(tiny_moe_stack(seed=3), mesh(1, 2), plan)
    return {
        "loss_type": error_of(lambda: par.normalize_loss(1.0, 3)),
        "count_shape": error_of(lambda: par.normalize_loss(torch.tensor(1.0), torch.ones(2))),
        "no_ep_dim": error_of(
            lambda: parallelize_moe(model, init_device_mesh("cpu", (2,), mesh_dim_names=("dp",)), plan)
        ),
        "no_data_dim": error_of(
            lambda: parallelize_moe(model, init_device_mesh("cpu", (2,), mesh_dim_names=("ep",)), plan)
        ),
        "plan_size": error_of(lambda: parallelize_moe(model, mesh(1, 2), EPPlan(4, [PATTERN]))),
        "plan_type": error_of(lambda: replicate_moe(model, mesh(1, 2), {"ep": 2})),
        "ddp_group": error_of(lambda: replicate_moe(model, mesh(1, 2), plan, process_group=None)),
        "layers_container": error_of(
            lambda: parallelize_moe(tiny_moe_stack(seed=3), mesh(1, 2), plan, layers=["layers"])
        ),
    }


def _dtensor_op_errors() -> dict[str, str]:
    """A DTensor reaching the op: the error names the fix instead of a group_list length mismatch."""
    from moe_gmm.ops.expert_mlp import expert_mlp
    from moe_gmm.ops.grouped_matmul import grouped_matmul

    ep_mesh = mesh(1, 2)["ep"]
    shard = lambda t: DTensor.from_local(t, ep_mesh, [Shard(0)], run_check=False)
    x = torch.randn(5, 4)
    gate_up, down = shard(torch.randn(2, 4, 6)), shard(torch.randn(2, 3, 4))
    return {
        "grouped_matmul": error_of(lambda: grouped_matmul(x, gate_up, [2, 3])),
        "grouped_matmul_x": error_of(
            lambda: grouped_matmul(DTensor.from_local(x, ep_mesh, [Replicate()]), gate_up.to_local(), [2, 3])
        ),
        "expert_mlp": error_of(lambda: expert_mlp(x, [2, 3], gate_up, down)),
    }


def two_rank_worker(rank: int, world: int) -> dict:
    """Everything measured on 2 ranks, in one spawn."""
    torch.use_deterministic_algorithms(True)
    return {
        "fsdp_stack_1x2": stack_run(rank, world, 1, 2, clip=0.05),
        "fsdp_hf_1x2": hf_run(rank, world, 1, 2),
        "setup_errors": _setup_errors(rank),
        "usage_errors": _usage_errors(),
        "dtensor_op_errors": _dtensor_op_errors(),
        "first_replicated": next(n for n, _ in tiny_moe_stack(seed=3).named_parameters() if ".experts." not in n),
    }


def assert_matches_one_process(reports: list[dict], key: str, experts: list[str]) -> None:
    """The assertions on one run's reports from every rank (the FSDP and DDP tests share them)."""
    for rank, report in enumerate(reports):
        run = report[key]
        assert run["experts"] == experts, (key, run["experts"])
        assert run["min_move"] > 1e-3, f"{key}: training did not move some parameter"
        for section in ("grad", "param"):
            assert len(run[section]) > 10
            for name, err in run[section].items():
                assert err < LIMIT, f"{key} rank {rank} {section} {name}: relative error {err:.2e}"
        # |g_e| / |ref_e| = 1 for every expert e (a reduction factor would show as 0.5 or 2)
        assert run["expert_ratio"] < LIMIT, f"{key} rank {rank}: per-expert gradient ratio off by {run['expert_ratio']}"
        # every rank holds the same full parameters, bit for bit
        assert run["checksums"] == reports[0][key]["checksums"], f"{key}: rank {rank} differs from rank 0"
        assert all(c is not None for c in run["checksums"].values())
