"""Rows for the Hugging Face path: transformers' own Qwen3.5-MoE block, its experts loop vs ``moe_gmm``.

The model ``moe-gmm train`` trains is ``transformers``' ``Qwen3_5MoeForCausalLM`` with
``experts_implementation="moe_gmm"``. Here one ``Qwen3_5MoeSparseMoeBlock`` runs twice with the
same weights: with transformers' ``"eager"`` experts (a per-expert ``F.linear`` loop with
``index_add_``, written independently of this project: the eager column) and with ``"moe_gmm"``
on the fused backend (the fused column). A weight-layout mistake in the integration (HF stores
``gate_up_proj [E, 2I, H]`` with the gate rows first) shows up here as a large difference.

Legend: T tokens, E experts, H hidden, I moe intermediate.
"""

from __future__ import annotations

import copy
import importlib.util

import torch

from moe_gmm.config import ModelConfig
from moe_gmm.report.checks import per_expert_row, rel_diff_row, rel_err_row
from moe_gmm.report.model import Report, Row
from moe_gmm.testing import tolerance_for

__all__ = ["hf_rows"]

_SEC = "Hugging Face Qwen3.5-MoE block: transformers' eager experts vs experts_implementation='moe_gmm'"


def _block(shape: ModelConfig, seed: int):
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = Qwen3_5MoeTextConfig(
        hidden_size=shape.hidden_size,
        num_experts=shape.num_experts,
        num_experts_per_tok=shape.num_experts_per_tok,
        moe_intermediate_size=shape.moe_intermediate_size,
        shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
        norm_topk_prob=shape.norm_topk_prob,
    )
    block = Qwen3_5MoeSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(block.named_parameters()):
            # Every parameter here is [..., out, in] (nn.Linear and HF's 3-D expert layout).
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return block


def _use(block, implementation: str):
    """A copy of ``block`` whose experts dispatch to ``implementation`` (the choice lives on its config)."""
    block = copy.deepcopy(block)
    block.experts.config = copy.deepcopy(block.experts.config)
    block.experts.config._experts_implementation = implementation
    return block


def hf_rows(report: Report, opts, device: torch.device, shape: ModelConfig) -> None:
    if importlib.util.find_spec("transformers") is None:
        report.add(
            Row(
                _SEC,
                "Hugging Face block",
                "skipped",
                None,
                None,
                None,
                None,
                "transformers is not installed (pip install 'moe-gmm[hf]')",
            )
        )
        return
    from moe_gmm.integrations.transformers import register_moe_gmm_experts

    dtype, tol = opts.torch_dtype, tolerance_for(opts.torch_dtype)
    name = register_moe_gmm_experts("moe_gmm", backend=opts.backend)
    base = _block(shape, opts.seed + 400)
    blocks = {
        "eager": _use(base, "eager").to(device=device, dtype=dtype),
        "fused": _use(base, name).to(device=device, dtype=dtype),
        "ref": _use(base, "eager").to(device=device, dtype=torch.float64).requires_grad_(False),
    }
    g = torch.Generator().manual_seed(opts.seed + 401)
    x64 = torch.randn(1, opts.tokens, shape.hidden_size, generator=g, dtype=torch.float64).to(device)
    gy = torch.randn(x64.shape, generator=g, dtype=torch.float64).to(device)
    with torch.no_grad():
        _, _, ids_Tk = blocks["fused"].gate(x64.to(dtype).reshape(-1, shape.hidden_size))
    counts = torch.bincount(ids_Tk.flatten().cpu(), minlength=shape.num_experts).tolist()
    outs, dxs = {}, {}
    for key, block in blocks.items():
        x = x64.to(block.gate.weight.dtype).requires_grad_(True)
        y = block(x)
        y.backward(gy.to(y.dtype))
        outs[key], dxs[key] = y.detach(), x.grad
    # transformers' eager column is reported, not judged: its bf16 rounding is not this project's.
    ref_note = "reference: transformers' eager block in float64; only the fused column is judged"
    report.add(
        rel_err_row(_SEC, "block output", outs["eager"], outs["fused"], outs["ref"], tol, ref_note, judge_eager=False)
    )
    report.add(rel_diff_row(_SEC, "block output", outs["eager"], outs["fused"], tol))
    report.add(
        rel_err_row(_SEC, "grad_input", dxs["eager"], dxs["fused"], dxs["ref"], tol, ref_note, judge_eager=False)
    )
    report.add(rel_diff_row(_SEC, "grad_input", dxs["eager"], dxs["fused"], tol))
    for pname in ("gate_up_proj", "down_proj"):
        g_e = getattr(blocks["eager"].experts, pname).grad
        g_f = getattr(blocks["fused"].experts, pname).grad
        report.add(
            per_expert_row(
                _SEC, f"experts.{pname} grad per expert (HF layout)", g_e, g_f, counts, tol, elementwise=False
            )
        )
