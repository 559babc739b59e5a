"""``dtensor_fsdp.checkpoint`` error paths in one process (issue 11 items 3 and 4): links
inside the checkpoint directory are refused, a failing step raises ``CheckpointError``
and leaves the complete checkpoints as they were, and a load that fails midway leaves
the model and optimizer bitwise unchanged.

The same paths on 2 gloo ranks, where a failure on one rank must reach the other, are
in ``tests/io/test_checkpoint_agreement.py``.
"""

import json
import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict

from dtensor_fsdp.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dtensor_fsdp.io.checkpoint_files import checksums, data_files, write_marker

# DCP warns that it saves and loads in a single process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int, *, trained: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    if trained:
        model(torch.randn(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _save(directory: Path, step: int, **kwargs) -> str:
    model, optimizer = _model(step)
    extra = kwargs.pop("extra", {"step": step})
    return save_checkpoint(str(directory), step, model, optimizer, extra, **kwargs)


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    state = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        # .get: indexing optimizer.state (a defaultdict) would create an entry.
        state += [v.clone() for v in optimizer.state.get(p, {}).values()]
    return state


def _unchanged(before: list[torch.Tensor], model: nn.Module, optimizer) -> bool:
    after = _snapshot(model, optimizer)
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _assert_previous_intact(directory: Path, previous: str) -> None:
    with warnings.catch_warnings():
        # A link left at step_N is skipped with a warning, tested elsewhere.
        warnings.filterwarnings("ignore", "skipping checkpoint: .* is a symbolic link")
        assert latest_checkpoint(str(directory)) == previous
    model, optimizer = _model(0)
    assert load_checkpoint(previous, model, optimizer).step == 1
    saved, _ = _model(1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), saved.parameters()))


def _elsewhere(tmp_path: Path) -> Path:
    """A directory outside the checkpoints with a file a followed link would destroy."""
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "precious").write_text("keep me")
    return target


# ---------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("link", ["step_00000002.tmp", "step_00000002"])
def test_save_refuses_symlinked_step_directory(tmp_path: Path, link: str) -> None:
    directory = tmp_path / "ckpt"
    previous = _save(directory, 1)
    target = _elsewhere(tmp_path)
    os.symlink(target, directory / link)
    with pytest.raises(CheckpointError, match=f"rank 0: .*{re.escape(link)} is a symbolic link"):
        _save(directory, 2)
    assert (target / "precious").read_text() == "keep me" and os.listdir(target) == ["precious"]
    assert os.path.islink(directory / link)
    _assert_previous_intact(directory, previous)


def test_save_into_occupied_staging_raises_checkpoint_error(tmp_path: Path) -> None:
    """A step_N.tmp that is a file (rank 0 cannot create the staging directory): before,
    a bare FileExistsError on rank 0 alone, and the other ranks waited forever."""
    directory = tmp_path / "ckpt"
    previous = _save(directory, 1)
    (directory / "step_00000002.tmp").write_text("not a directory")
    with pytest.raises(CheckpointError, match=r"preparing .*step_00000002\.tmp failed on rank 0"):
        _save(directory, 2)
    _assert_previous_intact(directory, previous)


class _Custom:
    """Not plain data: torch.load(weights_only=True) refuses it."""


@pytest.mark.parametrize("where", ["extra", "rank_extra"])
def test_save_refuses_extra_that_would_not_load(tmp_path: Path, where: str) -> None:
    """Refused before anything is written (before, the save succeeded and every load
    of the checkpoint failed)."""
    directory = tmp_path / "ckpt"
    previous = _save(directory, 1)
    kwargs = {where: {"state": _Custom()}}
    with pytest.raises(CheckpointError, match=f"{where} must hold plain data"):
        _save(directory, 2, **kwargs)
    assert sorted(os.listdir(directory)) == ["step_00000001"]
    _assert_previous_intact(directory, previous)


# ---------------------------------------------------------------------------
# Find and load
# ---------------------------------------------------------------------------


def test_symlinked_checkpoint_is_skipped_and_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    previous = _save(directory, 1)
    real = _save(tmp_path / "other", 2)
    link = checkpoint_path(str(directory), 2)
    os.symlink(real, link)
    with pytest.warns(UserWarning, match=f"skipping checkpoint: {re.escape(link)} is a symbolic"):
        assert latest_checkpoint(str(directory)) == previous
    model, optimizer = _model(0)
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=f"{re.escape(link)} is a symbolic link"):
        load_checkpoint(link, model, optimizer)
    assert _unchanged(before, model, optimizer)


@pytest.mark.parametrize("name", ["COMPLETE", "extra.pt", ".metadata", "__0_0.distcp"])
def test_symlinked_file_inside_checkpoint_is_refused(tmp_path: Path, name: str) -> None:
    """The link points to an identical copy, so sizes and checksums match: only the link
    itself is wrong."""
    directory = tmp_path / "ckpt"
    previous = _save(directory, 1)
    path = _save(directory, 2)
    copy = tmp_path / "copy"
    os.replace(os.path.join(path, name), copy)
    os.symlink(copy, os.path.join(path, name))
    message = f"{re.escape(os.path.join(path, name))} is a symbolic link"
    with pytest.warns(UserWarning, match=f"skipping checkpoint: {message}"):
        assert latest_checkpoint(str(directory)) == previous
    model, optimizer = _model(0)
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(path, model, optimizer)
    assert _unchanged(before, model, optimizer)


def _metadata(path: str):
    return pickle.loads(Path(path, ".metadata").read_bytes())  # our own test file


def forge_marker(path: str) -> None:
    """Rewrite ``COMPLETE`` to match the files as they are now (sizes and CRC32s), as
    whoever can replace a file can."""
    marker = json.loads(Path(path, "COMPLETE").read_text())
    write_marker(path, marker["step"], marker["world_size"], checksums(path, data_files(path)))


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt", 1)
    metadata = _metadata(path)
    index = next(iter(metadata.storage_data))
    info = metadata.storage_data[index]
    outside = tmp_path / "outside.distcp"
    outside.write_bytes(Path(path, info.relative_path).read_bytes())
    metadata.storage_data[index] = type(info)(
        **{**vars(info), "relative_path": os.path.join("..", "..", outside.name)}
    )
    Path(path, ".metadata").write_bytes(pickle.dumps(metadata))
    forge_marker(path)
    model, optimizer = _model(0)
    before = _snapshot(model, optimizer)
    with pytest.raises(
        CheckpointError, match=r"points to '\.\./\.\./outside\.distcp', which is not"
    ):
        load_checkpoint(path, model, optimizer)
    assert _unchanged(before, model, optimizer)


def corrupt_last_tensor(path: str, file: str) -> str:
    """Zero the bytes of the tensor stored last in ``file`` and forge the marker, so the
    checksums pass and ``dcp.load`` fails on that tensor after reading the others.
    Returns the tensor's FQN."""
    metadata = pickle.loads(Path(path, ".metadata").read_bytes())
    tensors = {
        fqn for fqn, md in metadata.state_dict_metadata.items()
        if isinstance(md, TensorStorageMetadata)
    }  # fmt: skip
    index, info = max(
        ((i, s) for i, s in metadata.storage_data.items()
         if s.relative_path == file and i.fqn in tensors),
        key=lambda item: item[1].offset,
    )  # fmt: skip
    data = bytearray(Path(path, file).read_bytes())
    data[info.offset : info.offset + info.length] = bytes(info.length)
    Path(path, file).write_bytes(bytes(data))
    forge_marker(path)
    return index.fqn


@pytest.mark.parametrize("trained", [True, False], ids=["trained_optimizer", "fresh_optimizer"])
def test_load_failing_midway_changes_nothing(tmp_path: Path, trained: bool) -> None:
    path = _save(tmp_path / "ckpt", 1)
    corrupt_last_tensor(path, "__0_0.distcp")
    # The reference: DCP's load into the model's own state dict copies the tensors it
    # read before the bad one into the model, then raises.
    model, optimizer = _model(0)
    before = _snapshot(model, optimizer)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with pytest.raises(dcp.CheckpointException):
        dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    assert not _unchanged(before, model, optimizer), "the corruption no longer fails midway"

    model, optimizer = _model(0, trained=trained)
    before = _snapshot(model, optimizer)
    with pytest.raises(CheckpointError, match=re.escape(path)):
        load_checkpoint(path, model, optimizer)
    assert _unchanged(before, model, optimizer)
    assert bool(optimizer.state) == trained  # a fresh optimizer stays without state
    assert all(p.grad is None for p in model.parameters())


def test_nan_checkpoint_loads(tmp_path: Path) -> None:
    """Finiteness is not verified: a diverged run's checkpoint loads as it was saved."""
    model, optimizer = _model(1)
    with torch.no_grad():
        model[1].weight.fill_(float("nan"))
    path = save_checkpoint(str(tmp_path), 1, model, optimizer, {"step": 1})
    target, target_optimizer = _model(0)
    load_checkpoint(path, target, target_optimizer)
    assert target[1].weight.isnan().all() and torch.equal(target[0].weight, model[0].weight)
