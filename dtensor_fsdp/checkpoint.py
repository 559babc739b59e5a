"""Distributed checkpoints of a training run, written with torch.distributed.checkpoint.

A checkpoint is one directory per step, holding DCP's files (every rank writes its own
shards; DCP reshards them on load, so a run saved on N ranks resumes on M ranks or on
another mesh layout), the trainer's ``extra`` state and a ``COMPLETE`` marker::

    directory/
      step_00000020/          complete: the marker is the last thing written
        .metadata  __0_0.distcp  __1_0.distcp  extra.pt  COMPLETE
      step_00000030.tmp/      being written, or interrupted: never loaded

[Note: checkpoint completion] A checkpoint is complete iff its directory has the final
name (no ``.tmp``) and holds a ``COMPLETE`` marker whose recorded file sizes match the
files on disk. ``save_checkpoint`` writes everything into ``step_N.tmp/``, waits for
every rank (barrier), then rank 0 writes the marker (itself via a rename, so it is never
half-written) and renames the directory with ``os.replace``. A crash at any point leaves
either a ``.tmp`` directory or a complete checkpoint; a final directory without a valid
marker (copied by hand, truncated later) is skipped too. ``latest_checkpoint``,
``load_checkpoint`` and pruning apply this one test (``_read_marker``).

[Note: checkpoint checksums] The marker (format version 2) also records each file's
CRC32, which catches what sizes cannot: a file overwritten in place, a flipped bit.
CRC32 (``zlib.crc32``, about 1 GB/s on one core) detects every error burst up to 32
bits; it guards against corruption, not against an attacker, who can rewrite the
marker too (see [Note: loading runs no code]). On save every rank checksums a stripe of
the files (``names[rank::world_size]``) and rank 0 records them all; on load every rank
verifies its stripe and the ranks agree before anything is read into the model, so no
file is read twice for verification. ``latest_checkpoint``, which needs no process
group, verifies whole checkpoints, newest first, until one passes. Markers without
a version (written before checksums existed) are loaded on sizes alone, with a warning.

Resuming on another world size: ``extra`` (step, data position, anything global) is
saved once and comes back unchanged, so a global data position carries over. Per-rank
entries (``rank_extra``: e.g. each rank's generator state) are saved keyed by global
rank and come back only when the world size is the one they were saved with;
otherwise ``LoadedCheckpoint.rank_extra`` is ``None`` and the trainer re-derives them
from its seed and the step, exactly as a fresh run of that world size would.

The directory must be on a file system that every rank sees (as DCP's
``FileSystemWriter`` requires).

[Note: loading runs no code] A checkpoint's files are data, never code: whoever can
write to the checkpoint directory must not be able to run code in every rank that loads
it. Plain DCP unpickles ``.metadata`` with ``pickle`` and its non-tensor records with
``torch.load(weights_only=False)``, so a crafted file runs anything. Here ``.metadata``
goes through ``_MetadataUnpickler`` (only the classes DCP's ``Metadata`` is made of),
non-tensor records and ``extra.pt`` through ``torch.load(weights_only=True)``, and DCP
already reads tensor records with ``weights_only=True``. A refused file raises
``CheckpointError`` naming it; ``extra.pt`` and the non-tensor records are read before
any tensor, so a refused one leaves the model and optimizer as they were. The
``COMPLETE`` marker is no defence here: it is plain JSON that anyone able to replace a
file can rewrite too.
"""

import dataclasses
import io
import json
import os
import pickle
import re
import shutil
import warnings
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.futures import Future

MARKER = "COMPLETE"
EXTRA_FILE = "extra.pt"
_TMP_SUFFIX = ".tmp"
_STEP_DIR = re.compile(r"^step_(\d{8,})$")
_MARKER_VERSION = 2  # 2: sizes and CRC32s; none (1): sizes only
_CHUNK_BYTES = 8 << 20  # checksums read files in chunks of this size

# One optimizer, or several over disjoint parameters (torch's get_state_dict/set_state_dict
# take either).
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete, corrupted, or does not fit the model."""


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What ``load_checkpoint`` hands back besides the loaded model and optimizer."""

    step: int
    """The step passed to ``save_checkpoint``."""
    world_size: int
    """The world size the checkpoint was saved with."""
    extra: dict[str, Any]
    """The ``extra`` dict passed to ``save_checkpoint`` (rank 0's)."""
    rank_extra: dict[str, Any] | None
    """This global rank's ``rank_extra``, or ``None`` if it was not saved or the world
    size changed (re-derive per-rank state from the seed and ``step`` then)."""


def checkpoint_path(directory: str, step: int) -> str:
    """The final (complete) directory of ``step``'s checkpoint under ``directory``."""
    return os.path.join(directory, f"step_{step:08d}")


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------


def save_checkpoint(
    directory: str,
    step: int,
    model: nn.Module,
    optimizer: Optimizers | None,
    extra: dict[str, Any],
    *,
    rank_extra: dict[str, Any] | None = None,
    keep_last: int = 2,
) -> str:
    """Save ``model``, ``optimizer`` and ``extra`` as ``directory/step_{step:08d}``.

    Every rank must call it. The model and optimizer state dicts come from
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` (sharded DTensors under
    the original FQNs) and are written by ``dcp.save``, each rank its own shards. The
    checkpoint becomes visible only once complete (see [Note: checkpoint completion]).
    Afterwards the oldest complete checkpoints beyond ``keep_last`` are deleted; the one
    just written never is.

    Args:
        directory: parent directory, created if missing; shared by all ranks.
        step: the training step (or any increasing int) this checkpoint follows.
        model: the (``fully_shard``-ed) model.
        optimizer: its optimizer, or a list of them (e.g. Muon and AdamW, each over its
            own parameters: one optimizer state dict keyed by FQN holds both), or
            ``None`` to save the model only.
        extra: global trainer state (step, data position, RNG states, ...), picklable by
            ``torch.save`` and loadable with ``weights_only=True`` (tensors, numbers,
            strings, lists, dicts). Rank 0's copy is saved.
        rank_extra: this rank's own state (e.g. its generator state), saved keyed by
            global rank.
        keep_last: how many complete checkpoints to keep, at least 1.

    Returns:
        The path of the complete checkpoint.

    Raises:
        ValueError: ``keep_last < 1`` or ``step < 0``.
    """
    if keep_last < 1:
        raise ValueError(
            f"keep_last must be at least 1 (got {keep_last}): "
            "the checkpoint just written is always kept"
        )
    if step < 0:
        raise ValueError(f"step must be non-negative (got {step})")
    final = checkpoint_path(directory, step)
    staging = final + _TMP_SUFFIX
    rank, world_size = _rank(), _world_size()
    all_rank_extra = _gather_to_rank0(rank_extra)
    if rank == 0:
        _prepare_staging(staging)
    _barrier()  # nobody writes into staging before rank 0 has emptied it
    dcp.save(_state_dict(model, optimizer), checkpoint_id=staging)
    if rank == 0:
        saved = {"extra": extra, "rank_extra": all_rank_extra}
        torch.save(saved, os.path.join(staging, EXTRA_FILE))
    # Every rank's shards are on disk (dcp.save syncs its files) before the checksums.
    _barrier()
    checksums = _gather_checksums(staging)
    if rank == 0:
        _write_marker(staging, step, world_size, checksums)
        _promote(staging, final)
        _prune(directory, keep_last, keep=final)
    _barrier()  # return only once the checkpoint is visible to every rank
    return final


def _state_dict(model: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _prepare_staging(staging: str) -> None:
    # A leftover from an interrupted save of the same step would mix old and new files.
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)


def _data_files(path: str) -> list[str]:
    """The names of the checkpoint's files, the marker excepted, sorted."""
    return sorted(name for name in os.listdir(path) if name != MARKER)


def _file_crc32(file: str) -> int:
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def _checksums(path: str, names: list[str]) -> dict[str, int]:
    return {name: _file_crc32(os.path.join(path, name)) for name in names}


def _gather_checksums(staging: str) -> dict[str, int] | None:
    """Every file's CRC32 on rank 0 (``None`` elsewhere), each rank computing a stripe;
    see [Note: checkpoint checksums]."""
    names = _data_files(staging)
    stripes = _gather_to_rank0(_checksums(staging, names[_rank() :: _world_size()]))
    if stripes is None:
        return None
    return {name: crc for stripe in stripes.values() for name, crc in stripe.items()}


def _write_marker(staging: str, step: int, world_size: int, checksums: dict[str, int]) -> None:
    sizes = {name: os.path.getsize(os.path.join(staging, name)) for name in checksums}
    marker = {
        "version": _MARKER_VERSION,
        "step": step,
        "world_size": world_size,
        "files": sizes,
        "crc32": checksums,
    }
    partial = os.path.join(staging, MARKER + _TMP_SUFFIX)
    with open(partial, "w") as f:
        json.dump(marker, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, os.path.join(staging, MARKER))


def _promote(staging: str, final: str) -> None:
    """Rename ``staging`` to ``final``, the commit point of a save."""
    if os.path.exists(final):
        # Saving a step again (a run resumed from an older checkpoint): os.replace
        # cannot rename onto a non-empty directory. The new copy is complete in staging.
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_dir(os.path.dirname(final))


def _fsync_dir(path: str) -> None:
    # Makes the rename itself durable; not every platform can open a directory.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(directory: str, keep_last: int, keep: str) -> None:
    """Delete complete checkpoints older than the newest ``keep_last``, and stale
    ``.tmp`` directories of earlier steps, never ``keep``."""
    complete = _complete_checkpoints(directory)
    for _, path in complete[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    newest = complete[-1][0] if complete else None
    for name in os.listdir(directory):
        step = _staging_step(name)
        if step is not None and newest is not None and step < newest:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _staging_step(name: str) -> int | None:
    if not name.endswith(_TMP_SUFFIX):
        return None
    match = _STEP_DIR.match(name[: -len(_TMP_SUFFIX)])
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------
# Find and load
# ---------------------------------------------------------------------------


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete and intact checkpoint under ``directory``, or ``None``.

    ``.tmp`` directories are skipped silently (interrupted saves). Final directories
    without a valid ``COMPLETE`` marker, or whose files differ from the marker's sizes
    or checksums, are skipped with a warning saying why. Checkpoints are verified newest
    first until one passes, which reads every file of that checkpoint (see [Note:
    checkpoint checksums]); no process group is needed, so every rank can call it.
    """
    for _, path in reversed(_complete_checkpoints(directory, warn=True)):
        try:
            _verify_checksums(path, _read_marker(path))
        except CheckpointError as exc:
            warnings.warn(f"skipping checkpoint: {exc}", stacklevel=2)
            continue
        return path
    return None


def _complete_checkpoints(directory: str, *, warn: bool = False) -> list[tuple[int, str]]:
    """(step, path) of every complete checkpoint under ``directory``, oldest first
    (sizes checked, not checksums); ``warn``: say why a final directory is not."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _STEP_DIR.match(name)
        path = os.path.join(directory, name)
        if match is None or not os.path.isdir(path):
            continue
        try:
            _read_marker(path)
        except CheckpointError as exc:
            if warn:
                warnings.warn(f"skipping checkpoint: {exc}", stacklevel=3)
            continue
        found.append((int(match.group(1)), path))
    return sorted(found)


def _read_marker(path: str) -> dict[str, Any]:
    """The marker of the complete checkpoint at ``path``; see [Note: checkpoint completion].

    Raises:
        CheckpointError: naming ``path`` and what is wrong with it.
    """
    if path.rstrip(os.sep).endswith(_TMP_SUFFIX):
        raise CheckpointError(f"checkpoint {path} is a partial save (its name ends in .tmp)")
    marker_path = os.path.join(path, MARKER)
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        step, world_size, sizes = marker["step"], marker["world_size"], marker["files"]
        checksums = marker["crc32"] if marker.get("version") else None
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: no {MARKER} marker (the save was interrupted)"
        ) from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} has an unreadable {MARKER} marker: {exc}"
        ) from exc
    for name, size in sizes.items():
        file = os.path.join(path, name)
        actual = os.path.getsize(file) if os.path.isfile(file) else None
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {name} is {found}, the marker says {size} bytes"
            )
    return {"step": step, "world_size": world_size, "crc32": checksums}


def _verify_checksums(path: str, marker: dict[str, Any], stripe: slice = slice(None)) -> None:
    """Check the CRC32s of the marker's files (sorted, ``stripe`` of them) against the
    marker's; see [Note: checkpoint checksums].

    Raises:
        CheckpointError: naming the first file whose checksum differs.
    """
    expected = marker["crc32"]
    if expected is None:
        warnings.warn(
            f"checkpoint {path} has no checksums (saved before they were recorded): "
            "only its file sizes are checked",
            stacklevel=3,
        )
        return
    for name in sorted(expected)[stripe]:
        actual = _file_crc32(os.path.join(path, name))
        if actual != expected[name]:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {name} has CRC32 {actual:08x}, "
                f"the marker says {expected[name]:08x}"
            )


def _verify_checksums_everywhere(path: str, marker: dict[str, Any]) -> None:
    """Every rank verifies its stripe of the files, then all agree: the same
    ``CheckpointError`` on every rank if any stripe fails."""
    try:
        _verify_checksums(path, marker, slice(_rank(), None, _world_size()))
        error = None
    except CheckpointError as exc:
        error = str(exc)
    first = next((e for e in _all_gather(error) if e is not None), None)
    if first is not None:
        raise CheckpointError(first)


def load_checkpoint(path: str, model: nn.Module, optimizer: Optimizers | None) -> LoadedCheckpoint:
    """Load a checkpoint written by ``save_checkpoint`` into ``model`` and ``optimizer``.

    Every rank must call it. The model may be sharded differently from the one saved
    (another world size, HSDP, FSDP + TP): ``dcp.load`` reads each rank's part of every
    tensor from whichever files hold it, and ``set_state_dict`` copies it in.

    Args:
        path: a checkpoint directory, e.g. from ``latest_checkpoint``.
        model: the model to load into, already ``fully_shard``-ed.
        optimizer: its optimizer, or the list of them that was saved, or ``None`` to
            load the model only.

    Returns:
        The step, saved world size, ``extra`` and this rank's ``rank_extra``.

    Raises:
        CheckpointError: naming ``path``, if the checkpoint is incomplete or corrupted
            (sizes or checksums differ from the marker's; checked before the model or
            optimizer changes), if a file holds more than plain data (see [Note: loading
            runs no code]), or if DCP cannot load it into this model.
    """
    marker = _read_marker(path)
    _verify_checksums_everywhere(path, marker)
    saved = _load_extra(path)  # before the model changes: a bad extra.pt leaves it as it was
    state = _state_dict(model, optimizer)
    try:
        dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner())
    # DCP gathers every rank's failure into a CheckpointException, a BaseException.
    except (Exception, dcp.CheckpointException) as exc:
        cause = _refusal(exc) or exc
        raise CheckpointError(f"could not load checkpoint {path}: {cause}") from exc
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    return LoadedCheckpoint(
        step=marker["step"],
        world_size=marker["world_size"],
        extra=saved["extra"],
        rank_extra=_own_rank_extra(saved["rank_extra"], marker["world_size"]),
    )


def _load_extra(path: str) -> dict[str, Any]:
    file = os.path.join(path, EXTRA_FILE)
    try:
        return torch.load(file, weights_only=True)  # see [Note: loading runs no code]
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {path}: refused to load {EXTRA_FILE}, it holds more than plain data "
            f"(tensors, numbers, strings, lists, dicts): {exc}"
        ) from exc
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: could not read {EXTRA_FILE}: {exc}") from exc


def _refusal(exc: BaseException) -> CheckpointError | None:
    """The ``CheckpointError`` our reader or planner raised inside ``dcp.load``, which
    gathers every rank's failure into ``CheckpointException.failures`` as
    ``{rank: (exception, traceback)}``; ``None`` if there is none."""
    for failure in (getattr(exc, "failures", None) or {}).values():
        if isinstance(failure, tuple) and isinstance(failure[0], CheckpointError):
            return failure[0]
    return None


# ---------------------------------------------------------------------------
# Restricted reading (see [Note: loading runs no code])
# ---------------------------------------------------------------------------

# Every global a ``.metadata`` pickle of torch 2.11-2.14 refers to, found by unpickling
# real checkpoints (plain and sharded models; SGD, Adam(amsgrad), AdamW with a tensor
# lr; float32 and bfloat16) with a find_class that records its arguments. All are
# dataclasses, enums or value types whose construction has no side effect;
# ``torch.serialization._get_layout`` maps a name such as "torch.strided" to a layout.
_METADATA_GLOBALS = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "Metadata"),
        ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
        ("torch.distributed.checkpoint.metadata", "StorageMeta"),
        ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
        ("torch.distributed.checkpoint.metadata", "TensorProperties"),
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),
        ("torch", "Size"),
        # StorageMeta.checkpoint_id is the path the checkpoint was saved to.
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
    }
    # TensorProperties.dtype pickles as the global torch.<dtype name>.
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
)


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``Metadata``, refusing every global outside ``_METADATA_GLOBALS``."""

    def __init__(self, file: io.BufferedReader, path: str) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _METADATA_GLOBALS:
            raise CheckpointError(
                f"checkpoint file {self.path} refers to {module}.{name}, which DCP's "
                "metadata never holds: refused to load it (it could run code); the file "
                "was not written by torch.distributed.checkpoint or was tampered with"
            )
        return super().find_class(module, name)


class _SafeReader(dcp.FileSystemReader):
    """DCP's file system reader, reading ``.metadata`` with ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP names a rank-local metadata file __{rank}.metadata (when saved without
        # coordination); ours are always the global one.
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        file = os.path.join(str(self.path), name)
        with open(file, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f, file).load()
            except CheckpointError:
                raise
            except Exception as exc:
                raise CheckpointError(f"checkpoint file {file} is unreadable: {exc}") from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"checkpoint file {file} holds a {type(metadata).__name__}, not DCP's Metadata"
            )
        # As FileSystemReader.read_metadata does.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Non-tensor records first: one refused by _SafeLoadPlanner then raises before
        # any tensor was copied into the model (DCP loads tensors in place).
        is_bytes = [item.type == LoadItemType.BYTE_IO for item in plan.items]
        records = [item for item, b in zip(plan.items, is_bytes) if b]
        tensors = [item for item, b in zip(plan.items, is_bytes) if not b]
        super().read_data(dataclasses.replace(plan, items=records), planner).wait()
        return super().read_data(dataclasses.replace(plan, items=tensors), planner)


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor records with ``weights_only=True``
    (``DefaultLoadPlanner.load_bytes`` uses ``weights_only=False``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"checkpoint record {fqn} holds more than plain data: refused to load it "
                f"(it could run code): {exc}"
            ) from exc
        # The rest is DefaultLoadPlanner.load_bytes.
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _own_rank_extra(
    all_rank_extra: dict[int, Any] | None, saved_world_size: int
) -> dict[str, Any] | None:
    # Rank r of a different world size is a different slice of the data: its saved
    # state would be wrong, not merely stale, so none is returned.
    if all_rank_extra is None or saved_world_size != _world_size():
        return None
    return all_rank_extra.get(_rank())


# ---------------------------------------------------------------------------
# Process group helpers (also usable in one process without a group)
# ---------------------------------------------------------------------------


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, in rank order, on every rank."""
    if not dist.is_initialized():
        return [value]
    gathered: list[Any] = [None] * _world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _gather_to_rank0(value: dict[str, Any] | None) -> dict[int, Any] | None:
    """Every rank's ``value`` keyed by global rank, on rank 0 (``None`` elsewhere or if
    no rank gave one)."""
    if not dist.is_initialized():
        return None if value is None else {0: value}
    gathered: list[Any] | None = [None] * _world_size() if _rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    if gathered is None or all(v is None for v in gathered):
        return None
    return {rank: v for rank, v in enumerate(gathered) if v is not None}
