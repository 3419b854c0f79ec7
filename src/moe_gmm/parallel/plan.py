"""``ep_plan``: which modules are expert-parallel, and how their module names are matched.

The keys follow the reference training configuration::

    parallel:
      expert_parallel_size: 16
      ep_plan:
        apply_modules: [model.language_model.layers.{*}.mlp.experts]
        dispatcher: alltoall            # or alltoall_overlap

A pattern is anchored (it must match the whole ``named_modules()`` name) and may use

- ``{*}``   one non-negative integer (a layer index), e.g. ``layers.{*}.mlp.experts``;
- ``{a-b}`` one integer in the inclusive range ``[a, b]``, e.g. ``layers.{0-11}.mlp.experts``;
- ``*``     any run of characters, dots included (``layers.*.experts`` also matches
            ``layers.3.block.experts``);
- ``?``     any one character.

Everything else is literal, so ``mlp.experts`` never matches ``mlp.shared_expert`` and ``.`` is a
dot, not "any character".
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DISPATCHERS", "EPPlan", "ModulePattern", "match_modules"]

DISPATCHERS = ("alltoall", "alltoall_overlap")

# One token of the pattern language: a brace group, a star, a question mark or one literal character.
_TOKEN = re.compile(r"\{(?P<brace>[^{}]*)\}|(?P<star>\*)|(?P<any>\?)|(?P<lit>.)", re.DOTALL)
_RANGE = re.compile(r"(?P<lo>\d+)-(?P<hi>\d+)")
# A whole-number name component (a ModuleList index), shown as ``{*}`` in suggestions.
_LAYER_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")
_SUGGESTIONS = 3


@dataclass(frozen=True)
class ModulePattern:
    """One compiled ``apply_modules`` entry: an anchored regex plus the ranges of its ``{a-b}`` groups."""

    text: str
    regex: re.Pattern[str]
    # One (lo, hi) per capture group, in order; ``None`` for ``{*}`` (any integer).
    ranges: tuple[tuple[int, int] | None, ...]

    @classmethod
    def compile(cls, text: str) -> ModulePattern:
        if not isinstance(text, str):
            raise TypeError(f"parallel.ep_plan.apply_modules: each pattern must be a str, got {type(text).__name__}")
        if not text:
            raise ValueError("parallel.ep_plan.apply_modules: a pattern must not be empty")
        parts: list[str] = []
        ranges: list[tuple[int, int] | None] = []
        for m in _TOKEN.finditer(text):
            if m.group("brace") is not None:
                body = m.group("brace")
                if body == "*":
                    ranges.append(None)
                elif (r := _RANGE.fullmatch(body)) is not None:
                    lo, hi = int(r.group("lo")), int(r.group("hi"))
                    if lo > hi:
                        raise ValueError(
                            f"parallel.ep_plan.apply_modules: range {{{body}}} in pattern {text!r} is empty "
                            f"(expected {{a-b}} with a <= b)"
                        )
                    ranges.append((lo, hi))
                else:
                    raise ValueError(
                        f"parallel.ep_plan.apply_modules: unknown group {{{body}}} in pattern {text!r} "
                        "(expected {*} or {a-b})"
                    )
                parts.append(r"(\d+)")
            elif m.group("star") is not None:
                parts.append(".*")
            elif m.group("any") is not None:
                parts.append(".")
            else:
                lit = m.group("lit")
                if lit in "{}":
                    raise ValueError(
                        f"parallel.ep_plan.apply_modules: unbalanced {lit!r} in pattern {text!r} "
                        "(expected {*} or {a-b})"
                    )
                parts.append(re.escape(lit))
        return cls(text=text, regex=re.compile("".join(parts)), ranges=tuple(ranges))

    def matches(self, name: str) -> bool:
        m = self.regex.fullmatch(name)
        if m is None:
            return False
        for value, bounds in zip(m.groups(), self.ranges):
            if bounds is not None and not bounds[0] <= int(value) <= bounds[1]:
                return False
        return True


def _is_experts_like(module: Any) -> bool:
    """Holds the routed experts' two 3-D weights (what ``apply_expert_parallel`` can shard)."""
    return all(getattr(getattr(module, p, None), "ndim", None) == 3 for p in ("gate_up_proj", "down_proj"))


def _closest(pattern: str, names: list[str], modules: Mapping[str, Any] | None, experts: bool) -> str:
    """The names nearest to a pattern that matched nothing, as patterns (layer indices as ``{*}``)."""
    if experts and modules is not None:
        names = [n for n in names if _is_experts_like(modules[n])]
        if not names:
            return "the model has no module with 3-D gate_up_proj and down_proj parameters (routed experts)"
    general = list(dict.fromkeys(_LAYER_INDEX.sub("{*}", n) for n in names if n))
    close = difflib.get_close_matches(pattern, general, n=_SUGGESTIONS, cutoff=0.0)
    kind = "experts modules" if experts and modules is not None else "module names"
    return f"closest {kind}: {', '.join(close)}" if close else "the model has no named modules"


def match_modules(names: Iterable[str], patterns: Iterable[str | ModulePattern], *, experts: bool = True) -> list[str]:
    """The names matched by any of ``patterns``, in the order of ``names``.

    Raises ``ValueError`` when a pattern matches no name (a typo would otherwise silently leave the
    model unsharded) or when two patterns match the same name (it would be sharded twice). Given
    ``named_modules()`` as a mapping, the error lists the closest experts modules (those with 3-D
    ``gate_up_proj`` and ``down_proj``; any module with ``experts=False``).
    """
    compiled = [p if isinstance(p, ModulePattern) else ModulePattern.compile(p) for p in patterns]
    modules = names if isinstance(names, Mapping) else None
    names = list(names)
    owner: dict[str, str] = {}
    for pat in compiled:
        hits = [n for n in names if pat.matches(n)]
        if not hits:
            raise ValueError(
                f"parallel.ep_plan.apply_modules: pattern {pat.text!r} matches no module "
                f"({_closest(pat.text, names, modules, experts)})"
            )
        for n in hits:
            if n in owner:
                raise ValueError(
                    f"parallel.ep_plan.apply_modules: module {n!r} is matched by both {owner[n]!r} and "
                    f"{pat.text!r}; each module may be matched by one pattern only"
                )
            owner[n] = pat.text
    return [n for n in names if n in owner]


@dataclass(frozen=True)
class EPPlan:
    """Expert-parallel plan (``parallel.*`` of the reference configuration).

    ``num_chunks`` only affects ``dispatcher="alltoall_overlap"``: the local tokens are split into
    that many chunks so the exchange of one chunk overlaps the expert matmuls of another.
    """

    expert_parallel_size: int
    apply_modules: tuple[str, ...]
    dispatcher: str = "alltoall"
    num_chunks: int = 2

    def __post_init__(self) -> None:
        ep = self.expert_parallel_size
        if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
            raise ValueError(f"parallel.expert_parallel_size: expected an int >= 1, got {ep!r}")
        if isinstance(self.apply_modules, str):
            raise TypeError(
                "parallel.ep_plan.apply_modules: expected a list of patterns, got the single string "
                f"{self.apply_modules!r}"
            )
        object.__setattr__(self, "apply_modules", tuple(self.apply_modules))
        if ep > 1 and not self.apply_modules:
            raise ValueError(
                "parallel.ep_plan.apply_modules: must name at least one module when expert_parallel_size > 1"
            )
        for text in self.apply_modules:
            ModulePattern.compile(text)  # fail at construction, not at apply time
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"parallel.ep_plan.dispatcher: expected one of {DISPATCHERS}, got {self.dispatcher!r}")
        if not isinstance(self.num_chunks, int) or isinstance(self.num_chunks, bool) or self.num_chunks < 1:
            raise ValueError(f"parallel.ep_plan.num_chunks: expected an int >= 1, got {self.num_chunks!r}")

    @property
    def patterns(self) -> tuple[ModulePattern, ...]:
        return tuple(ModulePattern.compile(p) for p in self.apply_modules)

    def match(self, names: Iterable[str]) -> list[str]:
        """Module names this plan shards; see :func:`match_modules` for the errors."""
        return match_modules(names, self.patterns)

    @classmethod
    def from_config(cls, parallel: Any) -> EPPlan:
        """Build from the ``parallel`` section: a mapping (parsed YAML) or ``moe_gmm.config.ParallelConfig``."""
        if isinstance(parallel, Mapping):
            unknown = set(parallel) - {"expert_parallel_size", "ep_plan"}
            if unknown:
                raise ValueError(f"parallel: unknown keys {sorted(unknown)} (allowed: expert_parallel_size, ep_plan)")
            ep_plan = parallel.get("ep_plan") or {}
            if not isinstance(ep_plan, Mapping):
                raise TypeError(f"parallel.ep_plan: expected a mapping, got {type(ep_plan).__name__}")
            unknown = set(ep_plan) - {"apply_modules", "dispatcher", "num_chunks"}
            if unknown:
                raise ValueError(
                    f"parallel.ep_plan: unknown keys {sorted(unknown)} (allowed: apply_modules, dispatcher, num_chunks)"
                )
            return cls(
                expert_parallel_size=parallel.get("expert_parallel_size", 1),
                apply_modules=tuple(ep_plan.get("apply_modules", ())),
                dispatcher=ep_plan.get("dispatcher", "alltoall"),
                num_chunks=ep_plan.get("num_chunks", 2),
            )
        ep_plan = parallel.ep_plan
        return cls(
            expert_parallel_size=parallel.expert_parallel_size,
            apply_modules=tuple(ep_plan.apply_modules),
            dispatcher=ep_plan.dispatcher,
            num_chunks=getattr(ep_plan, "num_chunks", 2),
        )
