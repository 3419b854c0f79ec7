"""Build the inputs a fuzz example describes and call the op, in the child of :mod:`tests.helpers.op_worker`.

An example is a plain dict (it crosses a pipe): the op's name and everything needed to build its
inputs. The op runs forward and backward; the result is summarised as shapes and a finiteness flag
so the parent can tell a silent wrong answer from a right one.
"""

from __future__ import annotations

import os

import torch

from moe_gmm.ops import expert_mlp, grouped_matmul, permute, unpermute

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
INDEX_DTYPES = {"int32": torch.int32, "int64": torch.int64, "float32": torch.float32, "int16": torch.int16}


def _index_tensor(values: list[int], dtype: str) -> torch.Tensor:
    return torch.tensor(values, dtype=INDEX_DTYPES[dtype])


def _group_list(spec: dict) -> object:
    values = spec["group_list"]
    return values if spec["group_list_form"] == "list" else _index_tensor(values, spec["group_list_form"])


def _summary(*tensors: torch.Tensor) -> tuple:
    return tuple(tuple(t.shape) for t in tensors) + (all(bool(torch.isfinite(t).all()) for t in tensors),)


def _permute(spec: dict) -> tuple:
    dtype = DTYPES[spec["dtype"]]
    hidden = torch.randn(*spec["hidden_shape"], dtype=torch.float64).to(dtype).requires_grad_(True)
    ids = _index_tensor(spec["ids"], spec["id_dtype"]).reshape(spec["ids_shape"])
    permuted, row_id_map, counts = permute(hidden, ids, spec["num_experts"], validate=spec["validate"])
    permuted.sum().backward()
    return _summary(permuted, hidden.grad) + (tuple(counts.tolist()), sorted(row_id_map.tolist()))


def _unpermute(spec: dict) -> tuple:
    dtype = DTYPES[spec["dtype"]]
    expert_out = torch.randn(*spec["expert_out_shape"], dtype=torch.float64).to(dtype).requires_grad_(True)
    probs = torch.rand(*spec["probs_shape"], dtype=DTYPES[spec["probs_dtype"]]).requires_grad_(True)
    row_id_map = _index_tensor(spec["row_id_map"], spec["map_dtype"])
    kwargs = {"validate": spec["validate"]}
    if spec["top_k"] is not None:
        kwargs["top_k"] = spec["top_k"]
    out = unpermute(expert_out, row_id_map, probs, **kwargs)
    out.sum().backward()
    return _summary(out, expert_out.grad, probs.grad)


def _grouped_matmul(spec: dict) -> tuple:
    dtype = DTYPES[spec["dtype"]]
    x = torch.randn(spec["num_rows"], spec["k"], dtype=torch.float64).to(dtype).requires_grad_(True)
    w = torch.randn(*spec["weight_shape"], dtype=torch.float64).to(dtype).requires_grad_(True)
    y = grouped_matmul(
        x, w, _group_list(spec), group_list_type=spec["group_list_type"], backend=spec["backend"],
        validate=spec["validate"],
    )  # fmt: skip
    y.sum().backward()
    return _summary(y, x.grad, w.grad)


def _expert_mlp(spec: dict) -> tuple:
    dtype = DTYPES[spec["dtype"]]
    x = torch.randn(spec["num_rows"], spec["hidden"], dtype=torch.float64).to(dtype).requires_grad_(True)
    gate_up = torch.randn(*spec["gate_up_shape"], dtype=torch.float64).to(dtype).requires_grad_(True)
    down = torch.randn(*spec["down_shape"], dtype=torch.float64).to(dtype).requires_grad_(True)
    out = expert_mlp(
        x, _group_list(spec), gate_up, down, group_list_type=spec["group_list_type"], validate=spec["validate"]
    )
    out.sum().backward()
    return _summary(out, x.grad, gate_up.grad, down.grad)


def _crash(spec: dict) -> tuple:
    """Dies on a signal, as a memory error in a kernel would: the harness's own test uses it."""
    os.abort()


_OPS = {
    "crash": _crash,
    "permute": _permute,
    "unpermute": _unpermute,
    "grouped_matmul": _grouped_matmul,
    "expert_mlp": _expert_mlp,
}


def run_spec(spec: dict) -> tuple:
    """The child process's runner: one fuzz example, forward and backward."""
    torch.manual_seed(spec.get("seed", 0))
    return _OPS[spec["op"]](spec)
