"""``parallelize_moe`` on a (dp, ep) mesh with FSDP2 equals one process on the concatenated batch.

Real gloo ranks (one spawn per world size, shared through ``conftest.py``), AdamW, 3 steps, our
``SparseMoeBlock`` stack (uneven tokens per rank, loss normalised by the global token count) and a
tiny Hugging Face Qwen3-MoE causal LM running the moe_gmm experts (mean loss per rank). Gradients
are compared, not only losses: a wrong reduction factor on the experts hides behind AdamW.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from moe_gmm.parallel import EPPlan, parallelize_moe
from moe_gmm.parallel.launch import RankFailure, run_ranks
from tests.helpers.ep_models import PATTERN, tiny_moe_stack
from tests.helpers.mesh_runs import HF_EXPERTS, STACK_EXPERTS, mesh
from tests.helpers.mesh_runs import assert_matches_one_process as check_run

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize(("dp", "ep"), [(2, 2), (1, 4), (4, 1)])
def test_stack_matches_one_process_on_4_ranks(mesh_reports_4, dp, ep):
    check_run(mesh_reports_4, f"fsdp_stack_{dp}x{ep}", STACK_EXPERTS)


def test_qwen3_moe_matches_one_process_on_4_ranks(mesh_reports_4):
    check_run(mesh_reports_4, "fsdp_hf_2x2", HF_EXPERTS)


def test_dp1_matches_one_process_on_2_ranks(mesh_reports_2):
    """dp = 1: a size-1 shard group, where a divide factor would divide twice on torch 2.13."""
    check_run(mesh_reports_2, "fsdp_stack_1x2", STACK_EXPERTS)
    check_run(mesh_reports_2, "fsdp_hf_1x2", HF_EXPERTS)


def test_checksums_differ_between_runs(mesh_reports_4):
    """The replica comparison above can fail: different training runs give different bits."""
    a = mesh_reports_4[0]["fsdp_stack_2x2"]["checksums"]
    b = mesh_reports_4[0]["fsdp_stack_1x4"]["checksums"]
    assert a.keys() == b.keys() and a != b


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("no_ep_dim", "ep_dim must name a dim of the mesh ('dp',), got 'ep'"),
        ("no_data_dim", "mesh must have a data dim besides 'ep'"),
        ("plan_size", "plan.expert_parallel_size must equal the size of mesh['ep'] = 2, got 4"),
        ("plan_type", "TypeError: plan must be an EPPlan, got dict"),
        ("layers_container", "'layers' is a ModuleList without its own forward"),
        ("loss_type", "TypeError: loss_sum must be a torch.Tensor, got float"),
        ("count_shape", "ValueError: num_tokens must be a scalar, got shape (2,)"),
    ],
)
def test_usage_errors(mesh_reports_2, case, needle):
    for report in mesh_reports_2:
        assert needle in report["usage_errors"][case]
        assert report["usage_errors"][case].startswith(("ValueError", "TypeError"))


@pytest.mark.parametrize("case", ["grouped_matmul", "grouped_matmul_x", "expert_mlp"])
def test_dtensor_reaching_the_op_names_the_fix(mesh_reports_2, case):
    """Before: "group_list must have one entry per expert: expected length 4 ... got 2"."""
    for report in mesh_reports_2:
        message = report["dtensor_op_errors"][case]
        assert message.startswith("TypeError:"), message
        assert "DTensor" in message and ".to_local()" in message and "parallelize_moe" in message


def _killed_worker(rank: int, world: int) -> None:
    model = tiny_moe_stack(seed=3)
    par = parallelize_moe(model, mesh(1, 2), EPPlan(2, [PATTERN]))
    x = torch.randn(6, 16)
    par.average_loss(nn.functional.mse_loss(model(x), x)).backward()
    if rank == 1:
        os._exit(3)  # dies between steps, as a crashed or preempted rank would
    for _ in range(3):
        par.average_loss(nn.functional.mse_loss(model(x), x)).backward()


def test_a_killed_rank_fails_the_others_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_ranks(_killed_worker, 2, timeout_s=90, pg_timeout_s=20, may_exit=[1])
    assert failure.value.reports[0].startswith("raised:"), failure.value.reports[0]
    assert failure.value.reports[1] == "exited with code 3 without a result"
    assert time.monotonic() - start < 80
