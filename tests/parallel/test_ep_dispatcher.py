"""EP dispatchers vs the single-process run on the same global batch, on real gloo ranks.

One spawn per EP size runs every case (E, top-k, routing) through both dispatchers, forward and
backward, and sends back relative errors; the assertions run here so a failure names the case.

For each case every rank builds the same global batch from one seed, runs the single-process
reference on all of it (permute -> expert_mlp on all E experts -> unpermute), then runs its own
slice of tokens through the dispatcher with its shard of the expert weights. Compared on every
rank: the output rows of its tokens, the gradient of its hidden rows, of its router logits, and of
its expert-weight shard (which must equal the matching slice of the single-process gradient).
"""

from __future__ import annotations

import pytest
import torch

from moe_gmm.ops.expert_mlp import expert_mlp
from moe_gmm.ops.permute import permute, unpermute
from moe_gmm.parallel.dispatcher import AllToAllDispatcher, OverlappedAllToAllDispatcher
from moe_gmm.parallel.launch import run_ranks
from moe_gmm.testing import relative_error, routing_ids

pytestmark = pytest.mark.distributed

HIDDEN, INTER = 8, 4
LIMIT = 1e-5  # fp32 relative-norm error
# Overlapped vs one-chunk: the same per-row math, but each chunk's grouped matmul sees fewer rows
# (CPU GEMM kernels block by row count, so not bitwise) and expert grads sum over chunks.
OVERLAP_LIMIT = 1e-6
BF16_LIMIT = 1e-2

ROUTINGS = {
    "random": "distinct experts, uniform",
    "skewed": "Zipf over a quarter of the experts",
    "one_rank": "every slot goes to rank 0's experts; the other ranks receive nothing",
    "starve_last": "no slot goes to the last rank's experts",
    "no_tokens": "rank 1 has no tokens at all (sends nothing, still serves its experts)",
}


def _global_ids(routing: str, num_tokens: int, top_k: int, num_experts: int, ep: int, g: torch.Generator):
    local = num_experts // ep
    if routing in ("random", "no_tokens"):
        return routing_ids(num_tokens, top_k, num_experts, "uniform", generator=g)
    if routing == "skewed":
        return routing_ids(num_tokens, top_k, num_experts, "skewed", generator=g)
    if routing == "one_rank":  # rank 0 owns [0, L); duplicates in a token's top-k are legal
        return torch.randint(0, local, (num_tokens, top_k), generator=g)
    if routing == "starve_last":
        return routing_ids(num_tokens, top_k, num_experts - local, "uniform", generator=g)
    raise AssertionError(routing)


def _case_inputs(seed, ep, num_experts, top_k, routing):
    g = torch.Generator().manual_seed(seed)
    tokens = [5 + (r % 3) for r in range(ep)]  # uneven token counts per rank
    if routing == "no_tokens":
        tokens[1] = 0
    total = sum(tokens)
    return {
        "tokens": tokens,
        "hidden": torch.randn(total, HIDDEN, generator=g),
        "logits": torch.randn(total, num_experts, generator=g),
        "ids": _global_ids(routing, total, top_k, num_experts, ep, g),
        "gate_up": torch.randn(num_experts, HIDDEN, 2 * INTER, generator=g) / HIDDEN**0.5,
        "down": torch.randn(num_experts, INTER, HIDDEN, generator=g) / INTER**0.5,
        "grad_out": torch.randn(total, HIDDEN, generator=g),
    }


def _run(inputs, dispatcher=None, rows=slice(None), experts=slice(None), dtype=torch.float32):
    """One forward + backward; ``dispatcher=None`` is the single-process reference."""
    hidden = inputs["hidden"][rows].to(dtype).requires_grad_(True)
    logits = inputs["logits"][rows].clone().requires_grad_(True)
    ids = inputs["ids"][rows]
    gate_up = inputs["gate_up"][experts].to(dtype).requires_grad_(True)
    down = inputs["down"][experts].to(dtype).requires_grad_(True)
    probs = torch.softmax(logits, dim=-1).gather(1, ids).to(dtype)  # the router's differentiable part

    def experts_fn(x, group_list):
        return expert_mlp(x, group_list, gate_up, down)

    if dispatcher is None:
        x, row_map, counts = permute(hidden, ids, gate_up.shape[0])
        out = unpermute(experts_fn(x, counts), row_map, probs)
    else:
        out = dispatcher(hidden, ids, probs, experts_fn)
    (out * inputs["grad_out"][rows].to(dtype)).sum().backward()
    return {
        "out": out.detach(),
        "hidden": hidden.grad,
        "logits": logits.grad,
        "gate_up": gate_up.grad,
        "down": down.grad,
    }


def _dispatch_worker(rank: int, ep: int, cases: list) -> list:
    report = []
    for i, (num_experts, top_k, routing) in enumerate(cases):
        inputs = _case_inputs(1000 + i, ep, num_experts, top_k, routing)
        ref = _run(inputs)
        lo = sum(inputs["tokens"][:rank])
        rows = slice(lo, lo + inputs["tokens"][rank])
        local = num_experts // ep
        experts = slice(rank * local, (rank + 1) * local)
        ref_local = {
            "out": ref["out"][rows],
            "hidden": ref["hidden"][rows],
            "logits": ref["logits"][rows],
            "gate_up": ref["gate_up"][experts],
            "down": ref["down"][experts],
        }
        a2a = _run(inputs, AllToAllDispatcher(num_experts), rows, experts)
        entry = {"case": (num_experts, top_k, routing), "rank": rank}
        entry["alltoall"] = {k: relative_error(a2a[k], ref_local[k]) for k in ref_local}
        # Expert shards that receive no rows must get exact zero gradients, not None.
        received = int((inputs["ids"] // local == rank).sum())
        entry["received_rows"] = received
        entry["zero_grad_ok"] = received > 0 or (bool(a2a["gate_up"].eq(0).all()) and bool(a2a["down"].eq(0).all()))
        for chunks in (2, 3) if i % 2 else (2,):
            ovl = _run(inputs, OverlappedAllToAllDispatcher(num_experts, num_chunks=chunks), rows, experts)
            entry[f"overlap{chunks}"] = {k: relative_error(ovl[k], ref_local[k]) for k in ref_local}
            entry[f"overlap{chunks}_vs_alltoall"] = {k: relative_error(ovl[k], a2a[k]) for k in a2a}
        if i == 0:  # bf16 rows travel as bf16; same math per row as the single-process bf16 run
            ref16 = _run(inputs, dtype=torch.bfloat16)
            ref16 = {
                "out": ref16["out"][rows],
                "hidden": ref16["hidden"][rows],
                "logits": ref16["logits"][rows],
                "gate_up": ref16["gate_up"][experts],
                "down": ref16["down"][experts],
            }
            for name, disp in (
                ("bf16_alltoall", AllToAllDispatcher(num_experts)),
                ("bf16_overlap2", OverlappedAllToAllDispatcher(num_experts, num_chunks=2)),
            ):
                got = _run(inputs, disp, rows, experts, dtype=torch.bfloat16)
                entry[name] = {k: relative_error(got[k], ref16[k]) for k in ref16}
        report.append(entry)
    return report


# Every routing with two (E, k) pairs, together covering E in {8, 16} x k in {2, 4}; the full
# product would triple the collectives for no new code path.
CASES = [
    (num_experts, top_k, routing)
    for i, routing in enumerate(ROUTINGS)
    for num_experts, top_k in (((8, 2), (16, 4)) if i % 2 == 0 else ((8, 4), (16, 2)))
]


@pytest.mark.parametrize("ep", [2, 4])
def test_dispatchers_equal_single_process(ep):
    reports = run_ranks(_dispatch_worker, ep, CASES, timeout_s=150)
    receivers_empty = 0
    for rank_report in reports:
        for entry in rank_report:
            where = f"EP={ep} rank {entry['rank']} E,k,routing={entry['case']}"
            for key in [k for k in entry if k.startswith(("alltoall", "overlap", "bf16"))]:
                limit = (
                    BF16_LIMIT if key.startswith("bf16") else OVERLAP_LIMIT if key.endswith("_vs_alltoall") else LIMIT
                )
                for tensor, err in entry[key].items():
                    assert err < limit, f"{where}: {key} {tensor} relative error {err:.2e}"
            assert entry["zero_grad_ok"], f"{where}: a shard that received nothing has non-zero gradients"
            receivers_empty += entry["received_rows"] == 0
    assert receivers_empty > 0  # the cases did include ranks whose experts receive nothing
    assert all("bf16_alltoall" in r[0] for r in reports)
