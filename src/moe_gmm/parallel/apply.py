"""``apply_expert_parallel``: shard matched experts modules over an EP group and route through a dispatcher.

Also the training-side glue: :func:`sync_gradients` keeps replicated parameters identical across
the group and scales expert gradients, so that EP training equals single-process training on the
concatenated batch.
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.tensor import DTensor

from moe_gmm.integrations.support import expert_mlp_support, run_expert_mlp
from moe_gmm.ops.weight_layout import pad_rows, row_padding
from moe_gmm.parallel.comm import collective
from moe_gmm.parallel.dispatcher import AllToAllDispatcher, OverlappedAllToAllDispatcher
from moe_gmm.parallel.guards import record_replaced
from moe_gmm.parallel.layout import EXPERT_PARAMS, ExpertShard, experts_layout
from moe_gmm.parallel.plan import EPPlan
from moe_gmm.parallel.verify import verify_same_setup

__all__ = [
    "apply_expert_parallel",
    "expert_parallel_groups",
    "expert_parallel_modules",
    "expert_parameter_ids",
    "sync_gradients",
]


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


def apply_expert_parallel(model: nn.Module, ep_group: dist.ProcessGroup | None, plan: EPPlan) -> list[str]:
    """Shard every experts module matched by ``plan`` along E over ``ep_group``; return their names.

    Rank r keeps the contiguous block of experts ``[r * E / ep, (r + 1) * E / ep)`` as plain
    parameters (so build the optimizer afterwards: an earlier one fails at its first ``step()``,
    see :func:`~moe_gmm.parallel.guards.check_optimizer`) and the module's forward becomes the
    dispatcher path with the same ``(hidden_TH, top_k_index_Tk, top_k_weights_Tk) -> out_TH``
    signature and global expert ids. Every other parameter stays whole (replicated): nothing here
    keeps the replicas equal, so the training loop must reduce their gradients over the group
    (:func:`sync_gradients`; ``replicate_moe`` / ``parallelize_moe`` do it themselves), and
    :func:`~moe_gmm.parallel.guards.verify_replicas` proves it did (call it every N steps).

    Collective: every rank of ``ep_group`` must call it. Problems are gathered from all ranks and
    raised as one ``ValueError`` on every rank (never a hang): a pattern matching nothing or two
    patterns on one module, a matched module that is not a routed-experts module or whose math
    our expert MLP cannot run (:func:`~moe_gmm.integrations.support.expert_mlp_support`), E not divisible
    by the group size, ``plan.expert_parallel_size`` != group size, and models or plans that differ
    across ranks (E, top_k, sizes, dtype, plan, or any replicated tensor's bits: see
    :func:`~moe_gmm.parallel.verify.verify_same_setup`), naming the first difference and the ranks.
    """
    if not isinstance(plan, EPPlan):
        raise TypeError(f"plan must be an EPPlan, got {type(plan).__name__}")
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
    verify_same_setup(model, ep_group, plan, matched, what="apply_expert_parallel")

    for name, layout in layouts.items():
        module = modules[name]
        shard = ExpertShard(num_experts=layout.num_experts, ep_rank=ep_rank, ep_size=ep_size, layout=layout)
        lo, hi = shard.first_expert, shard.first_expert + shard.num_local_experts
        for pname in EXPERT_PARAMS:
            full = getattr(module, pname)
            owned = full.detach()[lo:hi]
            pad = row_padding(full)  # a padded layout (GroupedExperts(pad_weight_rows=True)) stays padded
            local = nn.Parameter(pad_rows(owned, pad) if pad else owned.clone(), requires_grad=full.requires_grad)
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


def _all_reduce_flat(params: list[nn.Parameter], group: dist.ProcessGroup | None, scale: float) -> None:
    """Sum the gradients of ``params`` over ``group`` (one flat buffer per dtype), then scale them."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        if p.grad is None:  # a zero gradient, so every rank reduces a buffer of the same layout
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for dtype in sorted(by_dtype, key=str):  # the same order on every rank
        grads = [p.grad for p in by_dtype[dtype]]
        flat = _flatten_dense_tensors(grads)
        with collective("gradient all-reduce", group):
            dist.all_reduce(flat, group=group)
        if scale != 1.0:
            flat.mul_(scale)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)


def sync_gradients(
    model: nn.Module,
    ep_group: dist.ProcessGroup | None,
    *,
    average: bool = True,
    dense_group: dist.ProcessGroup | None = None,
    expert_dp_group: dist.ProcessGroup | None = None,
) -> None:
    """Make EP gradients equal those of single-process training on the concatenated batch.

    Call after ``backward()`` and before the optimizer step, on every rank.

    - Replicated parameters (router, shared expert, attention, embeddings, ...) saw only this
      rank's tokens: their gradients are all-reduced over ``dense_group`` (``None``: the EP group;
      ``dist.group.WORLD`` with data parallelism across EP groups), one flat buffer per dtype.
    - Expert parameters already hold the sum over the EP group's tokens routed to them (the
      combine's backward brought those gradients to the owner). With data parallelism across EP
      groups (see :func:`expert_parallel_groups`) the same shard lives on one rank of every EP
      group, and ``expert_dp_group`` (those ranks) sums them; without it they are not reduced.

    ``average=True`` is for a loss that is a mean over each rank's tokens (equal token counts on
    every rank): the concatenated-batch loss is then the mean of the ranks' losses, so every
    gradient is divided by the number of ranks that hold data (the size of ``dense_group``).
    ``average=False`` is for a summed loss: sums only.
    """
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise TypeError(
            "model holds DTensor parameters (FSDP or parallelize_moe / replicate_moe): their gradients are "
            "already reduced in backward; scale the loss with normalize_loss instead of calling sync_gradients"
        )
    dense_group = ep_group if dense_group is None else dense_group
    scale = 1.0 / dist.get_world_size(dense_group) if average else 1.0
    experts = expert_parameter_ids(model)
    _all_reduce_flat([p for p in model.parameters() if p.requires_grad and id(p) not in experts], dense_group, scale)
    expert_params = [p for p in model.parameters() if p.requires_grad and id(p) in experts]
    if expert_dp_group is not None and dist.get_world_size(expert_dp_group) > 1:
        _all_reduce_flat(expert_params, expert_dp_group, scale)
    elif scale != 1.0:
        for p in expert_params:
            if p.grad is not None:
                p.grad.mul_(scale)


def expert_parallel_groups(ep_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """``(ep_group, expert_dp_group)`` of this rank for ``world = dp * ep`` ranks, EP innermost.

    EP groups are consecutive ranks ``[d * ep, (d + 1) * ep)`` (on one node when ep <= GPUs per
    node, where the all-to-all is cheapest); expert-DP groups are the ranks holding the same expert
    shard, ``{d * ep + i for d in range(dp)}``. Collective: every rank creates every group in the
    same order. Train with
    ``sync_gradients(model, ep_group, dense_group=dist.group.WORLD, expert_dp_group=expert_dp_group)``.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        raise ValueError(f"ep_size must be a positive divisor of the world size {world}, got {ep_size!r}")
    dp = world // ep_size
    mine: dict[str, dist.ProcessGroup] = {}
    for d in range(dp):
        group = dist.new_group([d * ep_size + i for i in range(ep_size)])
        if rank // ep_size == d:
            mine["ep"] = group
    for i in range(ep_size):
        group = dist.new_group([d * ep_size + i for d in range(dp)])
        if rank % ep_size == i:
            mine["dp"] = group
    return mine["ep"], mine["dp"]
