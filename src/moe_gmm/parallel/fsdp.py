"""``parallelize_moe``: expert parallelism on a DeviceMesh composed with FSDP2 (``fully_shard``).

The layout (the one torchtitan uses): one mesh with an ``ep`` dim and data dims (``dp``);

- matched experts modules are sharded along E over ``ep`` as DTensor ``Shard(0)`` parameters (their
  forward runs the dispatcher on the local shards, over ``mesh["ep"]``'s process group), then
  ``fully_shard`` over the data dims (the ranks holding the same experts);
- every decoder layer, then the root, ``fully_shard`` over all ranks of the mesh (every rank holds
  different tokens, so dense gradients are reduced over all of them; over ``dp`` alone the EP
  ranks would diverge).

Every FSDP module reduces by plain sum (divide factor 1.0, sums forced): gloo has no
``PREMUL_SUM``, torch 2.13 divides twice on a size-1 shard group with a divide factor, and the
expert and dense reductions cover different rank counts. The loss carries the scaling instead
(:meth:`~moe_gmm.parallel.mesh.ParallelizedMoe.normalize_loss`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from moe_gmm.parallel.apply import apply_expert_parallel
from moe_gmm.parallel.guards import record_replaced
from moe_gmm.parallel.layout import EXPERT_PARAMS
from moe_gmm.parallel.mesh import MoeMesh, ParallelizedMoe
from moe_gmm.parallel.plan import EPPlan, match_modules
from moe_gmm.parallel.verify import match_and_verify

__all__ = ["decoder_layers", "parallelize_moe"]


def decoder_layers(model: nn.Module, experts: Sequence[str], patterns: Sequence[str] | None = None) -> list[str]:
    """Names of the modules each wrapped by its own ``fully_shard`` (the decoder layers).

    ``patterns`` (the ``apply_modules`` pattern language) names them; by default they are the
    children of the ``nn.ModuleList`` that holds the first experts module (``model.layers``); a
    model without one gets no per-layer wrapping (the root then gathers all its dense parameters).
    """
    modules = dict(model.named_modules())
    if patterns is not None:
        if isinstance(patterns, str):
            raise TypeError(f"layers must be a list of patterns, got the single string {patterns!r}")
        names = match_modules(modules, patterns, experts=False)
    else:
        names = []
        for expert in experts[:1]:
            parts = expert.split(".")
            for i in range(len(parts) - 1, 0, -1):
                parent = ".".join(parts[: i - 1])
                if isinstance(modules.get(parent), nn.ModuleList):
                    names = [f"{parent}.{n}" if parent else n for n, _ in modules[parent].named_children()]
                    break
    for name in names:
        module = modules[name]
        if name in experts:
            raise ValueError(f"layers: {name!r} is an experts module; name the decoder layers that hold them")
        if type(module).forward is nn.Module.forward or isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            raise ValueError(
                f"layers: {name!r} is a {type(module).__name__} without its own forward; FSDP gathers a module's "
                "parameters when it is called, so name modules that are called (the decoder layers)"
            )
    return names


def _shard_experts_as_dtensor(model: nn.Module, experts: list[str], moe_mesh: MoeMesh) -> None:
    """Turn each rank's plain expert shard into a ``Shard(0)`` DTensor of the global ``[E, ., .]`` parameter."""
    modules = dict(model.named_modules())
    ep_mesh = moe_mesh.ep_mesh
    for name in experts:
        module = modules[name]
        for pname in EXPERT_PARAMS:
            local = getattr(module, pname)
            data = local.detach().contiguous()  # FSDP owns the storage now: its own contiguous layout
            global_shape = torch.Size((module.ep_shard.num_experts, *data.shape[1:]))
            stride = torch.empty(global_shape, device="meta").stride()
            tensor = DTensor.from_local(data, ep_mesh, [Shard(0)], run_check=False, shape=global_shape, stride=stride)
            setattr(module, pname, nn.Parameter(tensor, requires_grad=local.requires_grad))


def _sum_reductions(module: FSDPModule) -> None:
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def parallelize_moe(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: EPPlan,
    *,
    ep_dim: str = "ep",
    layers: Sequence[str] | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool = True,
) -> ParallelizedMoe:
    """Shard ``model`` for training on ``mesh``: experts over ``ep_dim`` and FSDP2 everywhere.

    Args:
        model: the whole model, identical on every rank (checked before sharding: config and the
            sha256 of every tensor, each expert weight whole).
        mesh: a DeviceMesh with named dims; ``ep_dim`` is expert parallel, the others are data dims.
        plan: which experts modules to shard; ``plan.expert_parallel_size`` must equal the ep size.
        layers: patterns naming the modules wrapped by ``fully_shard`` one by one (default: the
            children of the ``nn.ModuleList`` holding the experts, i.e. the decoder layers).
        mp_policy, reshard_after_forward: passed to every ``fully_shard``.

    Returns a :class:`~moe_gmm.parallel.mesh.ParallelizedMoe`; ``result.model is model``. Then, on
    every rank: build the optimizer from ``model.parameters()`` (new objects), and backpropagate
    ``result.normalize_loss(loss_sum, num_tokens)`` (or ``result.average_loss(mean_loss)`` with
    equal token counts): every gradient reduction is a sum, so the gradients equal single-process
    training on the batch concatenated over all ranks. Clip with ``result.clip_grad_norm_``.

    Collective over the whole mesh. Raises ``ValueError`` on every rank together for a bad plan,
    a model that differs between ranks, or a mesh without the named dims.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(plan, EPPlan):
        raise TypeError(f"plan must be an EPPlan, got {type(plan).__name__}")
    if not isinstance(reshard_after_forward, bool):
        raise TypeError(f"reshard_after_forward must be a bool, got {type(reshard_after_forward).__name__}")
    moe_mesh = MoeMesh(mesh, ep_dim)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("model already holds DTensor parameters: parallelize_moe takes a plain (unsharded) model")
    ep_size = moe_mesh.ep_mesh.size()
    if plan.expert_parallel_size != ep_size:
        raise ValueError(
            f"plan.expert_parallel_size must equal the size of mesh[{ep_dim!r}] = {ep_size}, "
            f"got {plan.expert_parallel_size}"
        )
    data_mesh = moe_mesh.data_mesh
    before = list(model.named_parameters())
    # The whole mesh must start from one model, experts included: replicas that differ would never be
    # reconciled, and each rank's expert shard comes from its own copy.
    experts = match_and_verify(model, data_mesh.get_group(), plan, what="parallelize_moe")
    layer_names = decoder_layers(model, experts, layers)
    apply_expert_parallel(model, moe_mesh.ep_mesh.get_group(), plan, verify=False)  # verified above
    _shard_experts_as_dtensor(model, experts, moe_mesh)

    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    modules = dict(model.named_modules())
    expert_dp = moe_mesh.expert_dp_mesh
    for name in experts:  # innermost first: each fully_shard takes the parameters no inner one holds
        _sum_reductions(fully_shard(modules[name], mesh=expert_dp, **kwargs))
    for name in layer_names:
        _sum_reductions(fully_shard(modules[name], mesh=data_mesh, **kwargs))
    _sum_reductions(fully_shard(model, mesh=data_mesh, **kwargs))
    now = {id(p) for p in model.parameters()}
    record_replaced([(n, p) for n, p in before if id(p) not in now], "parallelize_moe")
    return ParallelizedMoe(model=model, module=model, mesh=moe_mesh, experts=experts)
