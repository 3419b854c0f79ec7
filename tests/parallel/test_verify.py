"""Setup verification: ranks that disagree are named, with the first field or tensor that differs.

On ranks (shared 2-rank spawn, ``conftest.py``): rank 1 builds the model with another top_k,
another seed or another dtype, through ``apply_expert_parallel``, ``parallelize_moe`` and
``replicate_moe``; every rank raises the same ValueError. In one process: the checksum and the
configuration extracted from our stack and from a Hugging Face Qwen3-MoE.
"""

from __future__ import annotations

import pytest
import torch

from moe_gmm.parallel.verify import _first_difference, experts_config, tensor_checksum
from tests.helpers.ep_models import tiny_moe_stack
from tests.helpers.mesh_runs import qwen3_moe

WHAT = {"apply": "apply_expert_parallel", "fsdp": "parallelize_moe", "ddp": "replicate_moe"}
EXPECTED = {
    "top_k": "ranks disagree on the expert-parallel setup: layers.0.mlp.experts.top_k: rank 0 has 2; rank 1 has 3",
    "dtype": (
        "ranks disagree on the expert-parallel setup: layers.0.mlp.experts.dtype: "
        "rank 0 has 'torch.float32'; rank 1 has 'torch.float64'"
    ),
    "seed": "ranks disagree on a replicated tensor (shape, dtype, bit checksum): layers.0.mlp.gate.weight: rank 0 has",
}


@pytest.mark.distributed
@pytest.mark.parametrize("entry", ["apply", "fsdp", "ddp"])
@pytest.mark.parametrize("case", ["top_k", "dtype", "seed"])
def test_ranks_that_disagree_are_named(mesh_reports_2, entry, case):
    for report in mesh_reports_2:
        message = report["setup_errors"][f"{entry}_{case}"]
        assert message.startswith(f"ValueError: {WHAT[entry]}: {EXPECTED[case]}"), message
        assert len(message) < 400, "the message names the difference instead of dumping both setups"
    assert mesh_reports_2[0]["first_replicated"] == "layers.0.mlp.gate.weight"  # the seed case names the first


@pytest.mark.distributed
def test_hf_top_k_is_read_from_the_router(mesh_reports_2):
    for report in mesh_reports_2:
        assert report["setup_errors"]["fsdp_hf_top_k"] == (
            "ValueError: parallelize_moe: ranks disagree on the expert-parallel setup: "
            "model.layers.0.mlp.experts.top_k: rank 0 has 2; rank 1 has 3"
        )


def test_checksum_reads_bits_and_positions():
    a = torch.randn(7, 5)
    assert tensor_checksum(a) == tensor_checksum(a.clone())
    assert tensor_checksum(a.t().contiguous().t()) == tensor_checksum(a)  # layout does not matter
    assert tensor_checksum(torch.tensor([0.0])) != tensor_checksum(torch.tensor([-0.0]))
    assert tensor_checksum(torch.tensor([1.0, 2.0])) != tensor_checksum(torch.tensor([2.0, 1.0]))
    b = a.clone()
    b[3, 2] = torch.nextafter(b[3, 2], torch.tensor(float("inf")))  # one ulp
    assert tensor_checksum(b) != tensor_checksum(a)
    assert tensor_checksum(torch.empty(0)) == (0, 0)
    assert tensor_checksum(torch.empty(3, device="meta")) is None
    odd = torch.randn(3, dtype=torch.bfloat16)  # 6 bytes: read as int16
    assert tensor_checksum(odd) != tensor_checksum(odd + 1)
    flags = torch.tensor([True, False, True])
    assert tensor_checksum(flags) != tensor_checksum(~flags)


def test_checksum_covers_every_chunk():
    big = torch.zeros((1 << 22) + 9)
    changed = big.clone()
    changed[-1] = 1.0  # in the second chunk
    assert tensor_checksum(changed) != tensor_checksum(big)


def test_first_difference_groups_ranks():
    records = [[("k", 2), ("h", 16)], [("k", 3), ("h", 16)], [("k", 2), ("h", 16)]]
    assert _first_difference(records) == "k: ranks 0, 2 have 2; rank 1 has 3"
    assert _first_difference([[("k", 2)], [("k", 2)]]) is None
    assert _first_difference([[("a", 1)], [("b", 1)]]) == "entry 0 of the setup: rank 0 has 'a'; rank 1 has 'b'"


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
