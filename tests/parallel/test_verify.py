"""Setup verification: ranks that disagree are named, with the first field or tensor that differs.

On ranks (shared spawns, ``conftest.py``): rank 1 builds the model with another top_k, another
seed, another dtype, one expert drawn again, or two elements 251 apart swapped (in a dense tensor,
in an expert weight), through ``apply_expert_parallel``, ``parallelize_moe`` and
``replicate_moe``; every rank raises the same ValueError. On dp = 2 x ep = 2 the same for rank 3
alone. In one process: the tensor records and the configuration extracted from our stack and from a
Hugging Face Qwen3-MoE.
"""

from __future__ import annotations

import pytest
import torch

from moe_gmm.parallel.verify import TensorRecord, _first_difference, experts_config
from tests.helpers.ep_models import tiny_moe_stack
from tests.helpers.mesh_runs import SWAP_DISTANCE, qwen3_moe, swapped

WHAT = {"apply": "apply_expert_parallel", "fsdp": "parallelize_moe", "ddp": "replicate_moe"}
REBUILD = "; build the model from the same seed or checkpoint on every rank before parallelizing"
EXPECTED = {
    "top_k": "ranks disagree on the expert-parallel setup: layers.0.mlp.experts.top_k: rank 0 has 2; rank 1 has 3",
    "dtype": (
        "ranks disagree on the expert-parallel setup: layers.0.mlp.experts.dtype: "
        "rank 0 has 'torch.float32'; rank 1 has 'torch.float64'"
    ),
    "seed": "ranks disagree on a replicated tensor (shape, dtype, sha256): layers.0.mlp.gate.weight: ",
    "swap251": "ranks disagree on a replicated tensor (shape, dtype, sha256): dense.0.weight: ",
    "expert": (
        "ranks disagree on an expert tensor before sharding (shape, dtype, sha256): layers.1.mlp.experts.down_proj: "
    ),
    "expert_swap251": (
        "ranks disagree on an expert tensor before sharding (shape, dtype, sha256): "
        "layers.0.mlp.experts.gate_up_proj: "
    ),
}
HELD = {"seed": "[8, 16] float32", "swap251": "[16, 16] float32", "expert": "[8, 8, 16] float32"}
HELD["expert_swap251"] = "[8, 16, 16] float32"


def _assert_refused(message: str, what: str, case: str, odd_rank: int) -> None:
    """The first difference, then which ranks hold which record: the others together, ``odd_rank`` alone."""
    assert message.startswith(f"ValueError: {what}: {EXPECTED[case]}"), message
    assert len(message) < 400, "the message names the difference instead of dumping both setups"
    if case in HELD:
        others = ", ".join(str(r) for r in range(odd_rank))
        held = f"{'ranks' if odd_rank > 1 else 'rank'} {others} {'have' if odd_rank > 1 else 'has'} "
        held += f"{HELD[case]} sha256 "
        assert message.startswith(f"ValueError: {what}: {EXPECTED[case]}{held}"), message
        assert f"; rank {odd_rank} has {HELD[case]} sha256 " in message and message.endswith(REBUILD), message


@pytest.mark.distributed
@pytest.mark.parametrize("entry", ["apply", "fsdp", "ddp"])
@pytest.mark.parametrize("case", ["top_k", "dtype", "seed", "expert", "swap251", "expert_swap251"])
def test_ranks_that_disagree_are_named(mesh_reports_2, entry, case):
    for report in mesh_reports_2:
        _assert_refused(report["setup_errors"][f"{entry}_{case}"], WHAT[entry], case, odd_rank=1)
    assert mesh_reports_2[0]["first_replicated"] == "layers.0.mlp.gate.weight"  # the seed case names the first


@pytest.mark.distributed
@pytest.mark.parametrize("entry", ["apply", "fsdp", "ddp"])
def test_identical_ranks_pass(mesh_reports_2, entry):
    assert [r["setup_errors"][f"{entry}_identical"] for r in mesh_reports_2] == ["<no error>"] * 2


@pytest.mark.distributed
@pytest.mark.parametrize("entry", ["fsdp", "ddp"])
@pytest.mark.parametrize("case", ["expert", "swap251", "expert_swap251"])
def test_one_rank_of_a_2x2_mesh_that_differs_is_named(mesh_reports_4, entry, case):
    """dp = 2 x ep = 2: the whole mesh compares every tensor before sharding, not each ep group."""
    for report in mesh_reports_4:
        message = report["setup_errors_2x2"][f"{entry}_{case}"]
        _assert_refused(message, WHAT[entry], case, odd_rank=3)
        assert report["setup_errors_2x2"][f"{entry}_identical"] == "<no error>"


@pytest.mark.distributed
def test_hf_top_k_is_read_from_the_router(mesh_reports_2):
    for report in mesh_reports_2:
        assert report["setup_errors"]["fsdp_hf_top_k"] == (
            "ValueError: parallelize_moe: ranks disagree on the expert-parallel setup: "
            "model.layers.0.mlp.experts.top_k: rank 0 has 2; rank 1 has 3"
        )


def _weak_checksum(t: torch.Tensor) -> tuple[int, int]:
    """The position-weighted bit sum (weights ``i % 251 + 1``) the records replaced: shown blind to a swap."""
    ints = t.contiguous().view(-1).view(torch.int32).to(torch.int64)
    weights = torch.arange(ints.numel()) % SWAP_DISTANCE + 1
    return int(ints.sum()), int((ints * weights).sum())


def test_records_see_every_bit_and_position():
    a = torch.randn(7, 5)
    assert TensorRecord.of(a) == TensorRecord.of(a.clone())
    assert TensorRecord.of(a.t().contiguous().t()) == TensorRecord.of(a)  # layout does not matter
    assert TensorRecord.of(torch.tensor([0.0])) != TensorRecord.of(torch.tensor([-0.0]))
    assert TensorRecord.of(torch.tensor([1.0, 2.0])) != TensorRecord.of(torch.tensor([2.0, 1.0]))
    b = a.clone()
    b[3, 2] = torch.nextafter(b[3, 2], torch.tensor(float("inf")))  # one ulp
    assert TensorRecord.of(b) != TensorRecord.of(a)
    nan = torch.tensor([float("nan")])
    other_nan = nan.view(torch.int32).add(1).view(torch.float32)  # another NaN payload
    assert TensorRecord.of(nan) != TensorRecord.of(other_nan)
    odd = torch.randn(3, dtype=torch.bfloat16)
    assert TensorRecord.of(odd) != TensorRecord.of(odd + 1)
    flags = torch.tensor([True, False, True])
    assert TensorRecord.of(flags) != TensorRecord.of(~flags)
    assert TensorRecord.of(torch.zeros(2, 3)) != TensorRecord.of(torch.zeros(3, 2))  # shape is compared
    assert TensorRecord.of(torch.zeros(3)) != TensorRecord.of(torch.zeros(3, dtype=torch.float64))
    assert TensorRecord.of(torch.empty(0)).sha256 is not None
    assert TensorRecord.of(torch.empty(3, device="meta")) == TensorRecord((3,), "float32", None)


def test_a_swap_251_apart_is_seen_where_a_weighted_sum_is_blind():
    a = torch.randn(300)
    b = a.clone()
    swapped(b, 10)
    assert not torch.equal(a, b) and torch.equal(a.sort().values, b.sort().values)
    assert _weak_checksum(a) == _weak_checksum(b)  # the hole: equal weights 251 apart
    assert TensorRecord.of(a) != TensorRecord.of(b)


def test_records_cover_every_byte_of_a_large_tensor():
    big = torch.zeros((1 << 22) + 9)
    changed = big.clone()
    changed[-1] = 1.0
    assert TensorRecord.of(changed) != TensorRecord.of(big)


def test_a_record_shows_a_short_digest():
    record = TensorRecord.of(torch.zeros(2, 3))
    assert len(record.sha256) == 64
    assert repr(record) == f"[2, 3] float32 sha256 {record.sha256[:12]}"


def test_first_difference_groups_ranks():
    records = [[("k", 2), ("h", 16)], [("k", 3), ("h", 16)], [("k", 2), ("h", 16)]]
    assert _first_difference(records) == "k: ranks 0, 2 have 2; rank 1 has 3"
    assert _first_difference([[("k", 2)], [("k", 2)]]) is None
    assert _first_difference([[("a", 1)], [("b", 1)]]) == "entry 0 of the setup: rank 0 has 'a'; rank 1 has 'b'"
    # Grouped by equality, not by what is shown: two digests sharing their first digits stay apart.
    one, two = TensorRecord((1,), "float32", "a" * 64), TensorRecord((1,), "float32", "a" * 63 + "b")
    assert repr(one) == repr(two)
    assert _first_difference([[("w", one)], [("w", two)], [("w", one)]]) == (
        f"w: ranks 0, 2 have {one!r}; rank 1 has {two!r}"
    )


def test_experts_config_of_our_stack_and_qwen3_moe():
    ours = dict(experts_config(tiny_moe_stack(), ["layers.1.mlp.experts"]))
    assert ours["layers.1.mlp.experts.num_experts"] == 8
    assert ours["layers.1.mlp.experts.top_k"] == 2
    assert ours["layers.1.mlp.experts.hidden_size"] == 16
    assert ours["layers.1.mlp.experts.intermediate_size"] == 8
    assert ours["layers.1.mlp.experts.dtype"] == "torch.float32"
    hf = dict(experts_config(qwen3_moe(num_experts_per_tok=3), ["model.layers.0.mlp.experts"]))
    assert (hf["model.layers.0.mlp.experts.top_k"], hf["model.layers.0.mlp.experts.hidden_size"]) == (3, 32)
    assert hf["model.layers.0.mlp.experts.intermediate_size"] == 16
    assert hf["model.layers.0.mlp.experts.num_experts"] == 8
