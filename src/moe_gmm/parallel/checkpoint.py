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
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moe_gmm.parallel.comm import collective
from moe_gmm.parallel.layout import EXPERT_PARAMS, ExpertShard, ExpertsLayout, experts_layout

__all__ = ["INDEX_NAME", "SINGLE_NAME", "load_ep_checkpoint", "save_ep_checkpoint"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


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
        save_file(mine, str(directory / file_of[rank]), metadata={"format": "pt"})
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
    index = directory / INDEX_NAME
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    single = directory / SINGLE_NAME
    if not single.exists():
        raise FileNotFoundError(f"directory: neither {INDEX_NAME} nor {SINGLE_NAME} in {str(directory)!r}")
    with safe_open(str(single), framework="pt") as f:
        return {k: SINGLE_NAME for k in f.keys()}  # noqa: SIM118 - a safetensors handle, not a dict


@torch.no_grad()
def load_ep_checkpoint(model: nn.Module, directory: str | os.PathLike) -> None:
    """Load a checkpoint written by :func:`save_ep_checkpoint` (at any EP size) into ``model``.

    ``model`` may be sharded at any EP size (or not at all); each rank reads only its own expert
    rows. Strict: a missing or unexpected key, or a shape or dtype that differs, raises
    ``ValueError`` before any parameter is touched.
    """
    directory = Path(directory)
    weight_map = _weight_map(directory)
    state = model.state_dict()
    experts = _expert_tensors(model)
    missing = sorted(set(state) - set(weight_map))
    unexpected = sorted(set(weight_map) - set(state))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {str(directory)!r} does not match the model: missing keys {missing[:8]}, "
            f"unexpected keys {unexpected[:8]}"
        )
    loaded: dict[str, torch.Tensor] = {}
    by_file: dict[str, list[str]] = {}
    for key in sorted(state):
        by_file.setdefault(weight_map[key], []).append(key)
    for fname, keys in by_file.items():
        with safe_open(str(directory / fname), framework="pt") as f:
            for key in keys:
                layout, shard = experts.get(key, (None, None))
                target = state[key]
                sl = f.get_slice(key)
                shape = tuple(sl.get_shape())
                if shape != _full_shape(target, layout, shard):
                    raise ValueError(
                        f"checkpoint tensor {key!r} has shape {shape}, the model expects "
                        f"{_full_shape(target, layout, shard)} (in the Hugging Face layout)"
                    )
                if shard is not None:
                    lo = shard.first_expert
                    tensor = sl[lo : lo + shard.num_local_experts]
                else:
                    tensor = f.get_tensor(key)
                if tensor.dtype != target.dtype:
                    raise ValueError(f"checkpoint tensor {key!r} is {tensor.dtype}, the model's is {target.dtype}")
                loaded[key] = layout.from_hf(tensor) if layout is not None else tensor
    for key, tensor in loaded.items():
        state[key].copy_(tensor)
