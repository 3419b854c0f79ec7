"""EP-sharded checkpoints: saved at EP 4, loaded at EP 2 and EP 1 and back at EP 4, bitwise.

One 4-rank spawn: the EP-2 models live on two 2-rank subgroups, the EP-1 model on each rank alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from moe_gmm.parallel import EPPlan, apply_expert_parallel
from moe_gmm.parallel.checkpoint import INDEX_NAME, SINGLE_NAME, load_ep_checkpoint, save_ep_checkpoint
from moe_gmm.parallel.launch import run_ranks
from tests.helpers.ep_models import PATTERN
from tests.helpers.ep_models import tiny_moe_stack as _model

pytestmark = pytest.mark.distributed


def _all_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _matches(model, full, rank_in_group: int, group_size: int) -> bool:
    """Every parameter equals (its slice of) the full reference model, bitwise."""
    ref = dict(full.named_parameters())
    for name, p in model.named_parameters():
        expected = ref[name].detach()
        if p.shape != expected.shape:  # an expert shard
            local = expected.shape[0] // group_size
            expected = expected[rank_in_group * local : (rank_in_group + 1) * local]
        if not torch.equal(p.detach(), expected):
            return False
    return True


def _checkpoint_worker(rank: int, world: int, root: str) -> dict:
    root = Path(root)
    full = _model(seed=0, num_experts=8)  # the truth, unsharded, on every rank
    checks = {}

    # EP 4: save.
    m4 = _model(seed=0, num_experts=8)
    apply_expert_parallel(m4, None, EPPlan(4, [PATTERN]))
    save_ep_checkpoint(m4, root / "ep4")

    # EP 2 on two subgroups: load, compare; group {0, 1} saves again.
    g01, g23 = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = g01 if rank < 2 else g23
    m2 = _model(seed=11, num_experts=8)  # different values everywhere before the load
    apply_expert_parallel(m2, mine, EPPlan(2, [PATTERN]))
    checks["ep2_differs_before_load"] = not _matches(m2, full, rank % 2, 2)
    load_ep_checkpoint(m2, root / "ep4")
    checks["ep4_to_ep2"] = _matches(m2, full, rank % 2, 2)
    if rank < 2:
        save_ep_checkpoint(m2, root / "ep2", g01)
    dist.barrier()

    # EP 1: a plain model per rank; rank 0 saves alone (its own one-rank group).
    singles = [dist.new_group([r]) for r in range(world)]
    m1 = _model(seed=12, num_experts=8)
    load_ep_checkpoint(m1, root / "ep2")
    checks["ep2_to_ep1"] = _matches(m1, full, 0, 1)
    if rank == 0:
        save_ep_checkpoint(m1, root / "ep1", singles[0])
    dist.barrier()

    # Back to EP 4.
    m4b = _model(seed=13, num_experts=8)
    apply_expert_parallel(m4b, None, EPPlan(4, [PATTERN]))
    load_ep_checkpoint(m4b, root / "ep1")
    checks["ep1_to_ep4"] = _matches(m4b, full, rank, 4)

    # Padded expert rows (GroupedExperts.set_weight_row_padding): sharding keeps the layout, the
    # checkpoint written from it is the same as from contiguous weights, and loading copies into it.
    padded = _model(seed=0, num_experts=8)
    for layer in padded.layers:
        layer.mlp.experts.set_weight_row_padding(True)
    apply_expert_parallel(padded, None, EPPlan(4, [PATTERN]))
    experts = [layer.mlp.experts for layer in padded.layers]
    checks["padded_sharded"] = all(e.weight_rows_padded for e in experts) and _matches(padded, full, rank, 4)
    save_ep_checkpoint(padded, root / "padded")
    padded_load = _model(seed=15, num_experts=8)
    for layer in padded_load.layers:
        layer.mlp.experts.set_weight_row_padding(True)
    apply_expert_parallel(padded_load, None, EPPlan(4, [PATTERN]))
    load_ep_checkpoint(padded_load, root / "ep1")
    experts = [layer.mlp.experts for layer in padded_load.layers]
    checks["padded_load"] = all(e.weight_rows_padded for e in experts) and _matches(padded_load, full, rank, 4)

    # A model too big for one device: built on the meta device, sharded, then only the local shard
    # is allocated and read from the files.
    with torch.device("meta"):
        meta = _model(seed=0, num_experts=8)
    apply_expert_parallel(meta, None, EPPlan(4, [PATTERN]))
    meta.to_empty(device="cpu")
    load_ep_checkpoint(meta, root / "ep1")
    checks["meta_ep4"] = _matches(meta, full, rank, 4)

    # Errors: a model with other expert counts, and a sharded model saved with the wrong group.
    other = _model(seed=0, num_experts=16)
    try:
        load_ep_checkpoint(other, root / "ep4")
        checks["wrong_E"] = "<no error>"
    except ValueError as err:
        checks["wrong_E"] = str(err)
    try:
        save_ep_checkpoint(m4b, root / "bad", singles[rank])
        checks["wrong_group"] = "<no error>"
    except ValueError as err:
        checks["wrong_group"] = str(err)
    return checks


def test_checkpoint_resharding_round_trips(tmp_path):
    for rank, checks in enumerate(run_ranks(_checkpoint_worker, 4, str(tmp_path), timeout_s=120)):
        for name in (
            "ep2_differs_before_load", "ep4_to_ep2", "ep2_to_ep1", "ep1_to_ep4", "padded_sharded", "padded_load",
            "meta_ep4",
        ):  # fmt: skip
            assert checks[name] is True, f"rank {rank}: {name}"
        assert "has shape (8," in checks["wrong_E"] and "expects (16," in checks["wrong_E"], checks["wrong_E"]
        assert "sharded as rank" in checks["wrong_group"], checks["wrong_group"]

    # The files do not depend on the EP size that wrote them.
    ep4, ep2, ep1, padded = (_all_tensors(tmp_path / d) for d in ("ep4", "ep2", "ep1", "padded"))
    assert ep4.keys() == ep2.keys() == ep1.keys() == padded.keys()
    for key in ep4:
        assert torch.equal(ep4[key], ep2[key]) and torch.equal(ep4[key], ep1[key]), key
        assert torch.equal(ep4[key], padded[key]), key
    # Hugging Face layout: fused experts [E, 2I, H] / [E, H, I] (GroupedExperts holds the transposes).
    full = _model(seed=0, num_experts=8)
    assert torch.equal(ep4["layers.0.mlp.experts.gate_up_proj"], full.layers[0].mlp.experts.gate_up_proj.mT)
    assert ep4["layers.1.mlp.experts.down_proj"].shape == (8, 16, 8)
    # Sharded over files with an index at EP 4 and EP 2, one file at EP 1, as save_pretrained does.
    index = json.loads((tmp_path / "ep4" / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(ep4) and len(set(index["weight_map"].values())) == 4
    assert (tmp_path / "ep1" / SINGLE_NAME).exists() and not (tmp_path / "ep1" / INDEX_NAME).exists()
