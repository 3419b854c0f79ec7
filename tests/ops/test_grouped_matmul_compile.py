"""``grouped_matmul`` as a torch.library custom op: opcheck and torch.compile(fullgraph=True)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from moe_gmm import grouped_matmul
from moe_gmm.ops.grouped_matmul import _grad_input_op, _grad_weight_op, _grouped_matmul_op
from moe_gmm.testing import gmm_inputs
from tests.helpers.gmm_cases import cpu_backend_names


@pytest.mark.parametrize("backend", cpu_backend_names())
@pytest.mark.parametrize("counts", [[3, 0, 5], [0, 0, 0]], ids=["uneven", "no_rows"])
def test_opcheck(backend, counts):
    x, w, _ = gmm_inputs(counts, 16, 16)
    ends = torch.tensor(counts).cumsum(0)
    dy = torch.randn(x.shape[0], 16)
    torch.library.opcheck(_grouped_matmul_op, (x.requires_grad_(), w.requires_grad_(), ends, backend))
    torch.library.opcheck(_grad_input_op, (dy, w.detach(), ends, backend))
    torch.library.opcheck(_grad_weight_op, (x.detach(), dy, ends, backend))


def test_compile_fullgraph_aot_eager_forward_and_backward():
    torch._dynamo.reset()
    counts = [4, 0, 6, 2]
    x, w, group_list = gmm_inputs(counts, 16, 16)

    def layer(x_, w_, gl):
        return torch.nn.functional.silu(grouped_matmul(x_, w_, gl))

    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (layer, compiled):
        x_ = x.clone().requires_grad_(True)
        w_ = w.clone().requires_grad_(True)
        y = fn(x_, w_, group_list)
        y.sum().backward()
        results.append((y.detach(), x_.grad, w_.grad))
    for eager_t, compiled_t in zip(*results):
        torch.testing.assert_close(compiled_t, eager_t, rtol=1e-6, atol=1e-6)


def test_compile_recompiles_not_on_new_group_values():
    torch._dynamo.reset()
    x, w, _ = gmm_inputs([4, 4], 16, 16)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(lambda a, b, gl: grouped_matmul(a, b, gl), fullgraph=True, backend=counter)
    y1 = compiled(x, w, torch.tensor([4, 4]))
    y2 = compiled(x, w, torch.tensor([1, 7]))
    assert counter.frame_count == 1
    torch.testing.assert_close(y2, grouped_matmul(x, w, [1, 7], fused=False))
    assert not torch.equal(y1, y2)


def test_compile_fullgraph_as_the_first_call_in_a_process():
    """A fresh process whose very first grouped matmul runs under torch.compile(fullgraph=True):
    nothing the op needs may be imported lazily inside the trace."""
    script = textwrap.dedent(
        """
        import torch
        from moe_gmm.layers import MoeBlockConfig, SparseMoeBlock

        torch.manual_seed(0)
        block = SparseMoeBlock(MoeBlockConfig(hidden_size=16, num_experts=8, num_experts_per_tok=2,
                                              moe_intermediate_size=8, shared_expert_intermediate_size=8))
        compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
        x = torch.randn(10, 16)
        xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        yc = compiled(xc)
        yc.square().sum().backward()
        ye = block(xe)
        ye.square().sum().backward()
        torch.testing.assert_close(yc, ye, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)
        print("ok")
        """
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
