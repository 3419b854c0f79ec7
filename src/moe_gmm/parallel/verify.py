"""Prove, before the first step, that every rank built the same MoE model and the same replicas.

Ranks that disagree on ``top_k`` or start from different weights (another seed, one expert loaded
from another file) would otherwise train a model no rank holds, without a word.
:func:`verify_same_setup` gathers, in one exchange, every rank's experts configuration, plan and the
sha256 of every tensor of the model (the replicated ones and the expert weights, whole, before they
are sharded), and raises the same ``ValueError`` on every rank naming the first field or tensor
that differs and the ranks that hold which value.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe_gmm.checksum import tensor_digest
from moe_gmm.parallel.comm import collective
from moe_gmm.parallel.layout import experts_layout
from moe_gmm.parallel.plan import EPPlan

__all__ = [
    "TensorRecord",
    "experts_config",
    "first_difference_across",
    "match_and_verify",
    "tensor_records",
    "verify_same_setup",
]

# Hex digits of the sha256 shown in a message: enough to tell values apart by eye; equality
# always compares the whole digest.
_SHOWN_DIGITS = 12


@dataclass(frozen=True)
class TensorRecord:
    """What ranks compare of one tensor: shape, dtype and the sha256 of its bytes (None on meta).

    A digest of the bytes, not a sum: any change of any bit anywhere (two elements swapped, -0.0
    for 0.0, another NaN payload) changes it.
    """

    shape: tuple[int, ...]
    dtype: str
    sha256: str | None

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorRecord:
        t = t.detach()
        if hasattr(t, "to_local"):  # a DTensor: this rank's part
            t = t.to_local()
        digest = None if t.device.type == "meta" else tensor_digest(t)  # HOST SYNC: once per tensor, at setup
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), digest)

    def __repr__(self) -> str:
        digest = "no data (meta)" if self.sha256 is None else f"sha256 {self.sha256[:_SHOWN_DIGITS]}"
        return f"{list(self.shape)} {self.dtype} {digest}"


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
        held = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {'have' if len(rs) > 1 else 'has'} {v!r}"
            for v, rs in _group_ranks([value for _, value in entries])
        )
        return f"{entries[0][0]}: {held}"
    return None


def _group_ranks(values: list[Any]) -> list[tuple[Any, list[int]]]:
    """``(value, ranks holding it)`` in rank order, grouped by equality (a message may show less
    than the value, e.g. a digest's first digits, so showing is never what groups)."""
    groups: list[tuple[Any, list[int]]] = []
    for rank, value in enumerate(values):
        for held, ranks in groups:
            if held == value:
                ranks.append(rank)
                break
        else:
            groups.append((value, [rank]))
    return groups


def tensor_records(named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, TensorRecord]]:
    """``(name, TensorRecord)`` per tensor: what ranks compare of their replicas."""
    return [(n, TensorRecord.of(t)) for n, t in named]


def first_difference_across(records: list[tuple[str, Any]], group: dist.ProcessGroup | None, what: str) -> str | None:
    """Gather every rank's ``records`` over ``group`` (one collective) and describe the first field
    that differs, with the ranks holding each value; None when all agree."""
    everyone: list = [None] * dist.get_world_size(group)
    with collective(what, group):
        dist.all_gather_object(everyone, records, group=group)
    return _first_difference(everyone)


def _split_tensors(
    model: nn.Module, experts: list[str]
) -> tuple[list[tuple[str, torch.Tensor]], list[tuple[str, torch.Tensor]]]:
    """``(replicated, expert)`` named tensors: every parameter and buffer, split by whether it
    lives in one of the ``experts`` modules (whole, since nothing is sharded yet)."""
    prefixes = tuple(f"{n}." for n in experts)
    named = [*model.named_parameters(), *model.named_buffers()]
    replicated = [(n, t) for n, t in named if not n.startswith(prefixes)]
    expert = [(n, t) for n, t in named if n.startswith(prefixes)]
    return replicated, expert


def verify_same_setup(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    plan: EPPlan,
    experts: Iterable[str],
    *,
    what: str,
    extra: Iterable[tuple[str, Any]] = (),
) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all ranks agree on the MoE setup.

    Compared in order: ``extra`` fields (e.g. a setup problem found on this rank), the plan, each
    experts module's configuration (:func:`experts_config`), then the shape, dtype and sha256 of
    every tensor outside the ``experts`` modules, then of every expert weight and buffer, whole
    (sharding takes each rank's block of experts from its own copy, so copies that differ would
    make a model no rank holds). Collective: one gather of small Python objects; each rank reads
    every tensor of the model once (a CPU copy of each, hashed).
    """
    experts = list(experts)
    replicated, expert = _split_tensors(model, experts)
    config = list(extra) + _plan_fields(plan) + experts_config(model, experts)
    everyone: list = [None] * dist.get_world_size(group)
    mine = (config, tensor_records(replicated), tensor_records(expert))
    with collective("setup verification", group):
        dist.all_gather_object(everyone, mine, group=group)
    difference = _first_difference([c for c, _, _ in everyone])
    if difference is not None:
        raise ValueError(f"{what}: ranks disagree on the expert-parallel setup: {difference}")
    for index, kind in ((1, "a replicated tensor"), (2, "an expert tensor before sharding")):
        difference = _first_difference([records[index] for records in everyone])
        if difference is not None:
            raise ValueError(
                f"{what}: ranks disagree on {kind} (shape, dtype, sha256): {difference}; "
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
