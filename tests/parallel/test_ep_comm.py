"""The differentiable all-to-all, the rank launcher, and fault handling, on real gloo ranks."""

from __future__ import annotations

import os
import time

import pytest
import torch

from moe_gmm.parallel.comm import CollectiveError, all_to_all, all_to_all_async, exchange_counts
from moe_gmm.parallel.launch import RankFailure, run_ranks

pytestmark = pytest.mark.distributed


def _splits(world: int, seed: int) -> torch.Tensor:
    """``[src, dst]`` row counts, the same on every rank, with zero-row routes."""
    g = torch.Generator().manual_seed(seed)
    splits = torch.randint(0, 5, (world, world), generator=g)
    splits[0, :] = 0  # rank 0 sends nothing
    splits[:, world - 1] = 0  # the last rank receives nothing
    splits[1, 1] = 3  # a self route
    return splits


def _payload(rank: int, rows: int, width: int = 3) -> torch.Tensor:
    # Row i of rank r holds 1000 r + i, so every received row says where it came from.
    base = torch.arange(rows, dtype=torch.float64)[:, None] + 1000 * rank
    return (base + torch.arange(width, dtype=torch.float64) / 10).requires_grad_(True)


def _comm_worker(rank: int, world: int) -> dict:
    checks = {}
    splits = _splits(world, seed=7)
    input_splits, output_splits = splits[rank].tolist(), splits[:, rank].tolist()

    # Count exchange: even int64 all-to-all, row d of the input goes to rank d.
    send = torch.arange(world, dtype=torch.int64) * 10 + rank
    checks["counts"] = torch.equal(exchange_counts(send, None), torch.arange(world) + rank * 10)

    # Expected received rows: from each source s, its rows destined to me, in order.
    expected = []
    for s in range(world):
        start = int(splits[s, :rank].sum())
        expected.append(_payload(s, int(splits[s].sum())).detach()[start : start + int(splits[s, rank])])
    expected = torch.cat(expected)

    for mode in ("sync", "async"):
        x = _payload(rank, sum(input_splits))
        if mode == "sync":
            y = all_to_all(x, output_splits, input_splits)
        else:
            y = all_to_all_async(x, output_splits, input_splits).wait()
        checks[f"{mode}_forward"] = torch.equal(y, expected)
        # Backward: a row-dependent weight on the received rows; each sent row's grad is the weight it got.
        weight = y.detach() * 2 + 1
        (y * weight).sum().backward()
        checks[f"{mode}_backward"] = torch.equal(x.grad, x.detach() * 2 + 1)

    # Two overlapped exchanges in flight at once, waited in reverse order, with autograd.
    a, b = _payload(rank, sum(input_splits)), _payload(rank, sum(input_splits)) * 3
    ha = all_to_all_async(a, output_splits, input_splits)
    hb = all_to_all_async(b.detach().requires_grad_(True), output_splits, input_splits)
    yb, ya = hb.wait(), ha.wait()
    checks["two_in_flight"] = torch.equal(ya, expected) and torch.equal(yb, expected * 3)
    (ya.sum() * 2).backward()
    checks["two_in_flight_backward"] = torch.equal(a.grad, torch.full_like(a, 2.0))
    return checks


@pytest.mark.parametrize("world", [3])
def test_all_to_all_uneven_empty_routes_sync_and_async(world):
    for rank, checks in enumerate(run_ranks(_comm_worker, world, timeout_s=60)):
        assert all(checks.values()), f"rank {rank}: {checks}"


def _raise_on_every_rank(rank: int, world: int) -> None:
    raise ValueError(f"deliberate failure on rank {rank}")


def test_launcher_reports_every_rank_failure():
    with pytest.raises(RankFailure) as info:
        run_ranks(_raise_on_every_rank, 2, timeout_s=30)
    msg = str(info.value)
    assert "2 of 2 ranks failed" in msg
    assert "deliberate failure on rank 0" in msg and "deliberate failure on rank 1" in msg


def _fault_worker(rank: int, world: int, fault: str, pg_timeout_s: float) -> dict:
    x = torch.ones(4, 2)
    all_to_all(x, [2, 2], [2, 2])  # a healthy exchange first
    if rank == 1:
        if fault == "killed":
            os._exit(3)  # dies without a word, as a crashed or OOM-killed process would
        time.sleep(pg_timeout_s + 1.5)  # "hung": alive, but misses the next collective's timeout
        return {}
    start = time.monotonic()
    try:
        all_to_all(x, [2, 2], [2, 2])
    except CollectiveError as err:
        return {"error": str(err), "seconds": time.monotonic() - start}
    return {"error": None}


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_dead_or_hung_peer_gives_clear_error_within_timeout(fault):
    pg_timeout_s = 2.0
    try:
        results = run_ranks(
            _fault_worker, 2, fault, pg_timeout_s, timeout_s=25, pg_timeout_s=pg_timeout_s, may_exit=[1]
        )
    except RankFailure as failure:  # the hung rank may fail its teardown after rank 0 left
        results = failure.results
        assert 0 in results, str(failure)
    err = results[0]["error"]
    assert err is not None and "expert-parallel all-to-all failed on rank 0 of 2" in err
    assert "peer rank exited or did not join" in err
    assert results[0]["seconds"] < pg_timeout_s + 5.0
