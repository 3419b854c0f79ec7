"""Checkpoints through ``torch.distributed.checkpoint`` (DCP): model and optimizer, any (dp, ep).

A checkpoint is a DCP directory holding ``model.<fqn>`` (every parameter and buffer, whole
shapes), ``optim.*`` (the optimizer state keyed by parameter name, from
``torch.distributed.checkpoint.state_dict.get_state_dict``) and ``extra.*`` (small Python values,
e.g. the step). Under :func:`~moe_gmm.parallel.fsdp.parallelize_moe` every tensor is a DTensor, so
each rank writes its own shard and DCP records the global shape: experts ``[E, ., .]``, whatever
(dp, ep) they were saved at. Loading reshards to the target's layout: another (dp, ep), or one
process without a process group (a plain model).

Plain expert shards (:func:`~moe_gmm.parallel.ddp.replicate_moe`) are saved through the
:class:`~moe_gmm.parallel.mesh.ParallelizedMoe` handle, which knows the mesh: they are given their
global shape (``Shard(0)`` on ep, replicated over the data dims) for the save and the load. A bare
module holding plain shards is refused: DCP would record the local ``[E / ep, ., .]`` as the
global shape and silently keep one rank's experts.

Every checkpoint is signed: once DCP has written every rank's files, rank 0 adds a
``manifest.json`` (:mod:`moe_gmm.checksum`) with the sha256 of each file and of each tensor chunk
and pickled value at the byte range DCP's metadata gives it, so the step, the losses and the
optimizer's ``lr`` are covered as much as the weights. The directory is written beside the old one
and renamed into place once signed.

Loading verifies the manifest first (nothing is read from an unsigned or changed file), then
checks the metadata against the target (every key present, every shape and dtype equal, experts
holding E rows), reads into fresh buffers, refuses non-finite values, and only then copies into
the model and optimizer. Every failure is a :class:`~moe_gmm.checksum.CheckpointError` naming the
directory, and where one is to blame the file and the tensor, raised on every rank together.

:func:`export_hf` / :func:`import_hf` go through DCP's Hugging Face storage writer and reader:
consolidated ``model-*.safetensors`` files that ``from_pretrained`` loads, signed the same way
(tensor ranges from the safetensors header), with ``experts_implementation`` in ``config.json`` so
``from_pretrained`` runs the experts the way the exported model did.

The one way to call them: pass the handle ``parallelize_moe`` / ``replicate_moe`` returned (or a
plain module in one process), e.g. ``save_checkpoint("ckpt", par, optimizer, extra={"step": 3})``.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.nn.parallel import DistributedDataParallel

from moe_gmm.checksum import ByteRange, CheckpointError, verify_manifest, write_manifest
from moe_gmm.parallel.layout import EXPERT_PARAMS
from moe_gmm.parallel.mesh import MoeMesh, ParallelizedMoe

__all__ = [
    "checkpoint_extra",
    "checkpoint_metadata",
    "export_hf",
    "import_hf",
    "load_checkpoint",
    "save_checkpoint",
    "verify_checkpoint",
]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _dcp(call: Callable[..., Any], state: dict[str, Any], **kwargs: Any) -> Any:
    """``dcp.save`` / ``dcp.load`` over the default group, or in one process without its warning."""
    with warnings.catch_warnings():
        # One process without a process group is a supported use here, not a mistake to warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        return call(state, no_dist=not _distributed(), **kwargs)


def _expert_rows(model: nn.Module) -> dict[str, int]:
    """``fqn -> E`` for every parameter of a sharded experts module (``ep_shard``)."""
    rows = {}
    for name, module in model.named_modules():
        shard = getattr(module, "ep_shard", None)
        if shard is not None:
            for pname in EXPERT_PARAMS:
                rows[f"{name}.{pname}" if name else pname] = shard.num_experts
    return rows


def _check_experts_global(model: nn.Module, state: dict[str, Any]) -> None:
    if isinstance(model, DistributedDataParallel):  # the state dict's names are the inner module's
        model = model.module
    for fqn, num_experts in _expert_rows(model).items():
        value = state.get(fqn)
        if value is not None and value.shape[0] != num_experts:
            raise ValueError(
                f"model: expert parameter {fqn!r} is a plain shard of shape {tuple(value.shape)} of E={num_experts} "
                "experts; DCP would record the shard's shape as the whole and lose the other ranks' experts. "
                "Pass the ParallelizedMoe that parallelize_moe / replicate_moe returned (it knows the mesh)"
            )


def _resolve(model: nn.Module | ParallelizedMoe) -> tuple[nn.Module, MoeMesh | None]:
    """The module whose state is saved, and the mesh its plain expert shards are spread over (if known)."""
    if isinstance(model, ParallelizedMoe):
        return model.module, model.mesh
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a ParallelizedMoe, got {type(model).__name__}")
    return model, None


def _as_global(state: dict[str, Any], module: nn.Module, mesh: MoeMesh | None) -> list[str]:
    """Give plain expert shards (``replicate_moe``) and their optimizer state their global DTensor shape.

    A shard of rank ``r`` of ``ep`` is rows ``[r * E / ep, (r + 1) * E / ep)``: ``Shard(0)`` on the ep
    dim, replicated over the data dims. Returns the names wrapped, to unwrap after a load.
    """
    if mesh is None:
        return []
    params = dict(module.named_parameters())
    placements = [Shard(0) if n == mesh.ep_dim else Replicate() for n in mesh.mesh.mesh_dim_names]
    wrapped = []
    for fqn, num_experts in _expert_rows(module).items():
        local_shape = params[fqn].shape
        if isinstance(params[fqn], DTensor):
            continue
        shape = torch.Size((num_experts, *local_shape[1:]))
        stride = torch.empty(shape, device="meta").stride()
        entry = state.get("optim", {}).get("state", {}).get(fqn, {})
        for holder, key in [(state["model"], fqn), *((entry, k) for k in entry)]:
            t = holder[key]
            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.shape == local_shape:
                holder[key] = DTensor.from_local(t, mesh.mesh, placements, run_check=False, shape=shape, stride=stride)
        wrapped.append(fqn)
    return wrapped


def _as_local(state: dict[str, Any], wrapped: list[str]) -> None:
    """Undo :func:`_as_global` on a loaded state: this rank's rows of each expert tensor."""
    for fqn in wrapped:
        entry = state.get("optim", {}).get("state", {}).get(fqn, {})
        for holder, key in [(state["model"], fqn), *((entry, k) for k in entry)]:
            if isinstance(holder[key], DTensor):
                holder[key] = holder[key].to_local()


def _check_optimizer(optimizer: Any) -> None:
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _state(
    model: nn.Module | ParallelizedMoe, optimizer: torch.optim.Optimizer | None
) -> tuple[nn.Module, dict[str, Any], list[str]]:
    """``(module, {"model": ..., "optim": ...}, wrapped)``: the state with every expert tensor global."""
    module, mesh = _resolve(model)
    _check_optimizer(optimizer)
    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
    else:
        model_state, optim_state = get_state_dict(module, optimizer)
        state = {"model": model_state, "optim": optim_state}
    wrapped = _as_global(state, module, mesh)
    _check_experts_global(module, state["model"])
    return module, state, wrapped


def save_checkpoint(
    directory: str | os.PathLike,
    model: nn.Module | ParallelizedMoe,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write ``model`` (and ``optimizer``'s state, and ``extra``) to the DCP directory ``directory``, signed.

    ``model``: the handle ``parallelize_moe`` / ``replicate_moe`` returned, or a plain module in
    one process. Collective over the default process group when one exists (every rank writes its
    shards); one process otherwise. ``extra``: small picklable values (step, losses) restored by
    :func:`load_checkpoint`. The directory is written and signed beside the old one and swapped in
    once complete, so a run killed while saving keeps its previous checkpoint.
    """
    _, state, _ = _state(model, optimizer)
    if extra is not None:
        if not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict or None, got {type(extra).__name__}")
        state["extra"] = dict(extra)
    path = Path(directory)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    main = not _distributed() or dist.get_rank() == 0
    problem = None
    if main:
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as exc:
            problem = f"directory: cannot write {str(tmp)!r} ({type(exc).__name__}: {exc.strerror or exc})"
    _agree(problem, ValueError)  # the other ranks would otherwise wait for rank 0 until the timeout
    _dcp(dcp.save, state, checkpoint_id=str(tmp))
    if main:  # every rank's files and the metadata are written when save returns
        _sign_dcp(tmp)
        shutil.rmtree(old, ignore_errors=True)
        if path.exists():
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    if _distributed():
        dist.barrier()


def _sign_dcp(directory: Path) -> None:
    """``manifest.json`` over the files DCP wrote and the byte range of every item its metadata indexes."""
    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    items: dict[str, list[ByteRange]] = {}
    for index, info in sorted((metadata.storage_data or {}).items(), key=lambda kv: (kv[0].fqn, str(kv[0].offset))):
        items.setdefault(index.fqn, []).append(ByteRange(info.relative_path, info.offset, info.length))
    values = frozenset(k for k, md in metadata.state_dict_metadata.items() if isinstance(md, BytesStorageMetadata))
    write_manifest(directory, items, values)


def verify_checkpoint(directory: str | os.PathLike) -> None:
    """Check every byte of a signed checkpoint against its ``manifest.json``.

    :class:`CheckpointError` names the file and the tensor that changed.

    :func:`load_checkpoint`, :func:`checkpoint_extra` and :func:`checkpoint_metadata` call it first.
    """
    verify_manifest(directory)


def checkpoint_metadata(directory: str | os.PathLike) -> Metadata:
    """The DCP metadata of ``directory`` (keys, global shapes, dtypes, files), verified against its manifest.

    :class:`CheckpointError` if unsigned, changed or unreadable.
    """
    path = Path(directory)
    verify_checkpoint(path)
    try:
        return dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a missing or damaged .metadata raises many types
        raise CheckpointError(
            f"checkpoint {str(path)!r}: no readable DCP metadata ({type(exc).__name__}: {exc})"
        ) from None


def checkpoint_extra(directory: str | os.PathLike, keys: tuple[str, ...]) -> dict[str, Any]:
    """The ``extra`` values ``keys`` of a :func:`save_checkpoint` directory, without a model (collective if distributed)."""
    metadata = checkpoint_metadata(directory)
    missing = [k for k in keys if f"extra.{k}" not in metadata.state_dict_metadata]
    if missing:
        raise CheckpointError(f"checkpoint {str(directory)!r}: no {missing} (not written by save_checkpoint?)")
    target: dict[str, Any] = {f"extra.{k}": None for k in keys}
    try:
        _dcp(dcp.load, target, checkpoint_id=str(directory))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        raise CheckpointError(f"checkpoint {str(directory)!r}: unreadable ({_cause(exc)})") from None
    return {k: target[f"extra.{k}"] for k in keys}


def _files_of(metadata: Metadata, key: str) -> str:
    files = sorted({info.relative_path for idx, info in (metadata.storage_data or {}).items() if idx.fqn == key})
    return ", ".join(files) if files else "?"


def _check_against(metadata: Metadata, flat: dict[str, Any], where: str) -> str | None:
    """The first key of ``flat`` the checkpoint lacks or holds with another shape or dtype, described."""
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if key not in saved:
            return f"{where}: tensor {key!r} of the target is not in the checkpoint"
        if not isinstance(value, torch.Tensor):
            continue
        md = saved[key]
        if not isinstance(md, TensorStorageMetadata):
            return f"{where}: {key!r} is not a tensor in the checkpoint"
        if tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
            return (
                f"{where}, file {_files_of(metadata, key)}: tensor {key!r} is {tuple(md.size)} "
                f"{md.properties.dtype}, the target's is {tuple(value.shape)} {value.dtype}"
            )
    return None


def _first_non_finite(flat: dict[str, Any]) -> str | None:
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            local = value.to_local() if isinstance(value, DTensor) else value
            if not bool(torch.isfinite(local).all()):  # HOST SYNC: once per tensor, at load time
                return key
    return None


def _agree(problem: str | None, error: type[Exception] = CheckpointError) -> None:
    """Raise ``problem`` on every rank if any rank has one (a rank raising alone would hang the others)."""
    problems = [problem]
    if _distributed():
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    found = [(r, p) for r, p in enumerate(problems) if p is not None]
    if found:
        rank, message = found[0]
        raise error(message if len(problems) == 1 else f"{message} (rank {rank})")


def _cause(exc: BaseException) -> str:
    """The first rank's underlying error of a DCP failure (its own message is a whole traceback)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = min(failures.items())
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"rank {rank}: {type(inner).__name__}: {' '.join(str(inner).split())[:300]}"
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"


def _empty_like(flat: dict[str, Any]) -> dict[str, Any]:
    # Fresh buffers: a checkpoint found bad after reading must not have touched the model.
    return {k: torch.empty_like(v) if isinstance(v, torch.Tensor) else v for k, v in flat.items()}


@torch.no_grad()
def load_checkpoint(
    directory: str | os.PathLike, model: nn.Module | ParallelizedMoe, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """Load a :func:`save_checkpoint` directory into ``model`` (and ``optimizer``); return its ``extra``.

    ``model`` may be parallelized at any (dp, ep) (``parallelize_moe``, or the handle
    ``replicate_moe`` returned), or plain in one process. Collective over the default process group
    when one exists. Build the optimizer first (its state is created here, then overwritten).
    """
    where = f"checkpoint {str(directory)!r}"
    metadata = checkpoint_metadata(directory)
    module, state, wrapped = _state(model, optimizer)
    flat, mapping = flatten_state_dict(state)
    problem = _check_against(metadata, flat, where)
    extra_keys = [k for k in metadata.state_dict_metadata if k.startswith("extra.")]
    _agree(problem)

    target = _empty_like(flat)
    for key in extra_keys:
        target[key] = None
    try:
        _dcp(dcp.load, target, checkpoint_id=str(directory))
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - truncated or missing files raise many types
        raise CheckpointError(f"{where}: unreadable ({_cause(exc)})") from None
    bad = _first_non_finite({k: target[k] for k in flat})
    _agree(None if bad is None else f"{where}, file {_files_of(metadata, bad)}: tensor {bad!r} holds NaN or inf")

    loaded = unflatten_state_dict({k: target[k] for k in flat}, mapping)
    _as_local(loaded, wrapped)
    if optimizer is None:
        set_model_state_dict(module, loaded["model"])
    else:
        set_state_dict(module, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    return {k.removeprefix("extra."): target[k] for k in extra_keys}


def export_hf(model: nn.Module | ParallelizedMoe, directory: str | os.PathLike) -> None:
    """Write ``model``'s weights as consolidated Hugging Face safetensors (plus ``config.json`` if it has one).

    Collective over the default process group when one exists; works on a parallelized model
    (every rank writes its shards, then they are merged into whole tensors) or a plain one. A
    Hugging Face model's parameters are its checkpoint's layout, so ``from_pretrained(directory)``
    loads the result; ``config.json`` records the model's ``experts_implementation``, so it runs the
    same experts path (register it in the loading process first). Signed like a checkpoint.
    """
    model, state, _ = _state(model, None)
    state = state["model"]
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    writer = dcp.HuggingFaceStorageWriter(str(path), save_distributed=True, enable_consolidation=True)
    _dcp(dcp.save, state, storage_writer=writer)
    if not _distributed() or dist.get_rank() == 0:
        # The per-rank files the consolidation merged: from_pretrained needs only the merged ones.
        shutil.rmtree(path / "sharded", ignore_errors=True)
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "save_pretrained"):
            _save_config(config, path)
        write_manifest(path, _safetensors_items(path))
    if _distributed():
        dist.barrier()


def _save_config(config: Any, path: Path) -> None:
    """``config.json`` with the experts implementation, which ``save_pretrained`` leaves out."""
    config.save_pretrained(str(path))
    impl = getattr(config, "_experts_implementation", None)
    if isinstance(impl, str):
        file = path / "config.json"
        data = json.loads(file.read_text())
        data["experts_implementation"] = impl
        tmp = file.with_name(file.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, file)


def _safetensors_items(path: Path) -> dict[str, list[ByteRange]]:
    """The byte range of every tensor in the ``*.safetensors`` files of ``path``, from their headers."""
    items: dict[str, list[ByteRange]] = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))  # the format: u64 header length, JSON header, data
            header = json.loads(f.read(size))
        for name, info in header.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                items.setdefault(name, []).append(ByteRange(file.name, 8 + size + begin, end - begin))
    return items


@torch.no_grad()
def import_hf(model: nn.Module | ParallelizedMoe, directory: str | os.PathLike, *, signed: bool = True) -> None:
    """Load Hugging Face safetensors (e.g. from :func:`export_hf` or ``save_pretrained``) into ``model``.

    ``model`` may be parallelized (each rank reads its shards) or plain. The files are verified
    against :func:`export_hf`'s ``manifest.json`` first; ``signed=False`` reads another program's
    export, which carries none. Shapes and dtypes are checked against the files and non-finite
    values refused, as in :func:`load_checkpoint`.
    """
    if not isinstance(signed, bool):
        raise TypeError(f"signed must be a bool, got {type(signed).__name__}")
    path = Path(directory)
    where = f"checkpoint {str(path)!r}"
    if signed:
        verify_manifest(path)
    module, state, wrapped = _state(model, None)
    reader = dcp.HuggingFaceStorageReader(str(path))
    try:
        metadata = reader.read_metadata()
    except Exception as exc:  # noqa: BLE001 - missing or malformed safetensors raise many types
        raise CheckpointError(f"{where}: no readable safetensors ({type(exc).__name__}: {exc})") from None
    _agree(_check_against(metadata, state["model"], where))
    target = _empty_like(state["model"])
    try:
        _dcp(dcp.load, target, storage_reader=reader)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001
        raise CheckpointError(f"{where}: unreadable ({_cause(exc)})") from None
    bad = _first_non_finite(target)
    _agree(None if bad is None else f"{where}, file {_files_of(metadata, bad)}: tensor {bad!r} holds NaN or inf")
    loaded = {"model": target}
    _as_local(loaded, wrapped)
    set_model_state_dict(module, loaded["model"])
