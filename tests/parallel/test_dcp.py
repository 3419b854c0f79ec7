"""DCP checkpoints of ``parallelize_moe`` models: saved at (dp 2, ep 2), loaded bitwise at (1, 2), (1, 4)
and in one process (model and AdamW state), the experts recorded with their whole E; the Hugging
Face export loads with ``from_pretrained``; damaged or mismatched checkpoints are refused by name.

A tiny Qwen3-MoE causal LM (E=8) on real gloo ranks: one 4-rank spawn saves and reloads, one
2-rank spawn reloads, the test process itself loads without a process group.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

transformers = pytest.importorskip("transformers")

from moe_gmm.checksum import CheckpointError, tensor_digest
from moe_gmm.integrations.transformers import register_moe_gmm_experts
from moe_gmm.parallel import EPPlan, apply_expert_parallel, parallelize_moe, replicate_moe
from moe_gmm.parallel.dcp import _state as dcp_state
from moe_gmm.parallel.dcp import (
    checkpoint_extra,
    checkpoint_metadata,
    export_hf,
    import_hf,
    load_checkpoint,
    save_checkpoint,
)
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
        "config.json", "manifest.json", "model-00001-of-00001.safetensors", "model.safetensors.index.json",
    ]  # fmt: skip
    register_moe_gmm_experts()  # the export names its experts implementation; it must exist here
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", local_files_only=True)
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert hf.config._experts_implementation == "moe_gmm"  # from config.json, not the default
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
    with pytest.raises(CheckpointError, match=r"cut', file __0_0\.distcp: 1000 bytes, signed with \d+"):
        load_checkpoint(tmp_path / "cut", target)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_checkpoint(tmp_path / "absent", target)
    with pytest.raises(CheckpointError, match="no manifest.json"):
        load_checkpoint(tmp_path, target)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or None, got dict"):
        save_checkpoint(tmp_path / "x", target, {})
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"^directory: cannot write '.*file/ckpt\.tmp'"):
        save_checkpoint(tmp_path / "file" / "ckpt", target)


# ----------------------------------------------------------------------------------------------
# Signed checkpoints: one changed bit anywhere is refused, naming the file (and what it held)
# ----------------------------------------------------------------------------------------------


def _stepped(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = qwen3_moe(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = _batch(2)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


@pytest.fixture(scope="module")
def signed(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("signed")
    model, optimizer = _stepped(3)
    save_checkpoint(root / "ckpt", model, optimizer, extra={"step": 1, "losses": [4.5]})
    export_hf(model, root / "hf")
    return root


def _flip_bit(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def _holder(directory: Path, file: str, at: int) -> str | None:
    """``"tensor 'fqn'"`` / ``"value 'key'"`` whose signed byte range holds byte ``at`` of ``file``."""
    items = json.loads((directory / "manifest.json").read_text())["items"]
    for name, entry in items.items():
        for r in entry["ranges"]:
            if r["file"] == file and r["offset"] <= at < r["offset"] + r["length"]:
                return f"{entry['kind']} {name!r}"
    return None


FRACTIONS = (0.0, 0.13, 0.37, 0.5, 0.71, 0.93, 1.0)


@pytest.mark.parametrize("fraction", FRACTIONS)
@pytest.mark.parametrize("file", [".metadata", "__0_0.distcp", "manifest.json"])
def test_one_flipped_bit_anywhere_is_refused_and_nothing_is_touched(signed, tmp_path, file, fraction):
    shutil.copytree(signed / "ckpt", tmp_path / "ckpt")
    size = (tmp_path / "ckpt" / file).stat().st_size
    at = min(int(size * fraction), size - 1)
    _flip_bit(tmp_path / "ckpt" / file, at)
    target, optimizer = _stepped(4)
    before = _digests(target, optimizer)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(tmp_path / "ckpt", target, optimizer)
    message = str(info.value)
    assert f"checkpoint {str(tmp_path / 'ckpt')!r}, file {file}: " in message, message
    if file == "__0_0.distcp":  # every byte lies in a tensor's (or a pickled value's) range: it is named
        assert f"{_holder(signed / 'ckpt', file, at)} does not match its sha256" in message, message
    assert _digests(target, optimizer) == before  # model and optimizer untouched
    with pytest.raises(CheckpointError, match=re.escape(f"file {file}")):
        checkpoint_extra(tmp_path / "ckpt", ("step",))


def test_every_shard_byte_range_is_named_and_the_pickled_values_are_covered(signed):
    items = json.loads((signed / "ckpt" / "manifest.json").read_text())["items"]
    # Step, losses and the optimizer's lr are signed like the tensors (a changed lr is refused by name).
    assert {items[k]["kind"] for k in ("extra.step", "extra.losses", "optim.param_groups.0.lr")} == {"value"}
    assert items[f"model.{EXPERT_KEY}"]["kind"] == "tensor"
    ranges = sorted((r["offset"], r["length"]) for e in items.values() for r in e["ranges"])
    size = (signed / "ckpt" / "__0_0.distcp").stat().st_size
    covered = sum(length for _, length in ranges)
    assert covered == size and ranges[0][0] == 0  # every byte of the shard belongs to a named item


def test_a_forged_step_or_lr_is_refused(signed, tmp_path):
    import torch.distributed.checkpoint as dcp

    shutil.copytree(signed / "ckpt", tmp_path / "ckpt")
    items = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["items"]
    lr = items["optim.param_groups.0.lr"]["ranges"][0]
    _flip_bit(tmp_path / "ckpt" / lr["file"], lr["offset"] + lr["length"] - 12)
    with pytest.raises(CheckpointError, match=r"value 'optim\.param_groups\.0\.lr' does not match its sha256"):
        load_checkpoint(tmp_path / "ckpt", *_stepped(4))
    # A step rewritten with DCP itself (a well-formed checkpoint, not the one signed): refused.
    shutil.rmtree(tmp_path / "ckpt")
    shutil.copytree(signed / "ckpt", tmp_path / "ckpt")
    (tmp_path / "ckpt" / "__0_0.distcp").unlink()
    model, optimizer = _stepped(3)
    _, state, _ = dcp_state(model, optimizer)
    state["extra"] = {"step": 7, "losses": [4.5]}
    with warnings.catch_warnings():  # one process, and the overwrite, are what this forgery does
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, checkpoint_id=str(tmp_path / "ckpt"), no_dist=True)
    with pytest.raises(CheckpointError, match=r"file (\.metadata|__0_0\.distcp): "):
        checkpoint_extra(tmp_path / "ckpt", ("step",))


def test_import_hf_verifies_the_export(signed, tmp_path):
    shutil.copytree(signed / "hf", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["experts_implementation"] == "moe_gmm"
    items = json.loads((tmp_path / "hf" / "manifest.json").read_text())["items"]
    where = items[EXPERT_KEY]["ranges"][0]
    _flip_bit(tmp_path / "hf" / where["file"], where["offset"] + 5)
    target = qwen3_moe(seed=4)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"file {where['file']}: tensor '{EXPERT_KEY}' does not match"):
        import_hf(target, tmp_path / "hf")
    assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items())
    # Another program's export carries no manifest: refused unless asked to read it unsigned.
    shutil.rmtree(tmp_path / "hf")
    shutil.copytree(signed / "hf", tmp_path / "hf")
    (tmp_path / "hf" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no manifest.json"):
        import_hf(target, tmp_path / "hf")
    import_hf(target, tmp_path / "hf", signed=False)
    with pytest.raises(TypeError, match="signed must be a bool, got str"):
        import_hf(target, tmp_path / "hf", signed="no")
