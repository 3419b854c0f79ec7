"""One spawn per world size for the mesh-parallel tests: each module asserts its part of the reports."""

from __future__ import annotations

import pytest

from moe_gmm.parallel.launch import run_ranks
from tests.helpers.mesh_runs import four_rank_worker, two_rank_worker


@pytest.fixture(scope="session")
def mesh_reports_2() -> list[dict]:
    return run_ranks(two_rank_worker, 2, timeout_s=240)


@pytest.fixture(scope="session")
def mesh_reports_4() -> list[dict]:
    return run_ranks(four_rank_worker, 4, timeout_s=300)
