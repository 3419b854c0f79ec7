"""Random hostile input to permute / unpermute / grouped_matmul / expert_mlp: an exception every time, never a signal.

Each example is built here with an oracle (valid, or which exceptions an invalid one may raise) and
run forward and backward in one long-lived child process (:mod:`tests.helpers.op_worker`), so a
segfault or an abort is seen as a failed example. Invalid examples must raise ``ValueError`` or
``TypeError`` (``IndexError`` only where documented: unpermute's torch path with
``validate=False``); valid ones must return results of the right shapes, all finite.
"""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_gmm.ops import native
from tests.helpers.op_worker import OpWorker

EXAMPLES_PER_OP = 150  # x 4 ops: 600 examples per run
FUZZ = settings(max_examples=EXAMPLES_PER_OP, deadline=None, suppress_health_check=[HealthCheck.too_slow])
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
BOUNDARY = ("ValueError", "TypeError")


@pytest.fixture(scope="module")
def worker():
    native.available()  # build the native kernels here once, not inside the child's first example
    w = OpWorker("tests.helpers.fuzz_calls:run_spec")
    yield w
    w.close()


def _check(worker: OpWorker, spec: dict, expected) -> None:
    outcome = worker.run(spec)
    if isinstance(expected, tuple) and expected and expected[0] == "raises":
        allowed = expected[1]
        assert outcome.kind == "raised" and any(name in outcome.exc_types for name in allowed), (
            f"invalid input must raise one of {allowed}, but the call {outcome.describe()}\n{spec}"
        )
    else:
        assert outcome.kind == "returned", f"valid input must run, but the call {outcome.describe()}\n{spec}"
        assert outcome.value == expected, f"valid input gave {outcome.value}, expected {expected}\n{spec}"


def _corrupt_positions(draw, size: int, bad_values: list[int], most: int = 2) -> dict[int, int]:
    if size == 0:
        return {}
    count = draw(st.integers(0, most))
    return {draw(st.integers(0, size - 1)): draw(st.sampled_from(bad_values)) for _ in range(count)}


# ---- permute ---------------------------------------------------------------------------------------


@st.composite
def permute_examples(draw):
    tokens, top_k, experts, hidden = draw(st.integers(0, 6)), draw(st.integers(1, 3)), draw(st.integers(1, 5)), 3
    id_dtype = draw(st.sampled_from(["int32", "int64"]))
    limit = 2**31 if id_dtype == "int32" else 2**63
    ids = draw(st.lists(st.integers(0, experts - 1), min_size=tokens * top_k, max_size=tokens * top_k))
    for pos, value in _corrupt_positions(draw, len(ids), [-1, experts, experts + 1, limit - 1, -limit, 2**30]).items():
        ids[pos] = value
    spec = {
        "op": "permute", "dtype": draw(st.sampled_from(["float32", "bfloat16", "float64"])),
        "hidden_shape": (tokens, hidden), "ids": ids, "ids_shape": (tokens, top_k), "id_dtype": id_dtype,
        "num_experts": experts, "validate": draw(st.booleans()),
    }  # fmt: skip
    flaw = draw(st.sampled_from(["none"] * 4 + ["hidden_rank", "ids_float", "t_mismatch", "num_experts", "k0"]))
    if flaw == "hidden_rank":
        spec["hidden_shape"] = (tokens, hidden, 1)
    elif flaw == "ids_float":
        spec["id_dtype"] = "float32"
    elif flaw == "t_mismatch":
        spec["hidden_shape"] = (tokens + 1, hidden)
    elif flaw == "num_experts":
        spec["num_experts"] = draw(st.sampled_from([0, -1, 2.5, True, None, "3"]))
    elif flaw == "k0":
        spec["ids"], spec["ids_shape"] = [], (tokens, 0)
    bad_ids = any(not 0 <= i < experts for i in spec["ids"])
    if flaw != "none" or bad_ids:
        return spec, ("raises", BOUNDARY)
    rows = tokens * top_k
    counts = tuple(sum(1 for i in ids if i == e) for e in range(experts))
    return spec, ((rows, hidden), (tokens, hidden), True, counts, list(range(rows)))


@FUZZ
@given(example=permute_examples())
def test_permute_fuzz(worker, example):
    _check(worker, *example)


# ---- unpermute -------------------------------------------------------------------------------------


@st.composite
def unpermute_examples(draw):
    tokens, top_k, hidden = draw(st.integers(0, 5)), draw(st.integers(1, 3)), 3
    rows = tokens * top_k
    dtype = draw(st.sampled_from(["float32", "bfloat16", "float64"]))
    validate = draw(st.booleans())
    spec = {
        "op": "unpermute", "dtype": dtype, "expert_out_shape": (rows, hidden), "probs_shape": (tokens, top_k),
        "probs_dtype": draw(st.sampled_from(["float32", "bfloat16"])), "map_dtype": "int64",
        "row_id_map": list(draw(st.permutations(range(rows)))), "validate": validate,
        "top_k": draw(st.sampled_from([None, top_k])),
    }  # fmt: skip
    flaws = ["none"] * 3 + ["out_of_range", "probs_numel", "expert_rows", "map_int32", "top_k_wrong"]
    if validate:  # without validation a repeated in-range value is the caller's promise, documented as unchecked
        flaws.append("repeat")
    if tokens != top_k:
        flaws.append("probs_transposed")
    flaw = draw(st.sampled_from(flaws))
    allowed = BOUNDARY
    if flaw == "out_of_range" and rows > 0:
        bad = [-1, rows, rows + 1, 10**6, INT64_MIN, INT64_MAX]
        for pos, value in _corrupt_positions(draw, rows, bad, most=3).items():
            spec["row_id_map"][pos] = value
        if not validate and dtype == "float64":  # the torch path's index_select: documented IndexError
            allowed = (*BOUNDARY, "IndexError")
    elif flaw == "repeat" and rows > 1:
        src, dst = draw(st.permutations(range(rows)))[:2]
        spec["row_id_map"][dst] = spec["row_id_map"][src]
    elif flaw == "probs_numel":
        spec["probs_shape"] = (tokens + 1, top_k)
    elif flaw == "expert_rows":
        spec["expert_out_shape"] = (rows + 1, hidden)
    elif flaw == "map_int32":
        spec["map_dtype"] = "int32"
    elif flaw == "top_k_wrong":
        spec["top_k"] = top_k + 1
    elif flaw == "probs_transposed":
        spec["probs_shape"], spec["top_k"] = (top_k, tokens), top_k
    valid = sorted(spec["row_id_map"]) == list(range(rows)) and flaw in ("none", "out_of_range", "repeat")
    if not valid:
        return spec, ("raises", allowed)
    return spec, ((tokens, hidden), (rows, hidden), (tokens, top_k), True)


@FUZZ
@given(example=unpermute_examples())
def test_unpermute_fuzz(worker, example):
    _check(worker, *example)


# ---- group lists (grouped_matmul, expert_mlp) ---------------------------------------------------------


def _flawed_group_list(draw, counts: list[int], group_list_type: str) -> tuple[list[int], str, bool]:
    """``(values, form, valid)``: ``counts`` as the group list, perhaps made wrong in one way."""
    counts = list(counts)
    num_rows, num_experts = sum(counts), len(counts)
    flaw = draw(st.sampled_from(["none"] * 3 + ["negative", "above_m", "huge", "wrap", "wrong_sum", "length"]))
    if flaw == "negative":
        i = draw(st.integers(0, num_experts - 1))
        shift = counts[i] + draw(st.integers(1, 3))
        counts[i] -= shift
        if num_experts > 1:  # keep the total right: only the per-count check can tell
            counts[(i + 1) % num_experts] += shift
    elif flaw == "above_m" and num_experts > 1:
        counts[0] += num_rows + 1
        counts[1] -= num_rows + 1
    elif flaw == "huge":
        counts[draw(st.integers(0, num_experts - 1))] = draw(st.sampled_from([2**62, INT64_MAX, 2**64, -(2**62)]))
    elif flaw == "wrap" and num_experts >= 4:  # int64 sum wraps around to M (the case)
        counts = [2**62] * 3 + [2**62 + num_rows] + [0] * (num_experts - 4)
    elif flaw == "wrong_sum":
        i = draw(st.integers(0, num_experts - 1))
        counts[i] += draw(st.sampled_from([-3, -2, -1, 1, 2, 3]))
    elif flaw == "length":
        counts = counts + [0] if num_experts == 1 or draw(st.booleans()) else counts[:-1]
    values = list(itertools.accumulate(counts)) if group_list_type == "cumsum" else counts
    valid = counts == [max(c, 0) for c in counts] and sum(counts) == num_rows and len(counts) == num_experts
    valid = valid and all(c <= num_rows for c in counts)
    form = draw(st.sampled_from(["list", "int64", "int32", "float32"] if valid else ["list", "int64", "int32"]))
    if form == "int32" and not all(-(2**31) <= v < 2**31 for v in values):
        form = "int64"
    if form == "int64" and not all(INT64_MIN <= v <= INT64_MAX for v in values):
        form = "list"
    return values, form, valid and form != "float32"


@st.composite
def grouped_matmul_examples(draw):
    backend = draw(st.sampled_from([None, "eager", "cpu", "torch"]))
    widths = st.sampled_from([0, 8, 16]) if backend == "torch" else st.integers(0, 6)
    k, n = draw(widths), draw(widths)
    counts = draw(st.lists(st.integers(0, 4), min_size=1, max_size=5))
    group_list_type = draw(st.sampled_from(["count", "cumsum"]))
    values, form, valid = _flawed_group_list(draw, counts, group_list_type)
    num_rows, num_experts = sum(counts), len(counts)
    spec = {
        "op": "grouped_matmul", "dtype": draw(st.sampled_from(["float32", "bfloat16"])), "num_rows": num_rows,
        "k": k, "weight_shape": (num_experts, k, n), "group_list": values, "group_list_form": form,
        "group_list_type": group_list_type, "backend": backend, "validate": draw(st.booleans()),
    }  # fmt: skip
    if draw(st.integers(0, 9)) == 0:
        spec["weight_shape"], valid = (num_experts, k + 1, n), False
    if not valid:
        return spec, ("raises", BOUNDARY)
    return spec, ((num_rows, n), (num_rows, k), (num_experts, k, n), True)


@FUZZ
@given(example=grouped_matmul_examples())
def test_grouped_matmul_fuzz(worker, example):
    _check(worker, *example)


@st.composite
def expert_mlp_examples(draw):
    hidden, inter = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(0, 3), min_size=1, max_size=4))
    group_list_type = draw(st.sampled_from(["count", "cumsum"]))
    values, form, valid = _flawed_group_list(draw, counts, group_list_type)
    num_rows, num_experts = sum(counts), len(counts)
    spec = {
        "op": "expert_mlp", "dtype": draw(st.sampled_from(["float32", "bfloat16"])), "num_rows": num_rows,
        "hidden": hidden, "gate_up_shape": (num_experts, hidden, 2 * inter), "down_shape": (num_experts, inter, hidden),
        "group_list": values, "group_list_form": form, "group_list_type": group_list_type,
        "validate": draw(st.booleans()),
    }  # fmt: skip
    flaw = draw(st.sampled_from(["none"] * 6 + ["gate_up_odd", "down_mismatch", "x_width"]))
    if flaw == "gate_up_odd":
        spec["gate_up_shape"] = (num_experts, hidden, 2 * inter + 1)
    elif flaw == "down_mismatch":
        spec["down_shape"] = (num_experts, inter + 1, hidden)
    elif flaw == "x_width":
        spec["hidden"] = hidden + 1
    if flaw != "none" or not valid:
        return spec, ("raises", BOUNDARY)
    shapes = ((num_rows, hidden), (num_rows, hidden), spec["gate_up_shape"], spec["down_shape"])
    return spec, (*shapes, True)


@FUZZ
@given(example=expert_mlp_examples())
def test_expert_mlp_fuzz(worker, example):
    _check(worker, *example)


def test_the_worker_reports_a_signal_as_a_death(worker):
    # The harness itself: a child that crashes is seen as one, and the next call gets a fresh child.
    outcome = worker.run({"op": "crash"})
    assert outcome.kind == "died" and outcome.exit_code is not None and outcome.exit_code < 0, outcome.describe()
    starts = worker.starts
    assert worker.run({"op": "permute", "dtype": "float32", "hidden_shape": (1, 2), "ids": [0], "ids_shape": (1, 1),
                       "id_dtype": "int64", "num_experts": 1, "validate": True}).kind == "returned"  # fmt: skip
    assert worker.starts == starts + 1
