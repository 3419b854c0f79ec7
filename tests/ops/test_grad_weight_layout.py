"""The weight gradient comes back in the layout of the parameter behind the weight, so autograd's
gradient accumulation takes it as it is: no copy of weight-gradient size after ``loss.backward()``,
``param.grad`` laid out like the parameter, values exact, and exact again when accumulating."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.profiler import profile

from moe_gmm import grouped_matmul
from moe_gmm.testing import assert_rel_close, reference_grouped_matmul_grads, tolerance_for
from tests.helpers.gmm_cases import cpu_backend_names

E, K, N = 4, 32, 48
COUNTS = [5, 0, 17, 10]  # an empty expert and uneven groups
M = sum(COUNTS)


def _padded(w: torch.Tensor, pad: int = 16) -> torch.Tensor:
    """``w``'s values over ``[..., R, C + pad]`` storage: rows a cache line apart more, not dense."""
    storage = torch.zeros(*w.shape[:-1], w.shape[-1] + pad, dtype=w.dtype)
    storage[..., : w.shape[-1]] = w
    return storage[..., : w.shape[-1]]


def _over_transposed(w: torch.Tensor, pad: int = 0) -> torch.Tensor:
    """``w [..., R, C]``'s values over ``[..., C, R]`` storage (rows of that storage padded by ``pad``)."""
    flipped = w.mT
    return (_padded(flipped, pad) if pad else flipped.contiguous()).mT


def _param(layout: str, dtype: torch.dtype) -> tuple[torch.nn.Parameter, Callable[[torch.Tensor], torch.Tensor]]:
    """A parameter stored in ``layout`` and the function that turns it into the ``[E, K, N]`` weight
    the caller hands to ``grouped_matmul`` (the parameter itself, or its transposed view)."""
    w_EKN = torch.randn(E, K, N, dtype=dtype)
    as_is, flip = (lambda p: p), (lambda p: p.transpose(1, 2))
    if layout == "ekn":  # moe-gmm's own GroupedExperts
        return torch.nn.Parameter(w_EKN), as_is
    if layout == "enk_view":  # Hugging Face's [E, out, in], read through .transpose(1, 2)
        return torch.nn.Parameter(w_EKN.transpose(1, 2).contiguous()), flip
    if layout == "input_major_view":  # [E, out, in] over [E, in, out] storage, read transposed
        return torch.nn.Parameter(_over_transposed(w_EKN.transpose(1, 2).contiguous())), flip
    if layout == "ekn_column_major":  # an [E, K, N] parameter over [E, N, K] storage
        return torch.nn.Parameter(_over_transposed(w_EKN)), as_is
    if layout == "ekn_padded":  # rows padded in storage (not dense)
        return torch.nn.Parameter(_padded(w_EKN)), as_is
    if layout == "enk_padded_view":  # a Hugging Face-layout parameter with padded rows
        return torch.nn.Parameter(_padded(w_EKN.transpose(1, 2).contiguous())), flip
    if layout == "input_major_padded_view":  # both of the above
        return torch.nn.Parameter(_over_transposed(w_EKN.transpose(1, 2).contiguous(), pad=16)), flip
    raise AssertionError(layout)


LAYOUTS = [
    "ekn",
    "enk_view",
    "input_major_view",
    "ekn_column_major",
    "ekn_padded",
    "enk_padded_view",
    "input_major_padded_view",
]


def _expected_grad_strides(param: torch.Tensor) -> tuple[int, ...]:
    # autograd's layout contract: a dense parameter's strides, else contiguous
    return param.stride() if param.mT.is_contiguous() or param.is_contiguous() else torch.empty(param.shape).stride()


def _weight_grad_sized_copies(prof, numel: int) -> list[str]:
    # 3-D only: the Triton interpreter moves every buffer to and from its "device" as flat copies.
    found = []
    for event in prof.events():
        if event.name in ("aten::copy_", "aten::clone", "aten::contiguous"):
            shapes = [s for s in event.input_shapes if s]
            if any(len(s) == 3 and torch.Size(s).numel() == numel for s in shapes):
                found.append(f"{event.name}{shapes}")
    return found


@pytest.mark.parametrize("backend", cpu_backend_names())
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_writes_the_parameter_layout(backend: str, layout: str, dtype: torch.dtype) -> None:
    param, as_weight = _param(layout, dtype)
    x = torch.randn(M, K, dtype=dtype, requires_grad=True)
    dy = torch.randn(M, N, dtype=dtype)
    group_list = torch.tensor(COUNTS)

    def step() -> None:
        y = grouped_matmul(x, as_weight(param), group_list, backend=backend)
        (y * dy).sum().backward()

    step()  # warm-up: one-time allocations and builds stay out of the profile
    param.grad = x.grad = None
    with profile(record_shapes=True) as prof:
        step()
    assert _weight_grad_sized_copies(prof, E * K * N) == []
    assert param.grad.stride() == _expected_grad_strides(param), (param.stride(), param.grad.stride())

    weight64 = as_weight(param.detach()).double()
    _, grad_w_ref = reference_grouped_matmul_grads(x.detach().double(), weight64, COUNTS, dy.double())
    grad_w = as_weight(param.grad)
    assert_rel_close(grad_w.double(), grad_w_ref, tolerance_for(dtype).rel, what=f"{backend} {layout} grad_weight")
    assert torch.count_nonzero(grad_w[1]) == 0  # the empty expert's gradient is exactly zero

    # Gradient accumulation over micro-batches: the second backward adds into the first, exactly.
    first = param.grad.clone()
    step()
    assert torch.equal(param.grad, first + first)
    assert_rel_close(as_weight(param.grad).double(), 2 * grad_w_ref, tolerance_for(dtype).rel, what="accumulated")


def test_zero_stride_grad_output_with_a_transposed_weight() -> None:
    """``y.sum().backward()`` hands an expanded (zero-stride) gradient to the swapped kernel."""
    param, as_weight = _param("enk_view", torch.float32)
    x = torch.randn(M, K, requires_grad=True)
    grouped_matmul(x, as_weight(param), COUNTS).sum().backward()
    _, grad_w_ref = reference_grouped_matmul_grads(x.detach().double(), as_weight(param.detach()).double(), COUNTS,
                                                   torch.ones(M, N, dtype=torch.float64))
    assert param.grad.is_contiguous()
    assert_rel_close(as_weight(param.grad).double(), grad_w_ref, tolerance_for(torch.float32).rel, what="grad_weight")


def test_compiled_backward_reports_the_same_layout() -> None:
    param, as_weight = _param("enk_view", torch.float32)
    x = torch.randn(M, K)
    dy = torch.randn(M, N)
    group_list = torch.tensor(COUNTS)

    def loss(p: torch.Tensor) -> torch.Tensor:
        return (grouped_matmul(x, as_weight(p), group_list) * dy).sum()

    loss(param).backward()
    eager_grad = param.grad
    param.grad = None
    torch.compile(loss, fullgraph=True, backend="aot_eager")(param).backward()
    assert param.grad.stride() == eager_grad.stride() == param.stride()
    torch.testing.assert_close(param.grad, eager_grad, rtol=1e-5, atol=1e-5)
