"""Bad input to ``grouped_matmul`` raises a clear error naming the argument, never a wrong answer."""

from __future__ import annotations

import pytest
import torch

from moe_gmm import grouped_matmul


def _ok():
    return torch.randn(6, 8), torch.randn(3, 8, 4), [2, 0, 4]


BAD_INPUTS = {
    # name: (kwargs override, exception, message fragment)
    "x_not_tensor": (dict(x=[[1.0]]), TypeError, "x must be a torch.Tensor"),
    "weight_not_tensor": (dict(weight=3.0), TypeError, "weight must be a torch.Tensor"),
    "x_rank": (dict(x=torch.randn(6, 8, 1)), ValueError, r"x must be 2-D"),
    "weight_rank": (dict(weight=torch.randn(8, 4)), ValueError, r"weight must be 3-D"),
    "k_mismatch": (dict(weight=torch.randn(3, 7, 4)), ValueError, r"x.shape\[1\] \(K\)"),
    "no_experts": (dict(weight=torch.randn(0, 8, 4), group_list=[]), ValueError, "at least one expert"),
    "int_x": (dict(x=torch.ones(6, 8, dtype=torch.int64)), TypeError, "x must have a floating dtype"),
    "dtype_mismatch": (dict(weight=torch.randn(3, 8, 4, dtype=torch.float64)), TypeError, "share a dtype"),
    "too_few_groups": (dict(group_list=[2, 4]), ValueError, r"group_list must have one entry per expert.*got 2"),
    "too_many_groups": (dict(group_list=[2, 0, 4, 0]), ValueError, "group_list must have one entry per expert"),
    "negative_count": (dict(group_list=[3, -1, 4]), ValueError, r"group_list counts must lie in \[0, x.shape\[0\] = 6\].*group_list\[1\] = -1"),
    "count_above_m": ({"group_list": [7, -1, 0]}, ValueError, r"group_list counts must lie in.*group_list\[0\] = 7"),
    # 4 * 2**62 + 6 wraps the int64 sum to 6 = M: each count is checked before summing.
    "overflowing_counts": (
        {"weight": torch.randn(4, 8, 4), "group_list": [2**62] * 3 + [2**62 + 6]}, ValueError, r"group_list\[0\] = 4611686018427387904"),
    "overflowing_tensor_counts": (
        {"weight": torch.randn(4, 8, 4), "group_list": torch.tensor([2**62] * 3 + [2**62 + 6])}, ValueError, "counts must lie in"),
    "count_beyond_int64": ({"group_list": [2**64, 0, 6]}, ValueError, r"group_list\[0\] must lie in"),
    "cumsum_above_m": ({"group_list": [2, 9, 6], "group_list_type": "cumsum"}, ValueError, "non-decreasing"),
    "unchecked_wrong_sum": ({"group_list": [2, 0, 3], "validate": False}, ValueError, r"summing to x.shape\[0\] = 6"),
    "unchecked_negative": ({"group_list": [7, -1, 0], "validate": False}, ValueError, r"row ends are \[7, 6, 6\]"),
    "unchecked_overflow": (
        {"weight": torch.randn(4, 8, 4), "group_list": [2**62] * 3 + [2**62 + 6], "validate": False}, ValueError, "row ends"),
    "validate_not_bool": ({"validate": "no"}, TypeError, "validate must be a bool"),
    "backend_not_str": ({"backend": 3}, TypeError, "backend must be a str or None"),
    "sum_too_small": (dict(group_list=[2, 0, 3]), ValueError, r"sum\(group_list\) must equal x.shape\[0\] = 6, got 5"),
    "sum_too_large": (dict(group_list=[2, 0, 5]), ValueError, r"sum\(group_list\) must equal x.shape\[0\]"),
    "float_tensor_groups": (dict(group_list=torch.tensor([2.0, 0.0, 4.0])), TypeError, "group_list must be an int32 or int64"),
    "bool_tensor_groups": (dict(group_list=torch.tensor([True, False, True])), TypeError, "group_list must be an int32 or int64"),
    "float_in_list": (dict(group_list=[2, 0.0, 4]), TypeError, r"group_list\[1\] must be an int"),
    "bool_in_list": (dict(group_list=[2, True, 4]), TypeError, r"group_list\[1\] must be an int"),
    "2d_groups": (dict(group_list=torch.tensor([[2, 0, 4]])), ValueError, "group_list must be 1-D"),
    "string_groups": (dict(group_list="204"), TypeError, "group_list must be a 1-D integer tensor"),
    "bad_group_list_type": (dict(group_list_type="counts"), ValueError, "group_list_type must be one of"),
    "decreasing_cumsum": (dict(group_list=[4, 2, 6], group_list_type="cumsum"), ValueError, "non-decreasing"),
    "negative_cumsum": (dict(group_list=[-1, 2, 6], group_list_type="cumsum"), ValueError, "start >= 0"),
    "cumsum_wrong_end": (dict(group_list=[2, 2, 5], group_list_type="cumsum"), ValueError, r"group_list\[-1\] must equal"),
    "unknown_backend": (dict(backend="cutlass"), ValueError, r"backend='cutlass' is not a registered backend; registered: \["),
    "fused_not_bool": (dict(fused="yes"), TypeError, "fused must be a bool"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_raises(case):
    override, exc, match = BAD_INPUTS[case]
    x, weight, group_list = _ok()
    kwargs = dict(x=x, weight=weight, group_list=group_list)
    kwargs.update(override)
    with pytest.raises(exc, match=match):
        grouped_matmul(**kwargs)


def test_device_mismatch_is_a_value_error():
    x, _, gl = _ok()
    weight = torch.randn(3, 8, 4, device="meta")
    with pytest.raises(ValueError, match="one device"):
        grouped_matmul(x, weight, gl)


def test_backend_refusal_lists_the_reason_and_alternatives():
    x, w, gl = torch.randn(6, 8, dtype=torch.float64), torch.randn(3, 8, 4, dtype=torch.float64), [2, 0, 4]
    with pytest.raises(ValueError, match=r"backend='torch' cannot run these inputs: dtype float64 not in .*available here"):
        grouped_matmul(x, w, gl, backend="torch")


def test_environment_variable_is_beaten_by_explicit_backend(monkeypatch):
    x, w, gl = _ok()
    monkeypatch.setenv("MOE_GMM_BACKEND", "no_such_backend")
    with pytest.raises(ValueError, match="no_such_backend"):
        grouped_matmul(x, w, gl)
    grouped_matmul(x, w, gl, backend="eager")  # explicit wins, no error
