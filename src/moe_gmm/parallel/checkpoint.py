"""Save and load expert-parallel models as Hugging Face safetensors checkpoints, at any EP size.

The files on disk never depend on the EP size they were written at: every tensor is whole, in the
Hugging Face layout, under the model's ``state_dict()`` name, spread over
``model-0000i-of-0000n.safetensors`` files with a ``model.safetensors.index.json`` (or one
``model.safetensors``), as ``save_pretrained`` writes them. So a checkpoint saved at EP 4 loads at
EP 2, EP 1 (a plain model) or EP 4 again, bitwise, and a Hugging Face model loads it with
``from_pretrained``.

Expert weights are in the Hugging Face layout (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``);
``GroupedExperts`` (``[E, H, 2I]``, ``[E, I, H]``) is transposed on the way out and back in.

Saving (collective over the EP group): tensors are assigned to ranks to balance bytes; each sharded
expert tensor is gathered on the rank that writes it, one tensor at a time, so no rank holds more
than one whole expert tensor beyond its shards. Loading needs no communication: each rank reads
only its rows ``[r * E / ep, (r + 1) * E / ep)`` of each expert tensor from the file (a slice read).
All ranks must see the same directory (a shared filesystem across nodes).

For a model too large for one device: build it under ``torch.device("meta")``, call
``apply_expert_parallel``, then ``model.to_empty(device=...)`` (allocating only the local expert
shards) and :func:`load_ep_checkpoint`.

Integrity: each file's metadata holds ``moe_gmm.sha256``, a JSON map from tensor name to the sha256
of its bytes; expert tensors get one digest per expert, so a rank verifies exactly the rows it
reads. Loading verifies every tensor it reads; every failure (missing or truncated file, bad index
JSON, missing tensor, wrong shape or dtype, changed bytes) is a
:class:`~moe_gmm.checksum.CheckpointError` naming the file and the tensor, raised before any
parameter is touched.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moe_gmm.checksum import CheckpointError, tensor_digest
from moe_gmm.parallel.comm import collective
from moe_gmm.parallel.layout import EXPERT_PARAMS, ExpertShard, ExpertsLayout, experts_layout

__all__ = ["CHECKSUM_KEY", "INDEX_NAME", "SINGLE_NAME", "CheckpointError", "load_ep_checkpoint", "save_ep_checkpoint"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CHECKSUM_KEY = "moe_gmm.sha256"


def _expert_tensors(model: nn.Module) -> dict[str, tuple[ExpertsLayout, ExpertShard | None]]:
    """``state_dict`` key -> (layout, shard or None) for every experts parameter, sharded or not."""
    found = {}
    for name, module in model.named_modules():
        shard = getattr(module, "ep_shard", None)
        layout = shard.layout if shard is not None else experts_layout(module)[0]
        if layout is None:
            continue
        for pname in EXPERT_PARAMS:
            found[f"{name}.{pname}" if name else pname] = (layout, shard)
    return found


def _full_shape(t: torch.Tensor, layout: ExpertsLayout | None, shard: ExpertShard | None) -> tuple[int, ...]:
    shape = list(t.shape)
    if shard is not None:
        shape[0] = shard.num_experts
    if layout is not None and layout.hf_transpose:
        shape[1], shape[2] = shape[2], shape[1]
    return tuple(shape)


def _assign_writers(sizes: dict[str, int], num_ranks: int) -> dict[str, int]:
    """Greedy largest-first assignment of tensors to ranks by bytes; the same on every rank."""
    load = [0] * num_ranks
    owner = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        r = min(range(num_ranks), key=lambda i: (load[i], i))
        owner[key] = r
        load[r] += sizes[key]
    return owner


def save_ep_checkpoint(model: nn.Module, directory: str | os.PathLike, group: dist.ProcessGroup | None = None) -> None:
    """Write ``model``'s state dict to ``directory`` as a Hugging Face safetensors checkpoint.

    Every rank of ``group`` (the EP group the model was sharded over; ``None`` for the default group,
    or a single process when ``torch.distributed`` is not initialised) must call it. Returns after
    every rank has written its files. With data parallelism across EP groups, every EP group holds
    the whole model: let one of them (e.g. the one containing rank 0) save.
    """
    distributed = dist.is_available() and dist.is_initialized()
    rank, size = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    for shard in (getattr(m, "ep_shard", None) for m in model.modules()):
        if shard is not None and (shard.ep_size, shard.ep_rank) != (size, rank):
            raise ValueError(
                f"group: the model is sharded as rank {shard.ep_rank} of {shard.ep_size}, but this rank is "
                f"{rank} of {size} in the group given"
            )
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    experts = _expert_tensors(model)
    shapes = {k: _full_shape(t, *experts.get(k, (None, None))) for k, t in state.items()}
    nbytes = {k: state[k].element_size() * int(torch.Size(shapes[k]).numel()) for k in state}
    owner = _assign_writers(nbytes, size)
    writers = sorted(set(owner.values()))
    file_of = {
        r: (SINGLE_NAME if len(writers) == 1 else f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors")
        for i, r in enumerate(writers)
    }

    mine: dict[str, torch.Tensor] = {}
    for key in sorted(state):  # the same order on every rank: the gathers pair up
        tensor = state[key].detach()
        layout, shard = experts.get(key, (None, None))
        if shard is not None and shard.ep_size > 1:
            dst = owner[key]
            parts = [torch.empty_like(tensor) for _ in range(size)] if rank == dst else None
            with collective(f"checkpoint gather of {key}", group):
                dist.gather(
                    tensor.contiguous(), parts, dst=dist.get_global_rank(group, dst) if group else dst, group=group
                )
            if rank != dst:
                continue
            tensor = torch.cat(parts)
        elif owner[key] != rank:
            continue
        if layout is not None:
            tensor = layout.to_hf(tensor)
        # Own memory per tensor: safetensors refuses tensors that share storage (tied weights).
        mine[key] = tensor.clone(memory_format=torch.contiguous_format)
    if mine:
        # Expert tensors: one digest per expert (dim 0), the unit a sharded load reads.
        digests = {k: [tensor_digest(row) for row in t] if k in experts else tensor_digest(t) for k, t in mine.items()}
        metadata = {"format": "pt", CHECKSUM_KEY: json.dumps(digests, sort_keys=True)}
        save_file(mine, str(directory / file_of[rank]), metadata=metadata)
    if rank == writers[0] and len(writers) > 1:
        index = {
            "metadata": {"total_size": sum(nbytes.values())},
            "weight_map": {k: file_of[owner[k]] for k in sorted(state)},
        }
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    if distributed and size > 1:
        with collective("checkpoint barrier", group):
            dist.barrier(group=group)


def _weight_map(directory: Path) -> dict[str, str]:
    if not directory.is_dir():
        raise CheckpointError(f"checkpoint {str(directory)!r}: not a directory")
    index = directory / INDEX_NAME
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"checkpoint index {str(index)!r}: unreadable ({type(exc).__name__}: {exc})"
            ) from None
        bad = [k for k, v in weight_map.items() if not isinstance(v, str)] if isinstance(weight_map, dict) else [""]
        if bad:
            raise CheckpointError(f"checkpoint index {str(index)!r}: weight_map entry {bad[0]!r} is not a file name")
        return weight_map
    single = directory / SINGLE_NAME
    if not single.exists():
        raise CheckpointError(f"checkpoint {str(directory)!r}: neither {INDEX_NAME} nor {SINGLE_NAME} in it")
    with _reading(single, None), safe_open(str(single), framework="pt") as f:
        return {k: SINGLE_NAME for k in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict


@contextlib.contextmanager
def _reading(path: Path, key: str | None):
    """Turn whatever the safetensors reader raises into a CheckpointError naming the file (and tensor)."""
    try:
        yield
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - missing, truncated or malformed files raise many types
        tensor = f", tensor {key!r}" if key is not None else ""
        raise CheckpointError(
            f"checkpoint file {str(path)!r}{tensor}: unreadable ({type(exc).__name__}: {exc})"
        ) from None


def _digests(f, path: Path, verify: bool) -> dict:
    if not verify:
        return {}
    raw = (f.metadata() or {}).get(CHECKSUM_KEY)
    if raw is None:
        raise CheckpointError(
            f"checkpoint file {str(path)!r}: no {CHECKSUM_KEY} checksums (not written by save_ep_checkpoint; "
            "pass verify=False to load it unchecked)"
        )
    try:
        digests = json.loads(raw)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint file {str(path)!r}: {CHECKSUM_KEY} is not JSON ({exc})") from None
    if not isinstance(digests, dict):
        raise CheckpointError(f"checkpoint file {str(path)!r}: {CHECKSUM_KEY} is not a JSON object")
    return digests


def _verify(tensor: torch.Tensor, expected, first_row: int, full: bool, path: Path, key: str) -> None:
    """``tensor`` is rows ``[first_row, ...)`` of the stored tensor (all of it when ``full``)."""
    if isinstance(expected, list):  # one digest per expert
        wanted = expected[first_row : first_row + tensor.shape[0]]
        ok = len(wanted) == tensor.shape[0] and all(tensor_digest(r) == d for r, d in zip(tensor, wanted))
        ok = ok and (not full or len(expected) == tensor.shape[0])
    elif isinstance(expected, str) and full:
        ok = tensor_digest(tensor) == expected
    else:
        raise CheckpointError(f"checkpoint file {str(path)!r}, tensor {key!r}: no usable checksum ({expected!r:.80})")
    if not ok:
        raise CheckpointError(
            f"checkpoint file {str(path)!r}, tensor {key!r}: does not match its checksum (the data changed)"
        )


@torch.no_grad()
def load_ep_checkpoint(model: nn.Module, directory: str | os.PathLike, *, verify: bool = True) -> None:
    """Load a checkpoint written by :func:`save_ep_checkpoint` (at any EP size) into ``model``.

    ``model`` may be sharded at any EP size (or not at all); each rank reads only its own expert
    rows. Strict: a missing or unexpected key, a shape or dtype that differs, or (``verify``) a
    tensor whose bytes do not match their checksum raises :class:`CheckpointError` (a
    ``ValueError``) naming the file and the tensor, before any parameter is touched.
    ``verify=False`` loads files without checksums (e.g. from ``save_pretrained``).
    """
    directory = Path(directory)
    weight_map = _weight_map(directory)
    state = model.state_dict()
    experts = _expert_tensors(model)
    missing = sorted(set(state) - set(weight_map))
    unexpected = sorted(set(weight_map) - set(state))
    if missing or unexpected:
        source = directory / (INDEX_NAME if (directory / INDEX_NAME).exists() else SINGLE_NAME)
        raise CheckpointError(
            f"checkpoint {str(source)!r} does not match the model: missing tensors {missing[:8]}, "
            f"unexpected tensors {unexpected[:8]}"
        )
    loaded: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for key in sorted(state):
        by_file.setdefault(weight_map[key], []).append(key)
    for fname, keys in by_file.items():
        path = directory / fname
        with _reading(path, None), safe_open(str(path), framework="pt") as f:
            digests = _digests(f, path, verify)
            for key in keys:
                with _reading(path, key):
                    loaded[key] = _read_tensor(f, path, key, state[key], *experts.get(key, (None, None)))
                    if verify:
                        if key not in digests:
                            raise CheckpointError(f"checkpoint file {str(path)!r}, tensor {key!r}: no checksum")
                        shard = experts.get(key, (None, None))[1]
                        first, full = (shard.first_expert, False) if shard is not None else (0, True)
                        _verify(loaded[key], digests[key], first, full, path, key)
                    layout = experts.get(key, (None, None))[0]
                    if layout is not None:
                        loaded[key] = layout.from_hf(loaded[key])
    for key, tensor in loaded.items():
        state[key].copy_(tensor)


def _read_tensor(
    f, path: Path, key: str, target: torch.Tensor, layout: ExpertsLayout | None, shard: ExpertShard | None
) -> torch.Tensor:
    """The stored (Hugging Face layout) tensor, or this rank's expert rows of it, shape and dtype checked."""
    where = f"checkpoint file {str(path)!r}, tensor {key!r}"
    sl = f.get_slice(key)
    shape = tuple(sl.get_shape())
    if shape != _full_shape(target, layout, shard):
        raise CheckpointError(
            f"{where}: has shape {shape}, the model expects "
            f"{_full_shape(target, layout, shard)} (in the Hugging Face layout)"
        )
    if shard is not None:
        lo = shard.first_expert
        tensor = sl[lo : lo + shard.num_local_experts]
    else:
        tensor = f.get_tensor(key)
    if tensor.dtype != target.dtype:
        raise CheckpointError(f"{where}: is {tensor.dtype}, the model's is {target.dtype}")
    return tensor
