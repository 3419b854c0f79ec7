"""EP-sharded checkpoints: saved at EP 4, loaded at EP 2 and EP 1 and back at EP 4, bitwise; damage refused.

One 4-rank spawn: the EP-2 models live on two 2-rank subgroups, the EP-1 model on each rank alone.
A table of damaged checkpoints (one process) each raise CheckpointError naming the file and the
tensor, and leave the model untouched.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_gmm.parallel import EPPlan, apply_expert_parallel
from moe_gmm.parallel.checkpoint import (
    CHECKSUM_KEY,
    INDEX_NAME,
    SINGLE_NAME,
    CheckpointError,
    load_ep_checkpoint,
    save_ep_checkpoint,
)
from moe_gmm.parallel.launch import run_ranks
from tests.helpers.ep_models import PATTERN
from tests.helpers.ep_models import tiny_moe_stack as _model


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


@pytest.mark.distributed
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


# ----------------------------------------------------------------------------------------------
# Damaged checkpoints (one process)
# ----------------------------------------------------------------------------------------------

PLAIN, EXPERT = "dense.0.weight", "layers.1.mlp.experts.down_proj"
PARTS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _rewrite(path: Path, edit: Callable[[dict, dict], None]) -> None:
    """Rewrite a safetensors file after ``edit(tensors, metadata)``, as a tool that ignores checksums would."""
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safetensors handle
    edit(tensors, metadata)
    save_file(tensors, str(path), metadata=metadata)


def _split(directory: Path) -> None:
    """The single file as two files plus an index, as a two-rank save lays them out."""
    single = directory / SINGLE_NAME
    with safe_open(str(single), framework="pt") as f:
        metadata = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safetensors handle
    keys = sorted(tensors)
    halves = {PARTS[0]: keys[::2], PARTS[1]: keys[1::2]}
    for name, part in halves.items():
        save_file({k: tensors[k] for k in part}, str(directory / name), metadata=metadata)
    weight_map = {k: name for name, part in halves.items() for k in part}
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    single.unlink()


def _flip_in(key: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / SINGLE_NAME
        raw = bytearray(path.read_bytes())
        n = int.from_bytes(raw[:8], "little")
        start, end = json.loads(raw[8 : 8 + n])[key]["data_offsets"]
        raw[8 + n + (start + end) // 2] ^= 0x01
        path.write_bytes(bytes(raw))

    return damage


def _edit(edit: Callable[[dict, dict], None]) -> Callable[[Path], None]:
    return lambda directory: _rewrite(directory / SINGLE_NAME, edit)


def _truncate(name: str) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / name
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    return damage


def _nan(tensors: dict, _meta: dict) -> None:
    tensors[EXPERT].view(-1)[3] = float("nan")


def _split_then(damage: Callable[[Path], None]) -> Callable[[Path], None]:
    def both(directory: Path) -> None:
        _split(directory)
        damage(directory)

    return both


def _set_index(value) -> Callable[[Path], None]:
    return lambda directory: (directory / INDEX_NAME).write_text(value if isinstance(value, str) else json.dumps(value))


def _move_tensor_in_index(directory: Path) -> None:
    index = json.loads((directory / INDEX_NAME).read_text())
    index["weight_map"][PLAIN] = next(p for p in PARTS if p != index["weight_map"][PLAIN])
    (directory / INDEX_NAME).write_text(json.dumps(index))


def _drop_digest(key: str) -> Callable[[dict, dict], None]:
    def edit(_tensors: dict, meta: dict) -> None:
        digests = json.loads(meta[CHECKSUM_KEY])
        del digests[key]
        meta[CHECKSUM_KEY] = json.dumps(digests)

    return edit


# (id, damage, the file the message must name, the tensor it must name or None)
CORRUPTIONS = [
    ("directory-missing", shutil.rmtree, "ckpt", None),
    ("no-files", lambda d: (d / SINGLE_NAME).unlink(), "ckpt", None),
    ("empty-file", lambda d: (d / SINGLE_NAME).write_bytes(b""), SINGLE_NAME, None),
    ("truncated-file", _truncate(SINGLE_NAME), SINGLE_NAME, None),
    ("header-length-garbage", lambda d: (d / SINGLE_NAME).write_bytes(b"\xff" * 8 + b"{}"), SINGLE_NAME, None),
    (
        "header-not-json",
        lambda d: (d / SINGLE_NAME).write_bytes((20).to_bytes(8, "little") + b"{not json" * 3),
        SINGLE_NAME,
        None,
    ),
    ("flipped-byte-plain-tensor", _flip_in(PLAIN), SINGLE_NAME, PLAIN),
    ("flipped-byte-expert-tensor", _flip_in(EXPERT), SINGLE_NAME, EXPERT),
    ("nan-injected", _edit(_nan), SINGLE_NAME, EXPERT),
    ("tensor-missing", _edit(lambda t, m: t.pop(PLAIN)), SINGLE_NAME, PLAIN),
    ("tensor-unexpected", _edit(lambda t, m: t.update(extra=torch.zeros(2))), SINGLE_NAME, "extra"),
    ("wrong-shape", _edit(lambda t, m: t.update({PLAIN: t[PLAIN][:4].clone()})), SINGLE_NAME, PLAIN),
    ("wrong-dtype", _edit(lambda t, m: t.update({PLAIN: t[PLAIN].double()})), SINGLE_NAME, PLAIN),
    ("checksums-stripped", _edit(lambda t, m: m.pop(CHECKSUM_KEY)), SINGLE_NAME, None),
    ("checksums-not-json", _edit(lambda t, m: m.update({CHECKSUM_KEY: "{oops"})), SINGLE_NAME, None),
    ("checksum-of-one-tensor-missing", _edit(_drop_digest(EXPERT)), SINGLE_NAME, EXPERT),
    ("index-not-json", _split_then(_set_index("{ nope")), INDEX_NAME, None),
    ("index-without-weight_map", _split_then(_set_index({"metadata": {}})), INDEX_NAME, None),
    ("index-file-missing", _split_then(lambda d: (d / PARTS[1]).unlink()), PARTS[1], None),
    ("index-maps-to-wrong-file", _split_then(_move_tensor_in_index), "-of-00002.safetensors", PLAIN),
    ("shard-file-truncated", _split_then(_truncate(PARTS[0])), PARTS[0], None),
]


@pytest.mark.parametrize(("case", "damage", "file", "tensor"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_damaged_checkpoint_names_file_and_tensor_and_leaves_the_model(case, damage, file, tensor, tmp_path):
    directory = tmp_path / "ckpt"
    save_ep_checkpoint(_model(seed=0, num_experts=8), directory)
    load_ep_checkpoint(_model(seed=1, num_experts=8), directory)  # intact, it loads
    damage(directory)
    target = _model(seed=1, num_experts=8)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError) as info:
        load_ep_checkpoint(target, directory)
    message = str(info.value)
    assert file in message, message
    assert tensor is None or repr(tensor) in message or tensor in message, message
    assert "\n" not in message
    for key, value in target.state_dict().items():
        assert torch.equal(value, before[key]), f"{case}: {key} changed"


def test_split_checkpoint_loads_and_checksums_are_per_expert(tmp_path):
    source = _model(seed=0, num_experts=8)
    save_ep_checkpoint(source, tmp_path)
    with safe_open(str(tmp_path / SINGLE_NAME), framework="pt") as f:
        digests = json.loads(f.metadata()[CHECKSUM_KEY])
    assert len(digests[EXPERT]) == 8 and isinstance(digests[PLAIN], str)
    _split(tmp_path)
    target = _model(seed=1, num_experts=8)
    load_ep_checkpoint(target, tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(source.state_dict().values(), target.state_dict().values()))


def test_files_without_checksums_load_only_when_asked(tmp_path):
    save_ep_checkpoint(_model(seed=0, num_experts=8), tmp_path)
    _rewrite(tmp_path / SINGLE_NAME, lambda t, m: m.pop(CHECKSUM_KEY))
    target = _model(seed=1, num_experts=8)
    with pytest.raises(CheckpointError, match="verify=False"):
        load_ep_checkpoint(target, tmp_path)
    load_ep_checkpoint(target, tmp_path, verify=False)
    assert torch.equal(target.state_dict()[PLAIN], _model(seed=0, num_experts=8).state_dict()[PLAIN])
