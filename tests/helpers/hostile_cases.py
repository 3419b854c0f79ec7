"""A table of hostile calls to the ops' public API, each with the error it must raise.

Every case is ``name -> Case(call, exception type, substring naming the argument)``. The calls build
small CPU inputs and run the op (forward and, where it matters, backward), so they run in the child
process of :mod:`tests.helpers.op_worker`: a crash there is a failed case, not a lost test run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_gmm.ops import expert_mlp, grouped_matmul, permute, swiglu, unpermute

BIG = 2**62


@dataclass(frozen=True)
class Case:
    call: Callable[[], object]
    exc: type[Exception]
    names: str  # a substring of the message: the argument at fault


# ---- grouped_matmul: x [6, 8], weight [3, 8, 4], group_list [2, 0, 4] ------------------------------


def _gmm(**override) -> Callable[[], object]:
    def call():
        kwargs = {"x": torch.randn(6, 8), "weight": torch.randn(3, 8, 4), "group_list": [2, 0, 4]}
        kwargs.update({k: v() if callable(v) else v for k, v in override.items()})
        x, w = kwargs["x"], kwargs["weight"]
        for t in (x, w):
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                t.requires_grad_(True)
        y = grouped_matmul(**kwargs)
        y.sum().backward()
        return tuple(y.shape)

    return call


def _t(*shape, dtype=torch.float32, device="cpu"):
    return lambda: torch.zeros(*shape, dtype=dtype, device=device)


# Four counts of about 2**62 whose int64 sum wraps around to M = 6 (issue: they passed as valid).
WRAPPING = [BIG, BIG, BIG, BIG + 6]


GMM_CASES = {
    "gmm/x_list": Case(_gmm(x=[[1.0] * 8] * 6), TypeError, "x must be a torch.Tensor"),
    "gmm/x_none": Case(_gmm(x=None), TypeError, "x must be a torch.Tensor"),
    "gmm/weight_float": Case(_gmm(weight=3.0), TypeError, "weight must be a torch.Tensor"),
    "gmm/x_1d": Case(_gmm(x=_t(48)), ValueError, "x must be 2-D"),
    "gmm/x_3d": Case(_gmm(x=_t(6, 8, 1)), ValueError, "x must be 2-D"),
    "gmm/weight_2d": Case(_gmm(weight=_t(8, 4)), ValueError, "weight must be 3-D"),
    "gmm/weight_4d": Case(_gmm(weight=_t(3, 8, 4, 1)), ValueError, "weight must be 3-D"),
    "gmm/k_mismatch": Case(_gmm(weight=_t(3, 7, 4)), ValueError, "x.shape[1] (K)"),
    "gmm/no_experts": Case(_gmm(weight=_t(0, 8, 4), group_list=[]), ValueError, "weight must hold at least one"),
    "gmm/x_int64": Case(_gmm(x=_t(6, 8, dtype=torch.int64)), TypeError, "x must have a floating dtype"),
    "gmm/x_bool": Case(_gmm(x=_t(6, 8, dtype=torch.bool)), TypeError, "x must have a floating dtype"),
    "gmm/x_complex": Case(_gmm(x=_t(6, 8, dtype=torch.complex64)), TypeError, "x must have a floating dtype"),
    "gmm/weight_int": Case(_gmm(weight=_t(3, 8, 4, dtype=torch.int32)), TypeError, "weight must have a floating"),
    "gmm/dtype_bf16_fp32": Case(_gmm(x=_t(6, 8, dtype=torch.bfloat16)), TypeError, "x and weight must share a dtype"),
    "gmm/dtype_fp32_fp64": Case(_gmm(weight=_t(3, 8, 4, dtype=torch.float64)), TypeError, "share a dtype"),
    "gmm/weight_on_meta": Case(_gmm(weight=_t(3, 8, 4, device="meta")), ValueError, "one device"),
    "gmm/groups_short": Case(_gmm(group_list=[2, 4]), ValueError, "group_list must have one entry per expert"),
    "gmm/groups_long": Case(_gmm(group_list=[2, 0, 4, 0]), ValueError, "group_list must have one entry per expert"),
    "gmm/groups_negative": Case(_gmm(group_list=[3, -1, 4]), ValueError, "group_list"),
    "gmm/groups_above_m": Case(_gmm(group_list=[7, -1, 0]), ValueError, "group_list"),
    "gmm/groups_overflow_list": Case(_gmm(weight=_t(4, 8, 4), group_list=WRAPPING), ValueError, "group_list"),
    "gmm/groups_overflow_tensor": Case(
        _gmm(weight=_t(4, 8, 4), group_list=lambda: torch.tensor(WRAPPING)), ValueError, "group_list"
    ),
    "gmm/groups_overflow_cumsum": Case(
        _gmm(group_list=[BIG, -BIG, 6], group_list_type="cumsum"), ValueError, "group_list"
    ),
    "gmm/groups_overflow_int32": Case(
        _gmm(group_list=lambda: torch.tensor([2**31 - 1, 2**31 - 1, 8], dtype=torch.int32)), ValueError, "group_list"
    ),
    "gmm/groups_beyond_int64": Case(_gmm(group_list=[2**64, 0, 6]), ValueError, "group_list"),
    "gmm/groups_sum_small": Case(_gmm(group_list=[2, 0, 3]), ValueError, "sum(group_list)"),
    "gmm/groups_sum_large": Case(_gmm(group_list=[2, 0, 5]), ValueError, "sum(group_list)"),
    "gmm/groups_float_tensor": Case(_gmm(group_list=lambda: torch.tensor([2.0, 0.0, 4.0])), TypeError, "group_list"),
    "gmm/groups_bool_tensor": Case(_gmm(group_list=lambda: torch.tensor([True, False, True])), TypeError, "group_list"),
    "gmm/groups_uint8_tensor": Case(
        _gmm(group_list=lambda: torch.tensor([2, 0, 4], dtype=torch.uint8)), TypeError, "group_list"
    ),
    "gmm/groups_int16_tensor": Case(
        _gmm(group_list=lambda: torch.tensor([2, 0, 4], dtype=torch.int16)), TypeError, "group_list"
    ),
    "gmm/groups_float_item": Case(_gmm(group_list=[2, 0.0, 4]), TypeError, "group_list[1]"),
    "gmm/groups_bool_item": Case(_gmm(group_list=[2, True, 4]), TypeError, "group_list[1]"),
    "gmm/groups_none_item": Case(_gmm(group_list=[2, None, 4]), TypeError, "group_list[1]"),
    "gmm/groups_2d": Case(_gmm(group_list=lambda: torch.tensor([[2, 0, 4]])), ValueError, "group_list must be 1-D"),
    "gmm/groups_0d": Case(_gmm(group_list=lambda: torch.tensor(6)), ValueError, "group_list must be 1-D"),
    "gmm/groups_str": Case(_gmm(group_list="204"), TypeError, "group_list"),
    "gmm/groups_none": Case(_gmm(group_list=None), TypeError, "group_list"),
    "gmm/groups_dict": Case(_gmm(group_list={0: 2, 1: 0, 2: 4}), TypeError, "group_list"),
    "gmm/groups_on_meta": Case(
        _gmm(group_list=lambda: torch.tensor([2, 0, 4], device="meta")), ValueError, "group_list must be on"
    ),
    "gmm/group_list_type_bad": Case(_gmm(group_list_type="counts"), ValueError, "group_list_type"),
    "gmm/group_list_type_none": Case(_gmm(group_list_type=None), ValueError, "group_list_type"),
    "gmm/cumsum_decreasing": Case(_gmm(group_list=[4, 2, 6], group_list_type="cumsum"), ValueError, "group_list"),
    "gmm/cumsum_negative": Case(_gmm(group_list=[-1, 2, 6], group_list_type="cumsum"), ValueError, "group_list"),
    "gmm/cumsum_end": Case(_gmm(group_list=[2, 2, 5], group_list_type="cumsum"), ValueError, "group_list[-1]"),
    "gmm/cumsum_above_m": Case(_gmm(group_list=[2, 9, 6], group_list_type="cumsum"), ValueError, "group_list"),
    "gmm/unchecked_sum": Case(_gmm(group_list=[2, 0, 3], validate=False), ValueError, "group_list"),
    "gmm/unchecked_negative": Case(_gmm(group_list=[7, -1, 0], validate=False), ValueError, "group_list"),
    "gmm/unchecked_overflow": Case(
        _gmm(weight=_t(4, 8, 4), group_list=WRAPPING, validate=False), ValueError, "group_list"
    ),
    "gmm/unchecked_cumsum": Case(
        _gmm(group_list=[4, 2, 6], group_list_type="cumsum", validate=False), ValueError, "group_list"
    ),
    "gmm/unchecked_sum_eager": Case(
        _gmm(group_list=[2, 0, 3], validate=False, backend="eager"), ValueError, "group_list"
    ),
    "gmm/unchecked_sum_torch": Case(
        _gmm(x=_t(6, 16), weight=_t(3, 16, 16), group_list=[2, 0, 3], validate=False, backend="torch"),
        ValueError,
        "group_list",
    ),
    "gmm/validate_str": Case(_gmm(validate="no"), TypeError, "validate"),
    "gmm/fused_str": Case(_gmm(fused="yes"), TypeError, "fused"),
    "gmm/fused_int": Case(_gmm(fused=1), TypeError, "fused"),
    "gmm/backend_unknown": Case(_gmm(backend="cutlass"), ValueError, "backend='cutlass'"),
    "gmm/backend_int": Case(_gmm(backend=3), TypeError, "backend"),
    "gmm/backend_conflict": Case(_gmm(fused=False, backend="cpu"), ValueError, "backend='cpu'"),
    "gmm/backend_refuses_fp64": Case(
        _gmm(x=_t(6, 8, dtype=torch.float64), weight=_t(3, 8, 4, dtype=torch.float64), backend="torch"),
        ValueError,
        "backend='torch'",
    ),
}


# ---- permute: hidden [4, 3], ids [4, 2] in [0, 3), E = 3 ---------------------------------------------


def _ids(*, dtype=torch.int64, poke=None):
    def make():
        ids = torch.tensor([[0, 1], [2, 0], [1, 1], [2, 2]], dtype=dtype)
        if poke is not None:
            ids[poke[0], poke[1]] = poke[2]
        return ids

    return make


def _permute(hidden=None, ids=None, num_experts=3, **kwargs) -> Callable[[], object]:
    def call():
        h = torch.randn(4, 3, requires_grad=True) if hidden is None else hidden()
        selected = _ids()() if ids is None else ids()
        out, _, counts = permute(h, selected, num_experts, **kwargs)
        if out.requires_grad:
            out.sum().backward()
        return tuple(out.shape), tuple(counts.tolist())

    return call


PERMUTE_CASES = {
    "permute/hidden_list": Case(_permute(hidden=lambda: [[0.0] * 3] * 4), TypeError, "hidden_TH"),
    "permute/hidden_int": Case(_permute(hidden=_t(4, 3, dtype=torch.int64)), TypeError, "hidden_TH"),
    "permute/hidden_1d": Case(_permute(hidden=_t(12)), ValueError, "hidden_TH"),
    "permute/hidden_3d": Case(_permute(hidden=_t(4, 3, 1)), ValueError, "hidden_TH"),
    "permute/ids_float": Case(_permute(ids=lambda: _ids()().float()), TypeError, "selected_experts_Tk"),
    "permute/ids_bool": Case(_permute(ids=lambda: _ids()() > 0), TypeError, "selected_experts_Tk"),
    "permute/ids_int16": Case(_permute(ids=_ids(dtype=torch.int16)), TypeError, "selected_experts_Tk"),
    "permute/ids_uint8": Case(_permute(ids=_ids(dtype=torch.uint8)), TypeError, "selected_experts_Tk"),
    "permute/ids_1d": Case(_permute(ids=lambda: _ids()().reshape(-1)), ValueError, "selected_experts_Tk"),
    "permute/ids_3d": Case(_permute(ids=lambda: _ids()().unsqueeze(-1)), ValueError, "selected_experts_Tk"),
    "permute/ids_t_mismatch": Case(_permute(ids=lambda: _ids()()[:3]), ValueError, "selected_experts_Tk.shape[0]"),
    "permute/ids_k0": Case(_permute(ids=lambda: _ids()()[:, :0]), ValueError, "selected_experts_Tk"),
    "permute/ids_equal_e": Case(_permute(ids=_ids(poke=(1, 0, 3))), ValueError, "selected_experts_Tk"),
    "permute/ids_negative": Case(_permute(ids=_ids(poke=(2, 1, -1))), ValueError, "selected_experts_Tk"),
    "permute/ids_huge": Case(_permute(ids=_ids(poke=(0, 0, BIG))), ValueError, "selected_experts_Tk"),
    "permute/ids_int32_max": Case(
        _permute(ids=_ids(dtype=torch.int32, poke=(3, 1, 2**31 - 1))), ValueError, "selected"
    ),
    "permute/ids_int64_min": Case(_permute(ids=_ids(poke=(3, 0, -(2**63)))), ValueError, "selected_experts_Tk"),
    "permute/ids_on_meta": Case(_permute(ids=lambda: _ids()().to("meta")), ValueError, "selected_experts_Tk"),
    "permute/unchecked_equal_e": Case(_permute(ids=_ids(poke=(1, 0, 3)), validate=False), ValueError, "expert"),
    "permute/unchecked_negative": Case(_permute(ids=_ids(poke=(1, 0, -1)), validate=False), ValueError, "expert"),
    "permute/unchecked_fp64": Case(
        _permute(hidden=lambda: torch.randn(4, 3, dtype=torch.float64), ids=_ids(poke=(1, 0, 7)), validate=False),
        ValueError,
        "selected_experts_Tk",
    ),
    "permute/e_zero": Case(_permute(num_experts=0), ValueError, "num_experts"),
    "permute/e_negative": Case(_permute(num_experts=-1), ValueError, "num_experts"),
    "permute/e_float": Case(_permute(num_experts=3.0), TypeError, "num_experts"),
    "permute/e_bool": Case(_permute(num_experts=True), TypeError, "num_experts"),
    "permute/e_none": Case(_permute(num_experts=None), TypeError, "num_experts"),
    "permute/e_str": Case(_permute(num_experts="3"), TypeError, "num_experts"),
    "permute/e_tensor": Case(_permute(num_experts=torch.tensor(3)), TypeError, "num_experts"),
    "permute/validate_str": Case(_permute(validate="no"), TypeError, "validate"),
}


# ---- unpermute: expert_out [8, 3], row_id_map a permutation of range(8), probs [4, 2] ------------------


def _map(*, dtype=torch.int64, poke=None):
    def make():
        row_id_map = torch.tensor([3, 0, 6, 1, 4, 5, 7, 2], dtype=dtype)
        if poke is not None:
            row_id_map[poke[0]] = poke[1]
        return row_id_map

    return make


def _unpermute(expert_out=None, row_id_map=None, probs=None, **kwargs) -> Callable[[], object]:
    def call():
        y = torch.randn(8, 3, requires_grad=True) if expert_out is None else expert_out()
        m = _map()() if row_id_map is None else row_id_map()
        p = torch.rand(4, 2, requires_grad=True) if probs is None else probs()
        out = unpermute(y, m, p, **kwargs)
        out.sum().backward()
        return tuple(out.shape)

    return call


UNPERMUTE_CASES = {
    "unpermute/out_list": Case(_unpermute(expert_out=lambda: [[0.0] * 3] * 8), TypeError, "expert_out_RH"),
    "unpermute/out_int": Case(_unpermute(expert_out=_t(8, 3, dtype=torch.int32)), TypeError, "expert_out_RH"),
    "unpermute/out_1d": Case(_unpermute(expert_out=_t(24)), ValueError, "expert_out_RH"),
    "unpermute/out_rows": Case(_unpermute(expert_out=_t(6, 3)), ValueError, "expert_out_RH"),
    "unpermute/map_int32": Case(_unpermute(row_id_map=_map(dtype=torch.int32)), TypeError, "row_id_map_R"),
    "unpermute/map_float": Case(_unpermute(row_id_map=lambda: _map()().float()), TypeError, "row_id_map_R"),
    "unpermute/map_2d": Case(_unpermute(row_id_map=lambda: _map()().view(4, 2)), ValueError, "row_id_map_R"),
    "unpermute/map_short": Case(_unpermute(row_id_map=lambda: _map()()[:6]), ValueError, "row_id_map_R"),
    "unpermute/map_minus_one": Case(_unpermute(row_id_map=_map(poke=(3, -1))), ValueError, "row_id_map_R"),
    "unpermute/map_equal_r": Case(_unpermute(row_id_map=_map(poke=(3, 8))), ValueError, "row_id_map_R"),
    "unpermute/map_million": Case(_unpermute(row_id_map=_map(poke=(3, 10**6))), ValueError, "row_id_map_R"),
    "unpermute/map_int64_min": Case(_unpermute(row_id_map=_map(poke=(0, -(2**63)))), ValueError, "row_id_map_R"),
    "unpermute/map_int64_max": Case(_unpermute(row_id_map=_map(poke=(7, 2**63 - 1))), ValueError, "row_id_map_R"),
    "unpermute/map_zeros": Case(_unpermute(row_id_map=lambda: torch.zeros(8, dtype=torch.int64)), ValueError, "row_id"),
    "unpermute/map_repeat": Case(_unpermute(row_id_map=_map(poke=(5, 3))), ValueError, "row_id_map_R"),
    "unpermute/map_on_meta": Case(_unpermute(row_id_map=lambda: _map()().to("meta")), ValueError, "row_id_map_R"),
    "unpermute/unchecked_equal_r": Case(
        _unpermute(row_id_map=_map(poke=(3, 8)), validate=False), ValueError, "row_id_map"
    ),
    "unpermute/unchecked_minus_one": Case(
        _unpermute(row_id_map=_map(poke=(3, -1)), validate=False), ValueError, "row_id_map"
    ),
    "unpermute/unchecked_bf16_million": Case(
        _unpermute(
            expert_out=lambda: torch.randn(8, 3, dtype=torch.bfloat16, requires_grad=True),
            row_id_map=_map(poke=(3, 10**6)),
            validate=False,
        ),
        ValueError,
        "row_id_map",
    ),
    "unpermute/unchecked_fp64_equal_r": Case(
        _unpermute(
            expert_out=lambda: torch.randn(8, 3, dtype=torch.float64), row_id_map=_map(poke=(3, 8)), validate=False
        ),
        IndexError,
        "index out of range",
    ),
    "unpermute/probs_int": Case(_unpermute(probs=_t(4, 2, dtype=torch.int64)), TypeError, "probs_Tk"),
    "unpermute/probs_1d": Case(_unpermute(probs=_t(8)), ValueError, "probs_Tk"),
    "unpermute/probs_3d": Case(_unpermute(probs=_t(4, 2, 1)), ValueError, "probs_Tk"),
    "unpermute/probs_tokens": Case(_unpermute(probs=_t(3, 2)), ValueError, "probs_Tk"),
    "unpermute/probs_k0": Case(_unpermute(probs=_t(4, 0)), ValueError, "probs_Tk"),
    "unpermute/probs_transposed": Case(_unpermute(probs=_t(2, 4), top_k=2), ValueError, "probs_Tk"),
    "unpermute/probs_on_meta": Case(_unpermute(probs=_t(4, 2, device="meta")), ValueError, "probs_Tk"),
    "unpermute/top_k_float": Case(_unpermute(top_k=2.0), TypeError, "top_k"),
    "unpermute/top_k_wrong": Case(_unpermute(top_k=3), ValueError, "top_k"),
    "unpermute/validate_str": Case(_unpermute(validate="no"), TypeError, "validate"),
}


# ---- swiglu -------------------------------------------------------------------------------------------


def _swiglu(x) -> Callable[[], object]:
    return lambda: tuple(swiglu(x() if callable(x) else x).shape)


SWIGLU_CASES = {
    "swiglu/list": Case(_swiglu([1.0, 2.0]), TypeError, "x must be a torch.Tensor"),
    "swiglu/int": Case(_swiglu(_t(4, 6, dtype=torch.int64)), TypeError, "x must have a floating dtype"),
    "swiglu/bool": Case(_swiglu(_t(4, 6, dtype=torch.bool)), TypeError, "x must have a floating dtype"),
    "swiglu/complex": Case(_swiglu(_t(4, 6, dtype=torch.complex64)), TypeError, "x must have a floating dtype"),
    "swiglu/scalar": Case(_swiglu(lambda: torch.tensor(1.0)), ValueError, "x must have an even last dimension"),
    "swiglu/odd": Case(_swiglu(_t(4, 5)), ValueError, "x must have an even last dimension"),
}


# ---- expert_mlp: x [6, 8], group_list [2, 0, 4], gate_up [3, 8, 10], down [3, 5, 8] --------------------


def _mlp(**override) -> Callable[[], object]:
    def call():
        kwargs = {
            "x_RH": torch.randn(6, 8, requires_grad=True),
            "group_list_E": [2, 0, 4],
            "gate_up_EH2I": torch.randn(3, 8, 10, requires_grad=True),
            "down_EIH": torch.randn(3, 5, 8, requires_grad=True),
        }
        kwargs.update({k: v() if callable(v) else v for k, v in override.items()})
        out = expert_mlp(**kwargs)
        out.sum().backward()
        return tuple(out.shape)

    return call


EXPERT_MLP_CASES = {
    "expert_mlp/gate_up_list": Case(_mlp(gate_up_EH2I=[[0.0]]), TypeError, "gate_up_EH2I"),
    "expert_mlp/down_2d": Case(_mlp(down_EIH=_t(5, 8)), ValueError, "down_EIH"),
    "expert_mlp/gate_up_odd": Case(_mlp(gate_up_EH2I=_t(3, 8, 9), down_EIH=_t(3, 4, 8)), ValueError, "gate_up_EH2I"),
    "expert_mlp/down_mismatch": Case(_mlp(down_EIH=_t(3, 4, 8)), ValueError, "down_EIH"),
    "expert_mlp/down_experts": Case(_mlp(down_EIH=_t(2, 5, 8)), ValueError, "down_EIH"),
    "expert_mlp/x_k_mismatch": Case(_mlp(x_RH=_t(6, 7)), ValueError, "x.shape[1] (K)"),
    "expert_mlp/x_int": Case(_mlp(x_RH=_t(6, 8, dtype=torch.int64)), TypeError, "x must have a floating dtype"),
    "expert_mlp/x_bf16": Case(_mlp(x_RH=_t(6, 8, dtype=torch.bfloat16)), TypeError, "share a dtype"),
    "expert_mlp/groups_negative": Case(_mlp(group_list_E=[3, -1, 4]), ValueError, "group_list"),
    "expert_mlp/groups_overflow": Case(
        _mlp(group_list_E=WRAPPING, gate_up_EH2I=_t(4, 8, 10), down_EIH=_t(4, 5, 8)), ValueError, "group_list"
    ),
    "expert_mlp/groups_short": Case(_mlp(group_list_E=[2, 4]), ValueError, "group_list"),
    "expert_mlp/unchecked_sum": Case(_mlp(group_list_E=[2, 0, 3], validate=False), ValueError, "group_list"),
    "expert_mlp/unchecked_overflow": Case(
        _mlp(group_list_E=WRAPPING, gate_up_EH2I=_t(4, 8, 10), down_EIH=_t(4, 5, 8), validate=False),
        ValueError,
        "group_list",
    ),
    "expert_mlp/validate_str": Case(_mlp(validate="no"), TypeError, "validate"),
    "expert_mlp/fused_str": Case(_mlp(fused="no"), TypeError, "fused"),
    "expert_mlp/backend_unknown": Case(_mlp(backend="cutlass"), ValueError, "backend"),
}


# ---- moe_mlp_gather_scatter (the triton kernels; the CPU runs them in Triton's interpreter) -----------


def _gather(**override) -> Callable[[], object]:
    def call():
        from moe_gmm.ops.gather_gmm import moe_mlp_gather_scatter

        kwargs = {
            "hidden_TH": torch.randn(4, 8),
            "selected_experts_Tk": torch.tensor([[0, 1], [2, 0], [1, 1], [2, 2]]),
            "probs_Tk": torch.rand(4, 2),
            "gate_up_EH2I": torch.randn(3, 8, 10),
            "down_EIH": torch.randn(3, 5, 8),
        }
        kwargs.update({k: v() if callable(v) else v for k, v in override.items()})
        return tuple(moe_mlp_gather_scatter(**kwargs).shape)

    return call


GATHER_CASES = {
    "gather_gmm/hidden_list": Case(_gather(hidden_TH=[[0.0] * 8] * 4), TypeError, "hidden_TH"),
    "gather_gmm/hidden_1d": Case(_gather(hidden_TH=_t(32)), ValueError, "hidden_TH"),
    "gather_gmm/hidden_h_mismatch": Case(_gather(hidden_TH=_t(4, 7)), ValueError, "hidden_TH"),
    "gather_gmm/ids_float": Case(_gather(selected_experts_Tk=_t(4, 2)), TypeError, "selected_experts_Tk"),
    "gather_gmm/ids_equal_e": Case(_gather(selected_experts_Tk=_ids(poke=(1, 0, 3))), ValueError, "selected_experts"),
    "gather_gmm/ids_negative": Case(_gather(selected_experts_Tk=_ids(poke=(1, 0, -1))), ValueError, "selected_experts"),
    "gather_gmm/unchecked_ids": Case(
        _gather(selected_experts_Tk=_ids(poke=(1, 0, 3)), validate=False), ValueError, "selected_experts_Tk"
    ),
    "gather_gmm/probs_shape": Case(_gather(probs_Tk=_t(2, 4)), ValueError, "probs_Tk"),
    "gather_gmm/probs_1d": Case(_gather(probs_Tk=_t(8)), ValueError, "probs_Tk"),
    "gather_gmm/gate_up_2d": Case(_gather(gate_up_EH2I=_t(8, 10)), ValueError, "gate_up_EH2I"),
    "gather_gmm/down_mismatch": Case(_gather(down_EIH=_t(3, 4, 8)), ValueError, "down_EIH"),
    "gather_gmm/validate_str": Case(_gather(validate="no"), TypeError, "validate"),
}

# ---- the same checks inside torch.compile(fullgraph=True): the ops' bodies check what they index -------


def _compiled(fn: Callable[..., torch.Tensor], *args: Callable[[], object]) -> Callable[[], object]:
    """Compile ``fn`` whole, call it on fresh ``args`` and backpropagate (what a training step does)."""

    def call():
        out = torch.compile(fn, fullgraph=True, backend="aot_eager")(*(a() for a in args))
        out.sum().backward()
        return tuple(out.shape), bool(torch.isnan(out).any())

    return call


def _leaf(*shape) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(*shape, requires_grad=True)


def _groups(values, **kwargs) -> Callable[[], object]:
    def gmm(x, w, groups):
        return grouped_matmul(x, w, groups, **kwargs)

    return _compiled(gmm, _leaf(6, 8), _leaf(3, 8, 4), lambda: torch.tensor(values))


def _compiled_mlp(values, **kwargs) -> Callable[[], object]:
    def mlp(x, gate_up, down, groups):
        return expert_mlp(x, groups, gate_up, down, **kwargs)

    return _compiled(mlp, _leaf(6, 8), _leaf(3, 8, 10), _leaf(3, 5, 8), lambda: torch.tensor(values))


def _compiled_unpermute(poke, **kwargs) -> Callable[[], object]:
    def combine(y, row_id_map, probs):
        return unpermute(y, row_id_map, probs, **kwargs)

    return _compiled(combine, _leaf(8, 3), _map(poke=poke), lambda: torch.rand(4, 2, requires_grad=True))


def _compiled_permute(poke, **kwargs) -> Callable[[], object]:
    def route(hidden, ids):
        return permute(hidden, ids, 3, **kwargs)[0]

    return _compiled(route, _leaf(4, 3), _ids(poke=poke))


COMPILED_CASES = {
    "gmm/compiled_sum_small": Case(_groups([2, 0, 3]), ValueError, "summing to x.shape[0] = 6"),
    "gmm/compiled_sum_large": Case(_groups([2, 0, 5]), ValueError, "summing to x.shape[0] = 6"),
    "gmm/compiled_negative": Case(_groups([3, -1, 4]), ValueError, "group_list"),
    # (2**63 - 1) * 2 + 8 wraps the int64 sum to 6 = M.
    "gmm/compiled_overflow": Case(_groups([2**63 - 1, 2**63 - 1, 8]), ValueError, "group_list"),
    "gmm/compiled_cumsum_decreasing": Case(_groups([4, 2, 6], group_list_type="cumsum"), ValueError, "group_list"),
    "gmm/compiled_unchecked_sum": Case(_groups([2, 0, 3], validate=False), ValueError, "group_list"),
    "expert_mlp/compiled_sum_small": Case(_compiled_mlp([2, 0, 3]), ValueError, "group_list"),
    "expert_mlp/compiled_unchecked_sum_large": Case(_compiled_mlp([2, 0, 5], validate=False), ValueError, "group_list"),
    "unpermute/compiled_map_repeat": Case(
        _compiled_unpermute((5, 3)), ValueError, "row_id_map_R must be a permutation"
    ),
    "unpermute/compiled_map_equal_r": Case(_compiled_unpermute((3, 8)), ValueError, "row_id_map_R"),
    "unpermute/compiled_map_minus_one": Case(_compiled_unpermute((3, -1)), ValueError, "row_id_map_R"),
    "unpermute/compiled_unchecked_equal_r": Case(
        _compiled_unpermute((3, 8), validate=False), ValueError, "row_id_map"
    ),
    "permute/compiled_ids_equal_e": Case(_compiled_permute((1, 0, 3)), ValueError, "expert"),
    "permute/compiled_ids_negative": Case(_compiled_permute((2, 1, -1)), ValueError, "expert"),
}

CASES: dict[str, Case] = {
    **GMM_CASES,
    **PERMUTE_CASES,
    **UNPERMUTE_CASES,
    **SWIGLU_CASES,
    **EXPERT_MLP_CASES,
    **GATHER_CASES,
    **COMPILED_CASES,
}


def run_case(name: str) -> object:
    """The child process's runner: make the hostile call (it should raise)."""
    torch.manual_seed(0)
    return CASES[name].call()


# ---- values that used to fail past the checks: in the allocator, inside Triton, unnamed ------------


def _with_backend_variable(value: str, call: Callable[[], object]) -> Callable[[], object]:
    """``call`` with ``$MOE_GMM_BACKEND`` set to ``value``, restored afterwards (the child lives on)."""

    def run():
        import os

        before = os.environ.get("MOE_GMM_BACKEND")
        os.environ["MOE_GMM_BACKEND"] = value
        try:
            return call()
        finally:
            if before is None:
                del os.environ["MOE_GMM_BACKEND"]
            else:
                os.environ["MOE_GMM_BACKEND"] = before

    return run


BOUNDARY_CASES = {
    "gmm/env_backend_unknown": Case(_with_backend_variable("bogus", _gmm()), ValueError, "$MOE_GMM_BACKEND"),
    "expert_mlp/env_backend_unknown": Case(_with_backend_variable("bogus", _mlp()), ValueError, "$MOE_GMM_BACKEND"),
    "permute/e_2_40": Case(_permute(num_experts=2**40), ValueError, "num_experts"),
    "gather_gmm/hidden_fp32_weights_bf16": Case(
        _gather(gate_up_EH2I=_t(3, 8, 10, dtype=torch.bfloat16), down_EIH=_t(3, 5, 8, dtype=torch.bfloat16)),
        TypeError,
        "hidden_TH",
    ),
    "gather_gmm/down_fp16": Case(_gather(down_EIH=_t(3, 5, 8, dtype=torch.float16)), TypeError, "down_EIH"),
}
CASES.update(BOUNDARY_CASES)
