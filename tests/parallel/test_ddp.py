"""``replicate_moe``: experts sharded over ep, dense parameters in DDP over every rank, at (dp, ep) = (2, 2).

The same AdamW run against one process as the FSDP tests (shared 4-rank spawn, ``conftest.py``).
Without the ignore list DDP would broadcast rank 0's expert shard over the other EP ranks' at
start-up; without the expert-dp reduction the expert gradients would hold half the tokens.
"""

from __future__ import annotations

import pytest

from tests.helpers.mesh_runs import STACK_EXPERTS, assert_matches_one_process

pytestmark = pytest.mark.distributed


def test_ddp_matches_one_process_at_dp2_ep2(mesh_reports_4):
    assert_matches_one_process(mesh_reports_4, "ddp_stack_2x2", STACK_EXPERTS)


def test_ddp_keyword_process_group_is_refused(mesh_reports_2):
    for report in mesh_reports_2:
        assert report["usage_errors"]["ddp_group"] == (
            "ValueError: ddp_kwargs must not set process_group / device_mesh: replicate_moe uses all ranks of mesh"
        )
