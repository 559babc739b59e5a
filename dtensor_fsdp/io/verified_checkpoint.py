"""Distributed checkpoints of a training run, written with torch.distributed.checkpoint.

A checkpoint is one directory per step, holding DCP's files (every rank writes its own
shards; DCP reshards them on load, so a run saved on N ranks resumes on M ranks or on
another mesh layout), the trainer's ``extra`` state and a ``COMPLETE`` marker::

    directory/
      step_00000020/          complete: the marker is the last thing written
        .metadata  __0_0.distcp  __1_0.distcp  extra.pt  COMPLETE
      step_00000030.tmp/      being written, or interrupted: never loaded

The files themselves (marker, checksums, restricted reading: [Note: checkpoint
checksums], [Note: no symlinks], [Note: loading runs no code]) are in
``checkpoint_files.py``; this module says which rank does what, and when.

[Note: checkpoint completion] A checkpoint is complete iff its directory has the final
name (no ``.tmp``) and holds a ``COMPLETE`` marker whose recorded file sizes match the
files on disk. ``save_checkpoint`` writes everything into ``step_N.tmp/``, the ranks
agree that every rank's part is on disk, then rank 0 writes the marker (itself via a
rename, so it is never half-written) and renames the directory with ``os.replace``. A
crash at any point leaves either a ``.tmp`` directory or a complete checkpoint; a final
directory without a valid marker (copied by hand, truncated later) is skipped too.
``latest_checkpoint``, ``load_checkpoint`` and pruning apply this one test
(``read_marker``).

[Note: atomic checkpoint load] ``load_checkpoint`` changes the model and optimizer only
after everything was read and verified: the marker, every checksum, ``extra.pt``, and
every tensor and record, which ``dcp.load`` reads into a staging copy of the state dict
(fresh tensors of the same shapes, dtypes and placements). Only then is the staging
copy loaded into the model and optimizer (``set_state_dict``; ``load_state_dict`` is
atomic, see [Note: atomic load] in ``load_checks.py``). The cost is memory: this rank's
shards of the model and optimizer state once more during the load (for AdamW in fp32,
3 x 4 bytes per parameter / world size; see ``load_checkpoint``). A fresh optimizer's
state, which DCP needs to exist and ``get_state_dict`` creates, is removed again if
the load fails.

Resuming on another world size: ``extra`` (step, data position, anything global) is
saved once and comes back unchanged, so a global data position carries over. Per-rank
entries (``rank_extra``: e.g. each rank's generator state) are saved keyed by global
rank and come back only when the world size is the one they were saved with;
otherwise ``LoadedCheckpoint.rank_extra`` is ``None`` and the trainer re-derives them
from its seed and the step, exactly as a fresh run of that world size would.

The directory must be on a file system that every rank sees (as DCP's
``FileSystemWriter`` requires).
"""

import os
import re
import shutil
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..runtime.reduction.error_feedback import drop_unsaved_residuals
from .checkpoint_files import (
    EXTRA_FILE,
    MARKER,
    TMP_SUFFIX,
    CheckpointError,
    SafeLoadPlanner,
    SafeReader,
    check_plain_data,
    checksums,
    data_files,
    load_extra,
    read_marker,
    refuse_symlink,
    verify_checksums,
    write_extra,
    write_marker,
)
from .rank_agreement import (
    agree,
    agree_dcp,
    all_gather,
    current_rank,
    current_world_size,
    describe,
    gather_to_rank0,
    only_on,
)

__all__ = [
    "EXTRA_FILE",
    "MARKER",
    "CheckpointError",
    "LoadedCheckpoint",
    "checkpoint_path",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
]

_STEP_DIR = re.compile(r"^step_(\d{8,})$")

# One optimizer, or several over disjoint parameters (torch's get_state_dict/set_state_dict
# take either).
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer]


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
    just written never is. A failure on any rank raises on every rank (see [Note:
    agreeing on failure]) and leaves the complete checkpoints as they were.

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
            global rank; plain data as ``extra``.
        keep_last: how many complete checkpoints to keep, at least 1.

    Returns:
        The path of the complete checkpoint.

    Raises:
        ValueError: ``keep_last < 1`` or ``step < 0``.
        CheckpointError: on every rank, if any rank failed a step: ``extra`` or
            ``rank_extra`` is not plain data, ``step_N.tmp`` or ``step_N`` is a symbolic
            link (see [Note: no symlinks]), the directory is not writable, DCP failed.
    """
    if keep_last < 1:
        raise ValueError(
            f"keep_last must be at least 1 (got {keep_last}): "
            "the checkpoint just written is always kept"
        )
    if step < 0:
        raise ValueError(f"step must be non-negative (got {step})")
    final = checkpoint_path(directory, step)
    staging = final + TMP_SUFFIX
    rank, world_size = current_rank(), current_world_size()
    is_writer = rank == 0

    def check_extras() -> None:
        if is_writer:
            check_plain_data("save_checkpoint: extra", extra)
        check_plain_data(f"save_checkpoint: rank {rank}'s rank_extra", rank_extra)

    agree("save_checkpoint: checking extra and rank_extra", check_extras)
    all_rank_extra = gather_to_rank0(rank_extra)
    # Nobody writes into staging before rank 0 has emptied it.
    prepare = only_on(is_writer, _prepare_staging, staging, final)
    agree(f"save_checkpoint: preparing {staging}", prepare)
    state = agree("save_checkpoint: get_state_dict", lambda: _state_dict(model, optimizer))
    agree_dcp(
        f"save_checkpoint: writing {staging} (dcp.save)",
        lambda: dcp.save(state, checkpoint_id=staging),
    )
    saved = {"extra": extra, "rank_extra": all_rank_extra}
    agree(f"save_checkpoint: writing {EXTRA_FILE}", only_on(is_writer, write_extra, staging, saved))
    # Every rank's files are on disk (dcp.save returns once all are; the agreement
    # above orders extra.pt) before anyone lists and checksums them.
    stripe = agree(
        "save_checkpoint: checksumming",
        lambda: checksums(staging, data_files(staging)[rank::world_size]),
    )
    stripes = gather_to_rank0(stripe)
    crc32 = None if stripes is None else {n: c for s in stripes.values() for n, c in s.items()}
    agree(
        f"save_checkpoint: committing {final}",
        only_on(is_writer, _commit, staging, final, step, world_size, crc32, keep_last),
    )
    return final


def _state_dict(model: nn.Module, optimizer: Optimizers | None) -> dict[str, Any]:
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _prepare_staging(staging: str, final: str) -> None:
    # Refused now rather than after the whole state dict was written; _promote checks
    # the final directory again.
    refuse_symlink(staging)
    refuse_symlink(final)
    if os.path.lexists(staging):
        # A leftover from an interrupted save of the same step would mix old and new
        # files. rmtree deletes links inside it, never what they point to.
        shutil.rmtree(staging)
    os.makedirs(staging)


def _commit(
    staging: str,
    final: str,
    step: int,
    world_size: int,
    crc32: dict[str, int],
    keep_last: int,
) -> None:
    write_marker(staging, step, world_size, crc32)
    _promote(staging, final)
    _prune(os.path.dirname(final), keep_last, keep=final)


def _promote(staging: str, final: str) -> None:
    """Rename ``staging`` to ``final``, the commit point of a save."""
    refuse_symlink(final)
    if os.path.lexists(final):
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
    ``.tmp`` directories of earlier steps, never ``keep``, never through a link."""
    complete = _complete_checkpoints(directory)
    for _, path in complete[:-keep_last]:
        if path != keep:
            shutil.rmtree(path, ignore_errors=True)
    newest = complete[-1][0] if complete else None
    for name in os.listdir(directory):
        step = _staging_step(name)
        path = os.path.join(directory, name)
        is_stale = step is not None and newest is not None and step < newest
        if is_stale and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)


def _staging_step(name: str) -> int | None:
    if not name.endswith(TMP_SUFFIX):
        return None
    match = _STEP_DIR.match(name[: -len(TMP_SUFFIX)])
    return int(match.group(1)) if match else None


# ---------------------------------------------------------------------------
# Find and load
# ---------------------------------------------------------------------------


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete and intact checkpoint under ``directory``, or ``None``.

    ``.tmp`` directories are skipped silently (interrupted saves). Final directories
    that are symbolic links, lack a valid ``COMPLETE`` marker, or whose files differ
    from the marker's sizes or checksums, are skipped with a warning saying why.
    Checkpoints are verified newest first until one passes, which reads every file of
    that checkpoint once (see [Note: checkpoint checksums]).

    Under a process group it is collective: every rank must call it, each verifies a
    stripe of the files, and all return the same path (a checkpoint only some ranks
    see is skipped). Without one it verifies whole checkpoints in this process.
    """
    listed = all_gather([path for _, path in _complete_checkpoints(directory, warn=True)])
    seen_by_all = set.intersection(*(set(paths) for paths in listed))
    rank, world_size = current_rank(), current_world_size()
    for path in reversed(listed[0]):
        if path not in seen_by_all:
            continue
        try:
            verify_checksums(path, read_marker(path), slice(rank, None, world_size))
            problem = None
        except Exception as exc:  # noqa: BLE001 - unreadable is as bad as corrupted: next
            problem = str(exc) if isinstance(exc, CheckpointError) else describe(exc)
        problems = [p for p in all_gather(problem) if p is not None]
        if not problems:
            return path
        warnings.warn(f"skipping checkpoint: {problems[0]}", stacklevel=2)
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
        if match is None or not (os.path.islink(path) or os.path.isdir(path)):
            continue
        try:
            read_marker(path)
        except CheckpointError as exc:
            if warn:
                warnings.warn(f"skipping checkpoint: {exc}", stacklevel=3)
            continue
        found.append((int(match.group(1)), path))
    return sorted(found)


def load_checkpoint(path: str, model: nn.Module, optimizer: Optimizers | None) -> LoadedCheckpoint:
    """Load a checkpoint written by ``save_checkpoint`` into ``model`` and ``optimizer``.

    Every rank must call it. The model may be sharded differently from the one saved
    (another world size, HSDP, FSDP + TP): ``dcp.load`` reads each rank's part of every
    tensor from whichever files hold it. Nothing changes unless everything was read and
    verified (see [Note: atomic checkpoint load]): marker, sizes, checksums,
    ``extra.pt``, every record and tensor. Memory: the tensors are read into a staging
    copy first, so this rank's shards of the model and optimizer state are held twice
    until they are copied in (AdamW, fp32: 12 bytes per parameter / world size more).

    Args:
        path: a checkpoint directory, e.g. from ``latest_checkpoint``.
        model: the model to load into, already ``fully_shard``-ed.
        optimizer: its optimizer, or the list of them that was saved, or ``None`` to
            load the model only.

    Returns:
        The step, saved world size, ``extra`` and this rank's ``rank_extra``.

    Raises:
        CheckpointError: on every rank, with the model and optimizer unchanged, if the
            checkpoint is incomplete or corrupted (sizes or checksums differ from the
            marker's), if ``path`` or a file in it is a symbolic link (see [Note: no
            symlinks]), if a file holds more than plain data (see [Note: loading runs
            no code]), or if DCP cannot read it into this model; the message names the
            failing rank (see [Note: agreeing on failure]).
    """
    rank, world_size = current_rank(), current_world_size()
    marker = agree(f"load_checkpoint: reading the {MARKER} marker", lambda: read_marker(path))
    agree(
        "load_checkpoint: verifying checksums",
        lambda: verify_checksums(path, marker, slice(rank, None, world_size)),
    )
    saved = agree(f"load_checkpoint: reading {EXTRA_FILE}", lambda: load_extra(path))
    optimizers = _as_list(optimizer)
    fresh = [o for o in optimizers if not o.state]
    try:
        reader = SafeReader(path, set(marker["files"]))
        staged = agree(
            "load_checkpoint: staging", lambda: _staging_state_dict(model, optimizer, reader)
        )
        agree_dcp(
            f"load_checkpoint: reading {path}",
            lambda: dcp.load(staged, storage_reader=reader, planner=SafeLoadPlanner()),
        )
    except CheckpointError:
        for fresh_optimizer in fresh:
            # get_state_dict created it; see [Note: atomic checkpoint load]
            fresh_optimizer.state.clear()
        raise
    agree(
        "load_checkpoint: loading into the model and optimizer",
        lambda: _load_staged(model, optimizer, staged),
    )
    return LoadedCheckpoint(
        step=marker["step"],
        world_size=marker["world_size"],
        extra=saved["extra"],
        rank_extra=_own_rank_extra(saved["rank_extra"], marker["world_size"]),
    )


def _as_list(optimizer: Optimizers | None) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    return [optimizer] if isinstance(optimizer, torch.optim.Optimizer) else list(optimizer)


def _staging_state_dict(
    model: nn.Module, optimizer: Optimizers | None, reader: SafeReader
) -> dict[str, Any]:
    """A state dict of the model and optimizer for ``dcp.load`` to read into, sharing no
    tensor with them (see [Note: atomic checkpoint load]), less the error-feedback
    residuals the checkpoint does not hold at their size: those restart at zero instead
    of failing the load (saved without error feedback, or at another data-parallel world
    size; see [Note: error-feedback residuals in state dicts] in error_feedback.py)."""
    staged = _staging_copy(_state_dict(model, optimizer))
    saved = {
        key: entry.size
        for key, entry in reader.read_metadata().state_dict_metadata.items()
        if isinstance(entry, TensorStorageMetadata)
    }
    drop_unsaved_residuals(staged["model"], saved, prefix="model.")
    return staged


def _staging_copy(tree: Any) -> Any:
    """``tree`` with fresh containers and every tensor replaced by an uninitialized one
    of the same shape, dtype, device and (for a DTensor) mesh and placements."""
    if isinstance(tree, torch.Tensor):
        return torch.empty_like(tree)
    if isinstance(tree, dict):
        return {key: _staging_copy(value) for key, value in tree.items()}
    if isinstance(tree, list):
        return [_staging_copy(value) for value in tree]
    return tree  # numbers, strings, tuples: immutable, and DCP replaces them whole


def _load_staged(model: nn.Module, optimizer: Optimizers | None, staged: dict[str, Any]) -> None:
    if optimizer is None:
        set_model_state_dict(model, staged["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=staged["model"], optim_state_dict=staged["optim"]
        )


def _own_rank_extra(
    all_rank_extra: dict[int, Any] | None, saved_world_size: int
) -> dict[str, Any] | None:
    # Rank r of a different world size is a different slice of the data: its saved
    # state would be wrong, not merely stale, so none is returned.
    if all_rank_extra is None or saved_world_size != current_world_size():
        return None
    return all_rank_extra.get(current_rank())
