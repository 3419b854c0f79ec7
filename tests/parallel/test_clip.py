"""``clip_grad_norm_`` across meshes equals ``torch.nn.utils.clip_grad_norm_`` of one process.

On ranks (shared spawns, ``conftest.py``): FSDP at (2, 2) and (1, 2) (dense grads sharded over all
ranks, expert grads over (dp, ep)) and DDP at (2, 2) (plain expert shards summed over ep), clipping
active (max_norm 0.05 against norms around 0.3-0.6). In one process: the plain-model path and the
argument errors.
"""

from __future__ import annotations

import math

import pytest
import torch

from moe_gmm.parallel.clip import clip_grad_norm_, total_grad_norm
from tests.helpers.ep_models import tiny_moe_stack

CLIPPED_RUNS = [
    ("mesh_reports_4", "fsdp_stack_2x2"),
    ("mesh_reports_4", "ddp_stack_2x2"),
    ("mesh_reports_2", "fsdp_stack_1x2"),
]


@pytest.mark.distributed
@pytest.mark.parametrize(("fixture", "key"), CLIPPED_RUNS)
def test_clip_on_meshes_matches_one_process(request, fixture, key):
    for rank, report in enumerate(request.getfixturevalue(fixture)):
        ours, ref = report[key]["clip_norm"]
        assert ref > 0.05 * 2, "clipping must be active for the comparison to mean anything"
        assert abs(ours - ref) / ref < 1e-6, f"{key} rank {rank}: norm {ours} vs one process {ref}"
        for name, err in report[key]["clipped_grad"].items():
            assert err < 1e-5, f"{key} rank {rank} clipped {name}: relative error {err:.2e}"


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    model = tiny_moe_stack(seed=seed)
    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).sum().backward()
    return model


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_plain_model_matches_torch(norm_type):
    ours, ref = _model_with_grads(), _model_with_grads()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type)
    norm = clip_grad_norm_(ours, 0.1, norm_type)
    assert abs(norm.item() - ref_norm.item()) <= 1e-6 * ref_norm.item()
    assert ref_norm.item() > 0.2
    for (name, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=name)


def test_no_gradients_gives_zero():
    assert total_grad_norm(tiny_moe_stack()).item() == 0.0


@pytest.mark.parametrize("max_norm", [0.0, -1.0, math.nan, math.inf, True, "1"])
def test_bad_max_norm(max_norm):
    with pytest.raises(ValueError, match=r"max_norm must be a finite float > 0, got"):
        clip_grad_norm_(_model_with_grads(), max_norm)


@pytest.mark.parametrize("norm_type", [0.0, -2.0, math.nan, "2", None])
def test_bad_norm_type(norm_type):
    with pytest.raises(ValueError, match=r"norm_type must be a float > 0 \(or math.inf\), got"):
        clip_grad_norm_(_model_with_grads(), 1.0, norm_type)
