"""``apply_expert_parallel``: shard matched experts modules over an EP group and route through a dispatcher.

The building block of :func:`~moe_gmm.parallel.fsdp.parallelize_moe` and
:func:`~moe_gmm.parallel.ddp.replicate_moe`, which add the gradient reductions on a DeviceMesh.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moe_gmm.integrations.support import expert_mlp_support, run_expert_mlp
from moe_gmm.parallel.comm import collective
from moe_gmm.parallel.dispatcher import AllToAllDispatcher, OverlappedAllToAllDispatcher
from moe_gmm.parallel.guards import record_replaced
from moe_gmm.parallel.layout import EXPERT_PARAMS, ExpertShard, experts_layout
from moe_gmm.parallel.plan import EPPlan
from moe_gmm.parallel.verify import verify_same_setup

__all__ = ["apply_expert_parallel", "expert_parallel_modules", "expert_parameter_ids"]


def _ep_forward(
    self: nn.Module, hidden_TH: torch.Tensor, top_k_index_Tk: torch.Tensor, top_k_weights_Tk: torch.Tensor
) -> torch.Tensor:
    """The experts forward under EP: same signature, global expert ids, local weight shards."""
    layout = self.ep_shard.layout
    gate_up_LH2I, down_LIH = (_local(w) for w in layout.mlp_weights(self))
    if hasattr(self, "last_tokens_per_expert"):  # GroupedExperts' routing statistics: this rank's tokens
        self.last_tokens_per_expert = torch.bincount(top_k_index_Tk.detach().flatten(), minlength=layout.num_experts)

    support = expert_mlp_support(self)

    def run_local_experts(x_SH: torch.Tensor, group_list_L: torch.Tensor) -> torch.Tensor:
        return run_expert_mlp(
            self, support, x_SH, group_list_L, gate_up_LH2I, down_LIH, fused=layout.fused, backend=layout.backend
        )  # counts from bincount: non-negative and summing to S

    return self.ep_dispatcher(hidden_TH, top_k_index_Tk, top_k_weights_Tk, run_local_experts)


def _local(weight: torch.Tensor) -> torch.Tensor:
    """This rank's experts of a weight that :func:`~moe_gmm.parallel.fsdp.parallelize_moe` made a DTensor."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


def apply_expert_parallel(
    model: nn.Module, ep_group: dist.ProcessGroup | None, plan: EPPlan, *, verify: bool = True
) -> list[str]:
    """Shard every experts module matched by ``plan`` along E over ``ep_group``; return their names.

    Rank r keeps the contiguous block of experts ``[r * E / ep, (r + 1) * E / ep)`` as plain
    parameters (so build the optimizer afterwards: an earlier one fails at its first ``step()``,
    see :func:`~moe_gmm.parallel.guards.check_optimizer`) and the module's forward becomes the
    dispatcher path with the same ``(hidden_TH, top_k_index_Tk, top_k_weights_Tk) -> out_TH``
    signature and global expert ids. Every other parameter stays whole (replicated): nothing here
    keeps the replicas equal; ``parallelize_moe`` and ``replicate_moe`` call this and then set up
    the gradient reductions, and :func:`~moe_gmm.parallel.guards.verify_replicas` proves the
    replicas stayed equal (call it every N steps).

    Collective: every rank of ``ep_group`` must call it. Problems are gathered from all ranks and
    raised as one ``ValueError`` on every rank (never a hang): a pattern matching nothing or two
    patterns on one module, a matched module that is not a routed-experts module or whose math
    our expert MLP cannot run (:func:`~moe_gmm.integrations.support.expert_mlp_support`), E not divisible
    by the group size, ``plan.expert_parallel_size`` != group size, and models or plans that differ
    across ranks (E, top_k, sizes, dtype, plan, or the bytes of any tensor, expert weights whole: see
    :func:`~moe_gmm.parallel.verify.verify_same_setup`), naming the first difference and the ranks.
    ``verify=False`` skips that last comparison: for callers that already made it over a group
    holding ``ep_group`` (``parallelize_moe`` and ``replicate_moe`` compare the whole mesh).
    """
    if not isinstance(plan, EPPlan):
        raise TypeError(f"plan must be an EPPlan, got {type(plan).__name__}")
    if not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool, got {type(verify).__name__}")
    ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    modules = dict(model.named_modules())
    problems: list[str] = []
    matched: list[str] = []
    if plan.expert_parallel_size != ep_size:
        problems.append(
            f"parallel.expert_parallel_size={plan.expert_parallel_size} but the EP process group has {ep_size} ranks"
        )
    try:
        matched = plan.match(modules)
    except ValueError as err:
        problems.append(str(err))
    layouts = {}
    for name in matched:
        module = modules[name]
        if getattr(module, "ep_shard", None) is not None:
            problems.append(f"module {name!r} is already expert-parallel")
            continue
        layout, why = experts_layout(module)
        support = expert_mlp_support(module)
        if layout is None and not hasattr(module, "is_transposed"):
            problems.append(
                f"parallel.ep_plan.apply_modules matched {name!r}, which is not a routed-experts module: {why}"
            )
        elif not support.ok:  # an experts module whose math our expert MLP cannot run
            problems.append(f"{name!r} cannot run on moe-gmm's expert MLP: {support.reason}")
        elif layout is None:
            problems.append(
                f"parallel.ep_plan.apply_modules matched {name!r}, which is not a routed-experts module: {why}"
            )
        elif layout.num_experts % ep_size:
            problems.append(f"{name!r}: num_experts={layout.num_experts} is not divisible by the EP size {ep_size}")
        else:
            layouts[name] = layout

    # One exchange at setup: every rank learns every rank's problems and model description, so all
    # raise the same error together instead of some waiting for the others until a timeout.
    everyone: list = [None] * ep_size
    with collective("setup check", ep_group):
        dist.all_gather_object(everyone, problems, group=ep_group)
    errors = [f"rank {r}: {p}" for r, probs in enumerate(everyone) for p in probs]
    if errors:
        raise ValueError("apply_expert_parallel: " + "; ".join(errors))
    if verify:
        verify_same_setup(model, ep_group, plan, matched, what="apply_expert_parallel")

    for name, layout in layouts.items():
        module = modules[name]
        shard = ExpertShard(num_experts=layout.num_experts, ep_rank=ep_rank, ep_size=ep_size, layout=layout)
        lo, hi = shard.first_expert, shard.first_expert + shard.num_local_experts
        for pname in EXPERT_PARAMS:
            full = getattr(module, pname)
            owned = full.detach()[lo:hi]
            local = nn.Parameter(owned.clone(), requires_grad=full.requires_grad)
            setattr(module, pname, local)
            record_replaced([(f"{name}.{pname}", full)], "apply_expert_parallel")
        # Experts modules get their ids from their block's top-k over E logits, so the range check
        # (a host sync per layer on an accelerator) is skipped unless the module asks for it.
        validate = bool(getattr(module, "validate_routing", False))
        if plan.dispatcher == "alltoall_overlap":
            dispatcher = OverlappedAllToAllDispatcher(
                layout.num_experts, ep_group, num_chunks=plan.num_chunks, validate_routing=validate
            )
        else:
            dispatcher = AllToAllDispatcher(layout.num_experts, ep_group, validate_routing=validate)
        module.ep_shard = shard
        module.ep_dispatcher = dispatcher
        # An instance attribute wins over the class's forward (also over Hugging Face's
        # experts-implementation switch), and parameter names stay unchanged.
        module.forward = types.MethodType(_ep_forward, module)
    return matched


def expert_parallel_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The sharded experts modules of ``model`` by name."""
    return {n: m for n, m in model.named_modules() if getattr(m, "ep_shard", None) is not None}


def expert_parameter_ids(model: nn.Module) -> set[int]:
    """``id()`` of every sharded expert parameter of ``model``."""
    return {id(getattr(m, p)) for m in expert_parallel_modules(model).values() for p in EXPERT_PARAMS}
