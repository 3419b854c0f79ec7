"""The value checks run inside the custom ops, so a ``torch.compile(fullgraph=True)`` graph keeps them.

Each bad input goes through the eager call and the compiled one: both must raise the same exception
class with a message naming the argument (no output, so no NaN row, escapes). Good inputs give
eager's results, and new group sizes or maps never recompile, bad calls in between included.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_gmm import expert_mlp, grouped_matmul, permute, unpermute
from moe_gmm.ops.grouped_matmul import _grad_input_op, _grad_weight_op, _grouped_matmul_op
from tests.helpers.gmm_cases import cpu_backend_names

M, K, N = 6, 16, 16
WRAPPING = [2**62, 2**62, 2**62 + 6]  # each far above M; the int64 cumsum wraps, ending at 6 = M + 2**64

BAD_GROUPS = {
    # name: (group_list, group_list_type)
    "sum_small": ([2, 0, 3], "count"),
    "sum_large": ([2, 0, 5], "count"),
    "negative": ([3, -1, 4], "count"),
    "above_m": ([7, -1, 0], "count"),
    "wrapping": (WRAPPING, "count"),
    "cumsum_decreasing": ([4, 2, 6], "cumsum"),
    "cumsum_short": ([2, 2, 5], "cumsum"),
}
GOOD_GROUPS = [[2, 0, 4], [6, 0, 0], [0, 0, 6], [1, 2, 3]]


def _outcome(call: Callable[[], torch.Tensor]) -> tuple[type[BaseException] | None, str]:
    """``(exception class, message)`` of ``call``, or ``(None, "")`` after checking its output is finite."""
    try:
        out = call()
    except (ValueError, TypeError, IndexError, RuntimeError) as err:
        return type(err), str(err)
    assert bool(torch.isfinite(out).all()), "a bad input returned non-finite values"
    return None, ""


def _assert_same_refusal(eager: Callable[[], torch.Tensor], compiled: Callable[[], torch.Tensor], names: str) -> None:
    want, eager_message = _outcome(eager)
    got, message = _outcome(compiled)
    assert want is ValueError and names in eager_message, eager_message
    assert got is want, f"compiled raised {got} ({message}), eager {want} ({eager_message})"
    assert names in message, message


def _gmm_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(M, K, generator=g), torch.randn(3, K, N, generator=g) / K**0.5


@pytest.mark.parametrize("backend", cpu_backend_names())
@pytest.mark.parametrize("validate", [True, False])
def test_grouped_matmul_refuses_bad_groups_compiled_as_in_eager(backend, validate):
    torch._dynamo.reset()
    x, w = _gmm_inputs()

    def gmm(x_, w_, groups, kind):
        return grouped_matmul(x_, w_, groups, group_list_type=kind, backend=backend, validate=validate)

    compiled = torch.compile(gmm, fullgraph=True, backend="aot_eager")
    for groups, kind in BAD_GROUPS.values():
        bad = torch.tensor(groups)
        _assert_same_refusal(lambda: gmm(x, w, bad, kind), lambda: compiled(x, w, bad, kind), "group_list")


def test_good_groups_give_eager_results_without_recompiling():
    torch._dynamo.reset()
    x, w = _gmm_inputs(1)
    counter = torch._dynamo.testing.CompileCounter()  # runs the captured graph: the ops' bodies run
    compiled = torch.compile(lambda a, b, gl: grouped_matmul(a, b, gl), fullgraph=True, backend=counter)
    bad = [torch.tensor(g) for g, kind in BAD_GROUPS.values() if kind == "count"]
    for i, groups in enumerate(GOOD_GROUPS):
        torch.testing.assert_close(
            compiled(x, w, torch.tensor(groups)), grouped_matmul(x, w, groups, fused=False), rtol=1e-5, atol=1e-5
        )
        with pytest.raises(ValueError, match="group_list"):
            compiled(x, w, bad[i % len(bad)])
    assert counter.frame_count == 1


def test_compiled_forward_and_backward_match_eager():
    torch._dynamo.reset()
    x, w = _gmm_inputs(2)

    def loss(a, b, gl):
        return grouped_matmul(a, b, gl).square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    for groups in GOOD_GROUPS:
        grads = []
        for fn in (loss, compiled):
            leaves = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
            fn(*leaves, torch.tensor(groups)).backward()
            grads.append([t.grad for t in leaves])
        for eager_grad, compiled_grad in zip(*grads):
            torch.testing.assert_close(compiled_grad, eager_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(BAD_GROUPS))
def test_every_custom_op_refuses_row_ends_that_do_not_tile_the_rows(name):
    """The gradient ops too: each indexes memory by the row ends it is given."""
    groups, kind = BAD_GROUPS[name]
    values = torch.tensor(groups)
    ends = values.cumsum(0) if kind == "count" else values
    x, w = _gmm_inputs()
    dy = torch.randn(M, N)
    for call in (
        lambda: _grouped_matmul_op(x, w, ends, "eager"),
        lambda: _grad_input_op(dy, w, ends, "eager"),
        lambda: _grad_weight_op(x, dy, ends, "eager"),
    ):
        with pytest.raises(ValueError, match=rf"group_list must be counts >= 0 summing to x.shape\[0\] = {M} "):
            call()


def test_the_op_message_shows_the_row_ends_and_the_first_problem():
    x, w = _gmm_inputs()
    with pytest.raises(ValueError, match=r"row ends are \[3, 2, 6\]: group 1 ends at row 2, before row 3$"):
        _grouped_matmul_op(x, w, torch.tensor([3, 2, 6]), "eager")
    with pytest.raises(ValueError, match=r"row ends are \[2, 2, 5\]: the last group ends at row 5$"):
        _grouped_matmul_op(x, w, torch.tensor([2, 2, 5]), "eager")


@pytest.mark.parametrize("validate", [True, False])
def test_expert_mlp_refuses_bad_groups_compiled_as_in_eager(validate):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    x, gate_up = torch.randn(M, 8, generator=g), torch.randn(3, 8, 10, generator=g)
    down = torch.randn(3, 5, 8, generator=g)

    def mlp(x_, groups):
        return expert_mlp(x_, groups, gate_up, down, validate=validate)

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")
    for groups, kind in BAD_GROUPS.values():
        if kind == "count":
            bad = torch.tensor(groups)
            _assert_same_refusal(lambda: mlp(x, bad), lambda: compiled(x, bad), "group_list")
    good = torch.tensor([2, 0, 4])
    torch.testing.assert_close(compiled(x, good), mlp(x, good), rtol=1e-6, atol=1e-6)


# ---- permute / unpermute: T = 4 tokens, k = 2, H = 3, E = 3 ------------------------------------------

MAP = [3, 0, 6, 1, 4, 5, 7, 2]
BAD_MAPS = {
    # name: (row_id_map, message fragment in both)
    "repeated_row": ([3, 0, 6, 1, 4, 3, 7, 2], "row_id_map_R must be a permutation"),
    "row_equal_r": ([3, 0, 6, 1, 4, 8, 7, 2], "row_id_map_R values must lie in [0, R = 8)"),
    "row_negative": ([3, 0, 6, -1, 4, 5, 7, 2], "row_id_map_R values must lie in [0, R = 8)"),
    "all_zero": ([0] * 8, "row_id_map_R must be a permutation"),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_unpermute_refuses_bad_maps_compiled_as_in_eager(dtype):
    """float32 runs the native kernels on CPU, float64 the torch path: both get the op's check."""
    torch._dynamo.reset()
    y = torch.randn(8, 3, dtype=dtype)
    probs = torch.rand(4, 2)
    compiled = torch.compile(lambda y_, m, p: unpermute(y_, m, p), fullgraph=True, backend="aot_eager")
    for row_id_map, names in BAD_MAPS.values():
        bad = torch.tensor(row_id_map)
        _assert_same_refusal(lambda: unpermute(y, bad, probs), lambda: compiled(y, bad, probs), names)
    good = torch.tensor(MAP)
    torch.testing.assert_close(compiled(y, good, probs), unpermute(y, good, probs), rtol=0, atol=0)


def test_unpermute_without_validation_behaves_the_same_compiled():
    """validate=False: a repeated row is the caller's promise broken (not checked, in either); a row out
    of range is still refused by the kernels, with the same class compiled and eager."""
    torch._dynamo.reset()
    y, probs = torch.randn(8, 3), torch.rand(4, 2)
    eager = lambda y_, m, p: unpermute(y_, m, p, validate=False)  # noqa: E731
    compiled = torch.compile(eager, fullgraph=True, backend="aot_eager")
    out_of_range = torch.tensor(BAD_MAPS["row_equal_r"][0])
    _assert_same_refusal(lambda: eager(y, out_of_range, probs), lambda: compiled(y, out_of_range, probs), "row_id_map")
    repeated = torch.tensor(BAD_MAPS["repeated_row"][0])
    torch.testing.assert_close(compiled(y, repeated, probs), eager(y, repeated, probs), rtol=0, atol=0)


def test_permute_then_unpermute_compiled_matches_eager_and_never_recompiles():
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounter()

    def layer(h, ids, p):
        permuted, row_id_map, _ = permute(h, ids, 3)
        return unpermute(permuted * 2.0, row_id_map, p)

    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    g = torch.Generator().manual_seed(4)
    h, probs = torch.randn(4, 3, generator=g), torch.rand(4, 2, generator=g)
    for seed in range(3):
        ids = torch.randint(0, 3, (4, 2), generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(compiled(h, ids, probs), layer(h, ids, probs), rtol=0, atol=0)
        bad_ids = ids.clone()
        bad_ids[seed, 1] = 3  # == E
        _assert_same_refusal(lambda: layer(h, bad_ids, probs), lambda: compiled(h, bad_ids, probs), "expert")
    assert counter.frame_count == 1
