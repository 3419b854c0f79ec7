"""Rows for the routed experts inside a real MoE block, the routing and the shapes.

Two :class:`~moe_gmm.layers.SparseMoeBlock` copies with identical weights run side by side:
``use_grouped_expert_matmul=False`` (eager loop) and ``True`` (the fused backend). Their shared
experts and routers are the same modules with the same weights, so every difference in the block
output comes from the routed experts (the shared expert is "held fixed"; a row checks it).

Legend: T tokens, k top-k, E experts, H hidden, I moe intermediate, R = T*k permuted rows.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from moe_gmm.config import ModelConfig
from moe_gmm.layers import MoeBlockConfig, SparseMoeBlock
from moe_gmm.ops.grouped_matmul import grouped_matmul
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.ops.swiglu import swiglu
from moe_gmm.report.checks import (
    empty_zero_row,
    finite,
    per_expert_max_abs,
    per_expert_row,
    rel_diff_row,
    rel_err_row,
)
from moe_gmm.report.model import Report, Row
from moe_gmm.testing import (
    reference_grouped_matmul,
    reference_permute,
    reference_unpermute,
    routing_ids,
    tolerance_for,
)

__all__ = ["block_out", "build_block_pair", "layer_rows"]

_SEC_ROUTING = "routing"
_SEC_SHAPES = "shapes"
_SEC_EXPERTS = "routed experts in the MoE block"
_SEC_FORCED = "routed experts, forced routing"


def _init_weights(module: torch.nn.Module, seed: int) -> None:
    """Deterministic N(0, 1/fan_in) weights, drawn in float32 on the CPU (same on every device)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            fan_in = p.shape[1] if p.dim() == 3 else p.shape[-1]  # [E, in, out] or nn.Linear [out, in]
            p.copy_(torch.randn(p.shape, generator=g) / fan_in**0.5)


def build_block_pair(shape: ModelConfig, dtype, device, seed: int, backend: str | None):
    """``(eager_block, fused_block)`` with identical weights."""

    def make(fused: bool) -> SparseMoeBlock:
        cfg = MoeBlockConfig(
            hidden_size=shape.hidden_size,
            num_experts=shape.num_experts,
            num_experts_per_tok=shape.num_experts_per_tok,
            moe_intermediate_size=shape.moe_intermediate_size,
            shared_expert_intermediate_size=shape.shared_expert_intermediate_size,
            norm_topk_prob=shape.norm_topk_prob,
            use_grouped_expert_matmul=fused,
            gmm_backend=backend if fused else None,
        )
        return SparseMoeBlock(cfg)

    fused = make(True)
    _init_weights(fused, seed)
    eager = make(False)
    eager.load_state_dict(fused.state_dict())
    return eager.to(device=device, dtype=dtype), fused.to(device=device, dtype=dtype)


def block_out(block: torch.nn.Module, x_TH: torch.Tensor) -> torch.Tensor:
    out = block(x_TH)
    return out[0] if isinstance(out, tuple) else out


def _reference_experts(x_TH, ids_Tk, probs_Tk, gate_up_EH2I, down_EIH, num_experts) -> torch.Tensor:
    """float64 routed-expert output from the shared references: permute, GMM, SwiGLU, GMM, unpermute."""
    permuted, rows_Tk, counts = reference_permute(x_TH, ids_Tk, num_experts)
    h = reference_grouped_matmul(permuted, gate_up_EH2I, counts)
    inter = h.shape[1] // 2
    a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
    y = reference_grouped_matmul(a, down_EIH, counts)
    return reference_unpermute(y, rows_Tk, probs_Tk)


def _routing_rows(report: Report, block, x_TH, ids_Tk, probs_Tk, num_experts: int, tol) -> list[int]:
    counts = torch.bincount(ids_Tk.flatten().cpu(), minlength=num_experts).tolist()
    mean = sum(counts) / num_experts
    empty = [e for e, c in enumerate(counts) if c == 0]
    report.add(
        Row(
            _SEC_ROUTING,
            "tokens_per_expert load",
            "max / mean",
            max(counts) / mean,
            max(counts) / mean,
            None,
            None,
            f"min {min(counts)}, max {max(counts)}, mean {mean:.1f}; one router serves both paths",
            details={"counts": counts},
        )
    )
    report.add(
        Row(
            _SEC_ROUTING,
            "empty experts",
            "count",
            len(empty),
            len(empty),
            None,
            None,
            f"experts {empty}" if empty else "none",
        )
    )
    report.add(
        Row(
            _SEC_ROUTING,
            "tokens_per_expert sums to T*k",
            "sum",
            sum(counts),
            sum(counts),
            ids_Tk.numel(),
            sum(counts) == ids_Tk.numel(),
        )
    )
    sums = probs_Tk.detach().double().sum(dim=-1)
    dev = float((sums - 1).abs().max())
    limit = 1e-5 if probs_Tk.dtype in (torch.float32, torch.float64) else tol.atol
    report.add(
        Row(
            _SEC_ROUTING,
            "routing weights sum to 1 per token",
            "max |sum_k w - 1|",
            dev,
            dev,
            limit if block.gate.norm_topk_prob else None,
            (dev <= limit) if block.gate.norm_topk_prob else None,
            f"probs dtype {str(probs_Tk.dtype).removeprefix('torch.')}"
            + ("" if block.gate.norm_topk_prob else "; norm_topk_prob=False: weights are not renormalised"),
        )
    )
    # Every (token, slot) copy must sit in the bucket of the expert it was routed to, and hold the token.
    permuted, row_id_map, tpe = permute(x_TH, ids_Tk, num_experts)
    ends = torch.cumsum(tpe, 0)
    expert_of_row = torch.bucketize(row_id_map, ends, right=True).view_as(ids_Tk)
    wrong_bucket = int((expert_of_row != ids_Tk).sum())
    wrong_rows = int((permuted.index_select(0, row_id_map).view(*ids_Tk.shape, -1) != x_TH.unsqueeze(1)).any(-1).sum())
    report.add(
        Row(
            _SEC_ROUTING,
            "top-k ids consistent with permute/unpermute",
            "mismatched (token, slot) pairs",
            wrong_bucket + wrong_rows,
            wrong_bucket + wrong_rows,
            0,
            wrong_bucket + wrong_rows == 0,
            f"{wrong_bucket} in the wrong expert bucket, {wrong_rows} holding the wrong token",
        )
    )
    back = unpermute(permuted, row_id_map, probs_Tk.to(x_TH.dtype))
    expect = x_TH.double() * probs_Tk.double().sum(-1, keepdim=True)
    diff = float((back.double() - expect).abs().max())
    report.add(
        Row(
            _SEC_ROUTING,
            "unpermute(permute(x), probs) == x * sum(probs)",
            "max abs diff",
            diff,
            diff,
            tol.atol,
            diff <= tol.atol,
        )
    )
    return counts


def _shape_rows(report: Report, eager, fused, x_TH, ids_Tk, probs_Tk, shape: ModelConfig, backend) -> None:
    T, H, I, k = x_TH.shape[0], shape.hidden_size, shape.moe_intermediate_size, shape.num_experts_per_tok
    R = T * k
    seen = {}
    for name, block, is_fused in (("eager", eager, False), ("fused", fused, True)):
        gmm = {"fused": is_fused, "backend": backend if is_fused else None}
        with torch.no_grad():
            permuted, row_id_map, tpe = permute(x_TH, ids_Tk, shape.num_experts)
            h = grouped_matmul(permuted, block.experts.gate_up_proj, tpe, **gmm)
            y = grouped_matmul(swiglu(h), block.experts.down_proj, tpe, **gmm)
            out = unpermute(y, row_id_map, probs_Tk.to(y.dtype))
        seen[name] = {
            "group_list.sum() == permuted rows": (int(tpe.sum()), permuted.shape[0]),
            "gate_up GMM output [R, 2I]": tuple(h.shape),
            "down GMM output [R, H]": tuple(y.shape),
            "unpermute output [T, H]": tuple(out.shape),
        }
    expected = {
        "group_list.sum() == permuted rows": (R, R),
        "gate_up GMM output [R, 2I]": (R, 2 * I),
        "down GMM output [R, H]": (R, H),
        "unpermute output [T, H]": (T, H),
    }
    for check, want in expected.items():
        e, f = seen["eager"][check], seen["fused"][check]
        text = (lambda v: f"{v[0]} == {v[1]}") if check.startswith("group_list") else (lambda v: "x".join(map(str, v)))
        report.add(Row(_SEC_SHAPES, check, "shape", text(e), text(f), text(want), e == want and f == want))


def _grad_shape_row(report: Report, eager, fused) -> None:
    bad = []
    for name, p in fused.named_parameters():
        q = dict(eager.named_parameters())[name]
        for path, param in (("eager", q), ("fused", p)):
            if param.grad is None or param.grad.shape != param.shape:
                bad.append(f"{path}:{name}")
    gu = fused.experts.gate_up_proj
    report.add(
        Row(
            _SEC_SHAPES,
            "grad shapes == parameter shapes (all block parameters)",
            "mismatches",
            len([b for b in bad if b.startswith("eager")]),
            len([b for b in bad if b.startswith("fused")]),
            0,
            not bad,
            "; ".join(bad) if bad else f"gate_up_proj grad {tuple(gu.grad.shape)}",
        )
    )


def _expert_grad_rows(report: Report, section: str, case: str, eager, fused, counts, tol) -> dict[str, list[float]]:
    per_expert = {}
    empty = [e for e, c in enumerate(counts) if c == 0]
    for pname in ("gate_up_proj", "down_proj"):
        g_e = getattr(eager.experts, pname).grad
        g_f = getattr(fused.experts, pname).grad
        report.add(
            per_expert_row(section, f"{pname} grad per expert, {case}", g_e, g_f, counts, tol, elementwise=False)
        )
        if empty:
            report.add(empty_zero_row(section, f"{pname} grad of empty experts, {case}", g_e, g_f, empty))
        per_expert[pname] = per_expert_max_abs(g_f, g_e)
    return per_expert


def layer_rows(report: Report, opts, device: torch.device, shape: ModelConfig) -> dict[str, Any]:
    """Routing, shapes, routed-experts and block rows; returns plot data."""
    dtype, tol = opts.torch_dtype, tolerance_for(opts.torch_dtype)
    eager, fused = build_block_pair(shape, dtype, device, opts.seed, opts.backend)
    g = torch.Generator().manual_seed(opts.seed + 100)
    x64 = torch.randn(opts.tokens, shape.hidden_size, generator=g, dtype=torch.float64)
    x_TH = x64.to(device=device, dtype=dtype)
    gy_TH = torch.randn(opts.tokens, shape.hidden_size, generator=g, dtype=torch.float64).to(device=device, dtype=dtype)

    with torch.no_grad():
        _, probs_f, ids_f = fused.gate(x_TH)
        _, probs_e, ids_e = eager.gate(x_TH)
    same_ids = bool(torch.equal(ids_f, ids_e)) and bool(torch.equal(probs_f, probs_e))
    report.add(
        Row(
            _SEC_ROUTING,
            "router gives identical ids and weights on both paths",
            "identical",
            str(same_ids),
            str(same_ids),
            "True",
            same_ids,
        )
    )
    router_counts = _routing_rows(report, fused, x_TH, ids_f, probs_f, shape.num_experts, tol)
    _shape_rows(report, eager, fused, x_TH, ids_f, probs_f, shape, opts.backend)

    # Routed experts alone, on the router's choice, vs the float64 reference.
    with torch.no_grad():
        out_e = eager.experts(x_TH, ids_f, probs_f.to(dtype))
        out_f = fused.experts(x_TH, ids_f, probs_f.to(dtype))
    ref = _reference_experts(
        x_TH, ids_f, probs_f.to(dtype), fused.experts.gate_up_proj, fused.experts.down_proj, shape.num_experts
    )
    report.add(rel_err_row(_SEC_EXPERTS, "routed-expert output", out_e, out_f, ref, tol))
    report.add(rel_diff_row(_SEC_EXPERTS, "routed-expert output", out_e, out_f, tol))

    # The whole block, forward and backward, shared expert held fixed.
    with torch.no_grad():
        sh_e, sh_f = eager.shared_expert(x_TH), fused.shared_expert(x_TH)
    sh_diff = float((sh_e.double() - sh_f.double()).abs().max())
    report.add(
        Row(
            _SEC_EXPERTS,
            "shared expert held fixed (same weights, same output)",
            "max abs diff",
            None,
            sh_diff,
            "exactly 0",
            sh_diff == 0.0 and finite(sh_f),
        )
    )
    # The float64 reference needs only d(out)/dx: its parameters take no gradient (half the memory).
    reference = copy.deepcopy(eager).to(torch.float64).requires_grad_(False)
    outs, grads_x = {}, {}
    for name, block, xin in (("eager", eager, x_TH), ("fused", fused, x_TH), ("ref", reference, x64.to(device))):
        xg = xin.detach().clone().requires_grad_(True)
        y = block_out(block, xg)
        y.backward(gy_TH.to(y.dtype))
        outs[name], grads_x[name] = y.detach(), xg.grad
    del reference
    report.add(
        rel_diff_row(_SEC_EXPERTS, "MoE block output (shared expert held fixed)", outs["eager"], outs["fused"], tol)
    )
    report.add(
        rel_err_row(
            _SEC_EXPERTS,
            "MoE block output",
            outs["eager"],
            outs["fused"],
            outs["ref"],
            tol,
            "reference: the eager block in float64",
        )
    )
    report.add(
        rel_err_row(
            _SEC_EXPERTS,
            "grad_input",
            grads_x["eager"],
            grads_x["fused"],
            grads_x["ref"],
            tol,
            "reference: the eager block in float64",
        )
    )
    report.add(rel_diff_row(_SEC_EXPERTS, "grad_input", grads_x["eager"], grads_x["fused"], tol))
    _expert_grad_rows(report, _SEC_EXPERTS, "router's choice", eager, fused, router_counts, tol)
    report.add(rel_diff_row(_SEC_EXPERTS, "router weight grad", eager.gate.weight.grad, fused.gate.weight.grad, tol))
    _grad_shape_row(report, eager, fused)

    # Forced routings the router rarely produces: empty experts, duplicate ids in one token's top-k.
    plot: dict[str, Any] = {"router_counts": router_counts}
    routings = ("empty",) if opts.quick else ("empty", "duplicate_topk")
    for i, routing in enumerate(routings):
        gr = torch.Generator().manual_seed(opts.seed + 200 + i)
        ids = routing_ids(opts.tokens, shape.num_experts_per_tok, shape.num_experts, routing, generator=gr).to(device)
        probs = torch.rand(ids.shape, generator=gr).to(device=device, dtype=dtype)
        counts = torch.bincount(ids.flatten().cpu(), minlength=shape.num_experts).tolist()
        dx = {}
        for name, block in (("eager", eager), ("fused", fused)):
            block.zero_grad(set_to_none=True)
            xg = x_TH.detach().clone().requires_grad_(True)
            y = block.experts(xg, ids, probs)
            y.backward(gy_TH)
            outs[name], dx[name] = y.detach(), xg.grad
        case = f"{routing} routing"
        report.add(rel_diff_row(_SEC_FORCED, f"routed-expert output, {case}", outs["eager"], outs["fused"], tol))
        report.add(rel_diff_row(_SEC_FORCED, f"grad_input, {case}", dx["eager"], dx["fused"], tol))
        per_expert = _expert_grad_rows(report, _SEC_FORCED, case, eager, fused, counts, tol)
        if routing == "empty":
            plot["grad_weight"], plot["counts"] = per_expert, counts
    return plot
