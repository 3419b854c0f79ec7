"""The NPU fused permute / unpermute / swiglu plumbing, against the CPU emulator of the vendor contract.

``moe_gmm.ops.npu_fused`` calls the vendor kernels with our arguments and maps their results onto
our contracts; here the calls go to ``npu_emulator`` and must reproduce the portable ops exactly
(permute, swiglu) or to float32 rounding (unpermute). Real-hardware tests run only with an NPU.
"""

from __future__ import annotations

import pytest
import torch

from moe_gmm.ops import npu_fused, permute, swiglu, unpermute
from moe_gmm.testing import routing_ids
from tests.helpers import npu_emulator

T, K_TOP, H, E = 12, 3, 8, 7


@pytest.mark.parametrize("routing", ["uniform", "empty", "duplicate_topk"])
def test_permute_and_unpermute_match_portable_ops(routing):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, H, generator=g)
    ids = routing_ids(T, K_TOP, E, routing, generator=g)
    probs = torch.rand(T, K_TOP, generator=g)
    got = npu_fused.permute_forward(npu_emulator, hidden, ids, E)
    want = permute(hidden, ids, E)
    for name, a, b in zip(("permuted", "row_id_map", "tokens_per_expert"), got, want):
        assert a.dtype == b.dtype, name
        assert torch.equal(a, b), name
    expert_out = torch.randn(T * K_TOP, H, generator=g)
    torch.testing.assert_close(
        npu_fused.unpermute_forward(npu_emulator, expert_out, want[1], probs), unpermute(expert_out, want[1], probs)
    )


def test_unpermute_casts_probs_to_the_activation_dtype():
    expert_out = torch.randn(4 * 2, H).to(torch.bfloat16)
    row_id_map = torch.randperm(8)
    probs = torch.rand(4, 2)  # float32 probs with bf16 activations: the vendor wants one dtype
    out = npu_fused.unpermute_forward(npu_emulator, expert_out, row_id_map, probs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, unpermute(expert_out, row_id_map, probs), rtol=1e-2, atol=1e-2)


def test_swiglu_matches_portable_op():
    x = torch.randn(6, 2 * H)
    torch.testing.assert_close(npu_fused.swiglu_forward(npu_emulator, x), swiglu(x))


def test_vendor_path_only_for_npu_tensors_and_within_limits():
    assert npu_fused.vendor_ops_for(torch.zeros(1)) is None
    assert npu_fused.permute_fits(torch.zeros(2, 512, dtype=torch.int64), E)
    assert not npu_fused.permute_fits(torch.zeros(2, 513, dtype=torch.int64), E)


@pytest.mark.skipif(npu_fused.npu_ops() is None or not hasattr(torch, "npu") or not torch.npu.is_available(),
                    reason="no Ascend NPU here (torch_npu missing or no device)")  # fmt: skip
def test_real_npu_matches_cpu():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(T, H, generator=g)
    ids = routing_ids(T, K_TOP, E, "uneven", generator=g)
    probs = torch.rand(T, K_TOP, generator=g)
    permuted, row_id_map, counts = permute(hidden.to("npu"), ids.to("npu"), E)
    ref = permute(hidden, ids, E)
    assert torch.equal(permuted.cpu(), ref[0]) and torch.equal(row_id_map.cpu(), ref[1])
    assert torch.equal(counts.cpu(), ref[2])
    torch.testing.assert_close(unpermute(permuted, row_id_map, probs.to("npu")).cpu(), unpermute(*ref[:2], probs))


def test_public_ops_route_through_the_vendor_seam(monkeypatch):
    """With the seam pointing at the emulator, permute -> swiglu -> unpermute (forward via the vendor
    calls, backward via the portable formulas) equals the portable path, values and gradients."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(T, 2 * H, generator=g)
    ids = routing_ids(T, K_TOP, E, "uneven", generator=g)
    probs = torch.rand(T, K_TOP, generator=g)

    def run():
        h, p = hidden.clone().requires_grad_(True), probs.clone().requires_grad_(True)
        permuted, row_id_map, _ = permute(h, ids, E)
        out = unpermute(swiglu(permuted), row_id_map, p)
        out.backward(torch.ones_like(out))
        return out, h.grad, p.grad

    portable = run()
    calls = []

    def vendor_for(t):
        calls.append(tuple(t.shape))
        return npu_emulator

    monkeypatch.setattr(npu_fused, "vendor_ops_for", vendor_for)
    vendor = run()
    assert len(calls) == 3, "permute, swiglu and unpermute must each consult the vendor seam"
    for a, b in zip(vendor, portable):
        torch.testing.assert_close(a, b)
