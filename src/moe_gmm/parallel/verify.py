"""Prove, before the first step, that every rank built the same MoE model and the same replicas.

Ranks that disagree on ``top_k`` or start from different replicated weights (another seed) would
otherwise train without a word and drift apart. :func:`verify_same_setup` gathers, in one
exchange, every rank's experts configuration, plan and a bitwise checksum of every replicated
tensor, and raises the same ``ValueError`` on every rank naming the first field or parameter that
differs and the ranks that hold which value.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_gmm.parallel.comm import collective
from moe_gmm.parallel.layout import experts_layout
from moe_gmm.parallel.plan import EPPlan

__all__ = [
    "experts_config",
    "first_difference_across",
    "match_and_verify",
    "tensor_checksum",
    "tensor_records",
    "verify_same_setup",
]

# Integer views by element size: checksums read the bits, so -0.0 vs 0.0 or two NaN payloads differ.
_INT_VIEW = {4: torch.int32, 2: torch.int16, 1: torch.int8}
# Elements per chunk: |int32| * 251 * 2**22 < 2**63, so chunk sums never overflow int64.
_CHUNK = 1 << 22


def tensor_checksum(t: torch.Tensor) -> tuple[int, int] | None:
    """Two integer sums over the tensor's bits (plain and position-weighted); None on the meta device."""
    t = t.detach()
    if hasattr(t, "to_local"):  # a DTensor: this rank's part
        t = t.to_local()
    if t.device.type == "meta":
        return None
    flat = t.contiguous().view(-1)
    if flat.numel() == 0:
        return (0, 0)
    raw = flat.view(torch.uint8)
    size = next(s for s in (4, 2, 1) if raw.numel() % s == 0)
    ints = raw.view(_INT_VIEW[size])
    sums = []
    for start in range(0, ints.numel(), _CHUNK):
        chunk = ints[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start, start + chunk.numel(), device=chunk.device) % 251 + 1
        sums.append(torch.stack([chunk.sum(), (chunk * position).sum()]))
    per_chunk = torch.stack(sums).tolist()  # HOST SYNC: one per tensor, once at setup
    return (sum(s[0] for s in per_chunk), sum(s[1] for s in per_chunk))  # Python ints: no overflow


def _top_k(parent: nn.Module | None) -> int | None:
    """The router's k from the experts module's block (``gate.top_k`` or the block's own attribute)."""
    for owner in (getattr(parent, "gate", None), getattr(parent, "router", None), parent):
        for attr in ("top_k", "num_experts_per_tok"):
            value = getattr(owner, attr, None)
            if isinstance(value, int):
                return value
    return None


def experts_config(model: nn.Module, names: Iterable[str]) -> list[tuple[str, Any]]:
    """``(field, value)`` pairs describing each named experts module: E, top_k, hidden, intermediate, dtype."""
    modules = dict(model.named_modules())
    fields: list[tuple[str, Any]] = []
    for name in names:
        module = modules[name]
        layout, why = experts_layout(module)
        if layout is None:
            fields.append((f"{name} (not a routed-experts module)", why))
            continue
        gate_up = module.gate_up_proj
        hidden, two_i = (gate_up.shape[1], gate_up.shape[2]) if layout.in_out else (gate_up.shape[2], gate_up.shape[1])
        parent = modules.get(name.rpartition(".")[0]) if "." in name else model
        fields += [
            (f"{name}.num_experts", layout.num_experts),
            (f"{name}.top_k", _top_k(parent)),
            (f"{name}.hidden_size", int(hidden)),
            (f"{name}.intermediate_size", int(two_i) // 2),
            (f"{name}.dtype", str(gate_up.dtype)),
            (f"{name}.layout", (type(module).__name__, layout.in_out, layout.fused, layout.backend)),
        ]
    return fields


def _plan_fields(plan: EPPlan) -> list[tuple[str, Any]]:
    return [
        ("plan.expert_parallel_size", plan.expert_parallel_size),
        ("plan.apply_modules", plan.apply_modules),
        ("plan.dispatcher", plan.dispatcher),
        ("plan.num_chunks", plan.num_chunks),
    ]


def _first_difference(records: list[list[tuple[str, Any]]]) -> str | None:
    """``"<field>: rank 0 has X; ranks 1, 3 have Y"`` for the first field not equal on every rank."""
    longest = max(len(r) for r in records)
    for i in range(longest):
        entries = [r[i] if i < len(r) else ("<missing>", None) for r in records]
        if all(e == entries[0] for e in entries):
            continue
        fields = {e[0] for e in entries}
        if len(fields) > 1:  # the lists themselves differ (another parameter, another module)
            by_rank = "; ".join(f"rank {r} has {e[0]!r}" for r, e in enumerate(entries))
            return f"entry {i} of the setup: {by_rank}"
        groups: dict[str, list[int]] = {}
        for r, (_, value) in enumerate(entries):
            groups.setdefault(repr(value), []).append(r)
        held = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'have' if len(rs) > 1 else 'has'} {v}"
            for v, rs in groups.items()
        )
        return f"{entries[0][0]}: {held}"
    return None


def tensor_records(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, Any]]:
    """``(name, (shape, dtype, bit checksum))`` per tensor: what ranks compare of their replicas."""
    return [(n, (tuple(t.shape), str(t.dtype), tensor_checksum(t))) for n, t in named]


def first_difference_across(records: list[tuple[str, Any]], group: dist.ProcessGroup | None, what: str) -> str | None:
    """Gather every rank's ``records`` over ``group`` (one collective) and describe the first field
    that differs, with the ranks holding each value; None when all agree."""
    everyone: list = [None] * dist.get_world_size(group)
    with collective(what, group):
        dist.all_gather_object(everyone, records, group=group)
    return _first_difference(everyone)


def verify_same_setup(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    plan: EPPlan,
    experts: Iterable[str],
    *,
    what: str,
    replicated: Iterable[tuple[str, torch.Tensor]] | None = None,
    extra: Iterable[tuple[str, Any]] = (),
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks agree on the MoE setup.

    Compared in order: the plan, each experts module's configuration (:func:`experts_config`), then
    the name, shape, dtype and bitwise checksum of every replicated tensor (``replicated``; default:
    every parameter and buffer outside the ``experts`` modules). ``extra`` fields are compared
    first (e.g. a setup problem found on this rank). Collective: one gather of small
    Python objects; the checksums read every replicated tensor once.
    """
    experts = list(experts)
    if replicated is None:
        prefixes = tuple(f"{n}." for n in experts)
        replicated = [
            (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if not n.startswith(prefixes)
        ]
    config = list(extra) + _plan_fields(plan) + experts_config(model, experts)
    everyone: list = [None] * dist.get_world_size(group)
    with collective("setup verification", group):
        dist.all_gather_object(everyone, (config, tensor_records(replicated)), group=group)
    difference = _first_difference([c for c, _ in everyone])
    if difference is not None:
        raise ValueError(f"{what}: ranks disagree on the expert-parallel setup: {difference}")
    difference = _first_difference([t for _, t in everyone])
    if difference is not None:
        raise ValueError(
            f"{what}: ranks disagree on a replicated tensor (shape, dtype, bit checksum): {difference}; "
            "build the model from the same seed or checkpoint on every rank before parallelizing"
        )


def match_and_verify(model: nn.Module, group: dist.ProcessGroup | None, plan: EPPlan, *, what: str) -> list[str]:
    """The experts modules ``plan`` matches in ``model``, after :func:`verify_same_setup` over ``group``.

    A pattern error is compared across ranks first (one rank failing alone would leave the others
    waiting in the exchange), then raised on every rank.
    """
    try:
        experts, problem = plan.match(dict(model.named_modules())), None
    except ValueError as err:
        experts, problem = [], str(err)
    verify_same_setup(model, group, plan, experts, what=what, extra=[("plan.match", problem)])
    if problem is not None:
        raise ValueError(f"{what}: {problem}")
    return experts
