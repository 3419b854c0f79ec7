"""The MoE-layer benchmark's cases and implementations: one Qwen3.5-MoE sparse block, ours vs transformers'.

Legend: T tokens, k top-k, E experts, H hidden, I moe intermediate, Is shared-expert intermediate.

Implementations, all on the same weights and the same input ``x [1, T, H]``:

- ``hf_eager``: transformers' ``Qwen3_5MoeSparseMoeBlock``, experts_implementation ``eager`` (its
  per-expert loop); the reference every other row is compared with;
- ``hf_grouped_mm``: the same block with transformers' ``grouped_mm`` experts;
- ``hf_moe_gmm``: the same block with experts_implementation ``moe_gmm`` (our integration);
- ``moe_gmm``: :class:`~moe_gmm.layers.SparseMoeBlock` (fused, auto backend), weights converted
  once to its ``[E, H, 2I]`` / ``[E, I, H]`` layout;
- ``moe_gmm_eager``: the same block with ``use_grouped_expert_matmul=False`` (opt-in).

Gradients are taken for ``x`` and every parameter. ``moe_gmm``'s expert weights are handed to the
harness as Hugging Face-layout transposed *views* of its own parameters, so its gradients compare
element by element with transformers' while the block still reads its own memory layout.

Work per mode (``s`` bytes per element, ``R = T k``):

- FLOPs fwd ``2THE`` (router) + ``6RHI`` (experts) + ``6THIs + 2TH`` (shared expert and gate);
  bwd twice that; fwdbwd three times.
- minimal bytes: fwd ``s(P + 2TH)`` (P = all parameters, x read, out written); bwd
  ``s(2P + 3TH)`` (parameters read, their grads written, x and dy read, dx written); fwdbwd the sum.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from moe_gmm.bench.harness import Impl, Workload
from moe_gmm.integrations.transformers import (
    hf_to_moe_gmm_state_dict,
    moe_block_config_from_hf,
    register_moe_gmm_experts,
)
from moe_gmm.layers import SparseMoeBlock

__all__ = ["CASE_SETS", "DEFAULT_IMPLS", "IMPLS", "MoeLayerCase", "MoeLayerInputs", "case_set", "layer_impls"]

IMPLS = (
    "hf_eager",
    "hf_grouped_mm",
    "hf_moe_gmm",
    "moe_gmm",
    "moe_gmm_eager",
)
DEFAULT_IMPLS = ("hf_eager", "hf_grouped_mm", "hf_moe_gmm", "moe_gmm")
_HF_IMPL = {
    "hf_eager": "eager",
    "hf_grouped_mm": "grouped_mm",
    "hf_moe_gmm": "moe_gmm",
}
_MODE_FACTOR = {"fwd": 1, "bwd": 2, "fwdbwd": 3}
# moe-gmm parameters stored transposed relative to transformers' (see the module docstring).
_TRANSPOSED = ("experts.gate_up_proj", "experts.down_proj")


@dataclass
class MoeLayerInputs:
    """The transformers block (the weights' owner), our block (a converted copy) and ``x [1, T, H]``."""

    hf_config: Any
    hf_block: torch.nn.Module
    block: SparseMoeBlock
    x: torch.Tensor


@dataclass(frozen=True)
class MoeLayerCase:
    """One sparse MoE block of Qwen3.5-like proportions on T tokens (uniform random weights)."""

    num_experts: int
    num_tokens: int
    top_k: int = 8
    hidden: int = 2048
    intermediate: int = 512
    shared_intermediate: int = 512

    @property
    def name(self) -> str:
        return f"E{self.num_experts}-k{self.top_k}-T{self.num_tokens}"

    def columns(self) -> dict[str, str]:
        return {"shape": f"H{self.hidden} I{self.intermediate} Is{self.shared_intermediate}"}

    def params(self) -> dict[str, Any]:
        return {
            "num_experts": self.num_experts,
            "top_k": self.top_k,
            "num_tokens": self.num_tokens,
            "hidden": self.hidden,
            "intermediate": self.intermediate,
            "shared_intermediate": self.shared_intermediate,
        }

    def hf_config(self):
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(
            hidden_size=self.hidden,
            num_experts=self.num_experts,
            num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.intermediate,
            shared_expert_intermediate_size=self.shared_intermediate,
        )

    def make_inputs(self, dtype: torch.dtype) -> MoeLayerInputs:
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        cfg = self.hf_config()
        cfg._experts_implementation = "eager"
        hf_block = Qwen3_5MoeSparseMoeBlock(cfg)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in hf_block.parameters():
                # nn.Linear-like scale 1/sqrt(fan_in); fan_in is the last dim in transformers' layouts.
                p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) * p.shape[-1] ** -0.5)
        hf_block = hf_block.to(dtype)
        # No aux loss in the timed block: transformers computes it at the model level, not in the block.
        block = SparseMoeBlock(moe_block_config_from_hf(cfg, router_aux_loss_coef=0.0)).to(dtype)
        block.load_state_dict(hf_to_moe_gmm_state_dict(hf_block.state_dict()))
        x = torch.randn(1, self.num_tokens, self.hidden, generator=g).to(dtype).requires_grad_(True)
        return MoeLayerInputs(hf_config=cfg, hf_block=hf_block, block=block, x=x)

    def _param_numel(self) -> int:
        h, e, i, si = self.hidden, self.num_experts, self.intermediate, self.shared_intermediate
        return e * h + e * 3 * h * i + 3 * h * si + h

    def flops(self, mode: str) -> float:
        t, h, e, i, si = self.num_tokens, self.hidden, self.num_experts, self.intermediate, self.shared_intermediate
        fwd = 2.0 * t * h * e + 6.0 * t * self.top_k * h * i + 6.0 * t * h * si + 2.0 * t * h
        return fwd * _MODE_FACTOR[mode]

    def min_bytes(self, mode: str, dtype: torch.dtype) -> float:
        size = torch.empty((), dtype=dtype).element_size()
        p, act = self._param_numel(), self.num_tokens * self.hidden
        fwd, bwd = p + 2 * act, 2 * p + 3 * act
        return float(size * {"fwd": fwd, "bwd": bwd, "fwdbwd": fwd + bwd}[mode])


def _hf_impl(name: str) -> Impl:
    implementation = _HF_IMPL[name]

    def prepare(inp: MoeLayerInputs) -> Workload:
        # A second module sharing the weights' storage, with its own config: the experts read
        # config._experts_implementation at every call, so each implementation needs its own.
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        cfg = copy.deepcopy(inp.hf_config)
        cfg._experts_implementation = implementation
        with torch.device("meta"):
            hf_block = Qwen3_5MoeSparseMoeBlock(cfg)
        hf_block.load_state_dict(inp.hf_block.state_dict(), assign=True)
        leaves = (inp.x, *hf_block.parameters())
        return Workload(forward=lambda: hf_block(inp.x), leaves=leaves)

    return Impl(
        name=name,
        prepare=prepare,
        description=f"transformers Qwen3_5MoeSparseMoeBlock, {implementation} experts",
    )


def _ours_impl(name: str) -> Impl:
    fused = name != "moe_gmm_eager"

    def prepare(inp: MoeLayerInputs) -> Workload:
        # A parameter-less twin with this implementation's switch; it runs on inp.block's tensors.
        with torch.device("meta"):
            block = SparseMoeBlock(dataclasses.replace(inp.block.config, use_grouped_expert_matmul=fused))
        ours = dict(inp.block.named_parameters())
        # Leaves in transformers' order and layout: transposed views of our parameters (no copy).
        exposed = {n: (ours[n].transpose(1, 2) if n in _TRANSPOSED else ours[n]) for n in ours}
        used = {n: (exposed[n].transpose(1, 2) if n in _TRANSPOSED else exposed[n]) for n in ours}
        order = [n for n, _ in inp.hf_block.named_parameters()]

        def forward():
            return torch.func.functional_call(block, used, (inp.x,))

        return Workload(forward=forward, leaves=(inp.x, *(exposed[n] for n in order)))

    return Impl(
        name=name,
        prepare=prepare,
        description="moe_gmm SparseMoeBlock, "
        + ("grouped_matmul (auto backend)" if fused else "eager loop"),
    )


def layer_impls(names: list[str] | None = None, reference: str = "hf_eager") -> list[Impl]:
    """The requested implementations and the ``reference`` (``hf_eager`` unless told otherwise)."""
    names = list(names or DEFAULT_IMPLS)
    unknown = [n for n in (*names, reference) if n not in IMPLS]
    if unknown:
        raise ValueError(f"--impls/--reference: unknown {unknown}; choose from {list(IMPLS)}")
    if reference not in names:
        names.insert(0, reference)
    if any(_HF_IMPL.get(n) == "moe_gmm" for n in names):
        register_moe_gmm_experts()
    return [_hf_impl(n) if n in _HF_IMPL else _ours_impl(n) for n in IMPLS if n in names]


def case_set(name: str) -> list[MoeLayerCase]:
    """``tiny``: a smoke test; ``quick``: a scaled-down block (under a minute on two cores);
    ``qwen``: Qwen3.5-MoE proportions (hidden 2048, intermediate 512, top-8, E 64/256, T 1024/4096);
    ``cpu``: E 8 (top-2) and 64 (top-8) sized for two cores; ``experts``: E 8 (top-2) and 64/128/256
    (top-8) at H1024 I256 T512."""
    if name == "tiny":
        return [MoeLayerCase(num_experts=4, num_tokens=8, top_k=2, hidden=16, intermediate=8, shared_intermediate=8)]
    if name == "quick":
        return [MoeLayerCase(num_experts=32, num_tokens=256, hidden=512, intermediate=128, shared_intermediate=128)]
    if name == "qwen":
        return [MoeLayerCase(num_experts=e, num_tokens=t) for e in (64, 256) for t in (1024, 4096)]
    if name == "experts":
        # E 8..256 at one shape (2-core sized): with --reference hf_grouped_mm, since hf_eager's
        # backward takes minutes per step at E=256.
        return [
            MoeLayerCase(
                num_experts=e,
                num_tokens=512,
                top_k=2 if e == 8 else 8,
                hidden=1024,
                intermediate=256,
                shared_intermediate=256,
            )
            for e in (8, 64, 128, 256)
        ]
    if name == "cpu":
        # Sized for a 2-core CPU, where hf_eager's O(E^2) backward bounds what can run (E <= 64).
        return [
            MoeLayerCase(
                num_experts=8, num_tokens=1024, top_k=2, hidden=1024, intermediate=512, shared_intermediate=512
            ),
            MoeLayerCase(
                num_experts=64, num_tokens=512, top_k=8, hidden=1024, intermediate=256, shared_intermediate=256
            ),
        ]
    raise ValueError(f"case set must be one of {CASE_SETS}, got {name!r}")


CASE_SETS = ("tiny", "quick", "qwen", "cpu", "experts")
