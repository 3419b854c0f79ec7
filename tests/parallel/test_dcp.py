"""DCP checkpoints of ``parallelize_moe`` models: saved at (dp 2, ep 2), loaded bitwise at (1, 2), (1, 4)
and in one process (model and AdamW state), the experts recorded with their whole E; the Hugging
Face export loads with ``from_pretrained``; damaged or mismatched checkpoints are refused by name.

A tiny Qwen3-MoE causal LM (E=8) on real gloo ranks: one 4-rank spawn saves and reloads, one
2-rank spawn reloads, the test process itself loads without a process group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

transformers = pytest.importorskip("transformers")

from moe_gmm.checksum import CheckpointError, tensor_digest
from moe_gmm.parallel import EPPlan, apply_expert_parallel, parallelize_moe, replicate_moe
from moe_gmm.parallel.dcp import checkpoint_metadata, export_hf, import_hf, load_checkpoint, save_checkpoint
from moe_gmm.parallel.launch import run_ranks
from tests.helpers.mesh_runs import HF_PATTERN, mesh, qwen3_moe

pytestmark = pytest.mark.distributed

EXPERT_KEY = "model.layers.1.mlp.experts.gate_up_proj"
E = 8


def _batch(rows: int) -> torch.Tensor:
    return torch.randint(0, 64, (rows, 8), generator=torch.Generator().manual_seed(21))


def _digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """sha256 of every whole model tensor and optimizer state tensor (collective on a parallelized model)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    out = {f"model/{k}": tensor_digest(full(v)) for k, v in model_state.items()}
    for fqn, entry in optim_state["state"].items():
        out |= {f"optim/{fqn}/{k}": tensor_digest(full(v)) for k, v in entry.items()}
    return out


def _trained(rank: int, dp: int, ep: int):
    """A (dp, ep)-parallel model after two AdamW steps on this rank's share of a batch."""
    model = qwen3_moe(seed=4)
    par = parallelize_moe(model, mesh(dp, ep), EPPlan(ep, [HF_PATTERN]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _batch(dp * ep)[rank : rank + 1]
    for _ in range(2):
        optimizer.zero_grad()
        par.average_loss(model(input_ids=ids, labels=ids).loss).backward()
        optimizer.step()
    return model, optimizer


def _reloaded(root: str, dp: int, ep: int) -> dict[str, str]:
    """Another seed parallelized at (dp, ep), the checkpoint loaded: its digests."""
    model = qwen3_moe(seed=5)
    parallelize_moe(model, mesh(dp, ep), EPPlan(ep, [HF_PATTERN]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    extra = load_checkpoint(Path(root) / "dcp", model, optimizer)
    return {"extra": extra, "digests": _digests(model, optimizer)}


def _error(call) -> str:
    try:
        call()
    except (TypeError, ValueError) as err:
        return f"{type(err).__name__}: {err}"
    return "<no error>"


def _four_rank_worker(rank: int, world: int, root: str) -> dict:
    model, optimizer = _trained(rank, 2, 2)
    saved = _digests(model, optimizer)
    save_checkpoint(Path(root) / "dcp", model, optimizer, extra={"step": 2, "losses": [4.5, 4.25]})
    export_hf(model, Path(root) / "hf")
    with torch.no_grad():
        ids = _batch(2)
        loss = model(input_ids=ids, labels=ids).loss.item()  # every rank the same whole batch
    report = {"saved": saved, "loss": loss, "at_1x4": _reloaded(root, 1, 4)}
    hf_model = qwen3_moe(seed=6)
    parallelize_moe(hf_model, mesh(4, 1), EPPlan(1, [HF_PATTERN]))
    import_hf(hf_model, Path(root) / "hf")
    report["hf_import_4x1"] = {k: tensor_digest(v.full_tensor()) for k, v in hf_model.state_dict().items()}
    wrong_e = qwen3_moe(seed=5, num_experts=16)
    parallelize_moe(wrong_e, mesh(1, 4), EPPlan(4, [HF_PATTERN]))
    report["wrong_E"] = _error(lambda: load_checkpoint(Path(root) / "dcp", wrong_e))
    plain_shards = qwen3_moe(seed=5)
    apply_expert_parallel(plain_shards, None, EPPlan(4, [HF_PATTERN]))
    report["plain_shards"] = _error(lambda: save_checkpoint(Path(root) / "bad", plain_shards))
    # replicate_moe (plain expert shards) through its handle: the (2, 2) checkpoint loads at (1, 4)
    # and is saved again from there; the test process checks that copy bitwise.
    ddp = replicate_moe(qwen3_moe(seed=5), mesh(1, 4), EPPlan(4, [HF_PATTERN]))
    ddp_opt = torch.optim.AdamW(ddp.model.parameters(), lr=1e-2)
    load_checkpoint(Path(root) / "dcp", ddp, ddp_opt)
    save_checkpoint(Path(root) / "dcp_ddp_1x4", ddp, ddp_opt)
    report["ddp_shards"] = _error(lambda: save_checkpoint(Path(root) / "bad", ddp.model))
    return report


def _two_rank_worker(rank: int, world: int, root: str) -> dict:
    return _reloaded(root, 1, 2)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, list[dict], list[dict]]:
    root = tmp_path_factory.mktemp("dcp")
    four = run_ranks(_four_rank_worker, 4, str(root), timeout_s=240)
    two = run_ranks(_two_rank_worker, 2, str(root), timeout_s=180)
    return root, four, two


def test_metadata_records_the_whole_expert_shape(saved):
    root, _, _ = saved
    metadata = checkpoint_metadata(root / "dcp").state_dict_metadata
    assert tuple(metadata[f"model.{EXPERT_KEY}"].size) == (E, 32, 32)
    assert tuple(metadata[f"optim.state.{EXPERT_KEY}.exp_avg"].size) == (E, 32, 32)
    assert tuple(metadata["model.model.layers.0.mlp.experts.down_proj"].size) == (E, 32, 16)


def test_saved_at_2x2_loads_bitwise_at_1x4_and_1x2(saved):
    _, four, two = saved
    reference = four[0]["saved"]
    assert len(reference) > 40 and any(k.endswith("/exp_avg_sq") for k in reference)
    assert any(EXPERT_KEY in k and "exp_avg" in k for k in reference)
    for rank, report in enumerate(four):
        assert report["saved"] == reference, f"rank {rank}"
        assert report["at_1x4"]["digests"] == reference, f"(1, 4) rank {rank}"
        assert report["at_1x4"]["extra"] == {"step": 2, "losses": [4.5, 4.25]}
    for rank, report in enumerate(two):
        assert report["digests"] == reference, f"(1, 2) rank {rank}"


def test_saved_at_2x2_loads_bitwise_in_one_process(saved):
    root, four, _ = saved
    model = qwen3_moe(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    assert _digests(model, optimizer) != four[0]["saved"]  # the comparison below can fail
    extra = load_checkpoint(root / "dcp", model, optimizer)
    assert extra == {"step": 2, "losses": [4.5, 4.25]}
    assert _digests(model, optimizer) == four[0]["saved"]


def test_replicate_moe_loads_and_saves_through_its_handle(saved):
    root, four, _ = saved
    model = qwen3_moe(seed=7)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    load_checkpoint(root / "dcp_ddp_1x4", model, optimizer)
    assert _digests(model, optimizer) == four[0]["saved"]
    metadata = checkpoint_metadata(root / "dcp_ddp_1x4").state_dict_metadata
    assert tuple(metadata[f"optim.state.{EXPERT_KEY}.exp_avg"].size) == (E, 32, 32)


def test_hf_export_loads_with_from_pretrained(saved):
    root, four, _ = saved
    assert sorted(p.name for p in (root / "hf").iterdir()) == [
        "config.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
    ]  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", local_files_only=True)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    state = hf.state_dict()
    assert state[EXPERT_KEY].shape == (E, 32, 32)
    saved_model = {k.removeprefix("model/"): v for k, v in four[0]["saved"].items() if k.startswith("model/")}
    assert {k: tensor_digest(v) for k, v in state.items()} == saved_model
    assert four[0]["hf_import_4x1"] == saved_model  # and back into FSDP2 + EP through the HF reader
    ids = _batch(2)
    with torch.no_grad():
        hf_loss = hf(input_ids=ids, labels=ids).loss.item()
    plain = qwen3_moe(seed=7)
    load_checkpoint(root / "dcp", plain)
    with torch.no_grad():
        assert plain(input_ids=ids, labels=ids).loss.item() == hf_loss
    for rank, report in enumerate(four):  # the parallel model's loss on the same batch
        assert report["loss"] == pytest.approx(hf_loss, rel=1e-5), f"rank {rank}"


def test_mismatches_are_refused_on_every_rank(saved):
    _, four, _ = saved
    for report in four:
        assert report["wrong_E"].startswith("CheckpointError: "), report["wrong_E"]
        assert "tensor 'model.model.layers.0.mlp.experts.gate_up_proj' is (8, 32, 32)" in report["wrong_E"]
        assert "the target's is (16, 32, 32)" in report["wrong_E"] and ".distcp" in report["wrong_E"]
        assert report["plain_shards"].startswith("ValueError: model: expert parameter"), report["plain_shards"]
        assert "plain shard of shape (2, 32, 32) of E=8" in report["plain_shards"]
        assert report["ddp_shards"].startswith("ValueError: model: expert parameter"), report["ddp_shards"]
        assert "plain shard of shape (2, 32, 32) of E=8" in report["ddp_shards"]
        assert "Pass the ParallelizedMoe that parallelize_moe / replicate_moe returned" in report["ddp_shards"]


def test_non_finite_and_damaged_checkpoints_are_refused(tmp_path):
    model = qwen3_moe(seed=3)
    with torch.no_grad():
        model.model.layers[0].mlp.experts.down_proj[3, 1, 2] = float("nan")
    save_checkpoint(tmp_path / "nan", model)
    target = qwen3_moe(seed=4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(
        CheckpointError, match=r"__0_0\.distcp: tensor 'model\.model\.layers\.0\.mlp\.experts\.down_proj' holds NaN"
    ):
        load_checkpoint(tmp_path / "nan", target)
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())  # untouched

    save_checkpoint(tmp_path / "cut", qwen3_moe(seed=3))
    shard = tmp_path / "cut" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="cut'?: unreadable"):
        load_checkpoint(tmp_path / "cut", target)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "absent", target)
    with pytest.raises(CheckpointError, match="no readable DCP metadata"):
        load_checkpoint(tmp_path, target)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, got dict"):
        save_checkpoint(tmp_path / "x", target, {})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^directory: cannot write '.*file/ckpt\.tmp'"):
        save_checkpoint(tmp_path / "file" / "ckpt", target)
