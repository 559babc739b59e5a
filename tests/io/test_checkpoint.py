"""``dtensor_fsdp.checkpoint`` in one process (no process group): which directories
count as complete checkpoints, pruning, and clear errors for partial or corrupted ones.

The distributed paths (sharded models, resharding on load) are in
``tests/io/test_state_dict.py``; killed saves and restarts in ``tests/observe/test_faults.py``.
"""

import json
import os
import re
import shutil
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict

from dtensor_fsdp.checkpoint import (
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)

# DCP warns that it saves and loads in a single process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    return model, optimizer


def _save(directory: Path, step: int, keep_last: int = 2) -> str:
    model, optimizer = _model(step)
    return save_checkpoint(
        str(directory),
        step,
        model,
        optimizer,
        {"step": step, "rng": torch.get_rng_state()},
        rank_extra={"seed": step},
        keep_last=keep_last,
    )


def _shard_file(path: str) -> str:
    return next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".distcp"))


def test_round_trip(tmp_path: Path) -> None:
    path = _save(tmp_path, 3)
    assert path == checkpoint_path(str(tmp_path), 3) and latest_checkpoint(str(tmp_path)) == path
    saved_model, saved_optimizer = _model(3)
    model, optimizer = _model(99)
    loaded = load_checkpoint(path, model, optimizer)
    assert (loaded.step, loaded.world_size, loaded.extra["step"]) == (3, 1, 3)
    assert loaded.rank_extra == {"seed": 3}
    for a, b in zip(model.parameters(), saved_model.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(optimizer.state[a]["exp_avg"], saved_optimizer.state[b]["exp_avg"])


def test_empty_or_missing_directory(tmp_path: Path) -> None:
    assert latest_checkpoint(str(tmp_path / "nothing")) is None
    assert latest_checkpoint(str(tmp_path)) is None


def test_tmp_directory_is_skipped(tmp_path: Path) -> None:
    complete = _save(tmp_path, 1)
    interrupted = _save(tmp_path / "other", 2)
    os.replace(interrupted, str(tmp_path / "step_00000002.tmp"))  # a save that never finished
    assert latest_checkpoint(str(tmp_path)) == complete
    with pytest.raises(CheckpointError, match=r"step_00000002\.tmp.*partial"):
        load_checkpoint(str(tmp_path / "step_00000002.tmp"), *_model(0))


def test_final_directory_without_marker_is_skipped(tmp_path: Path) -> None:
    complete = _save(tmp_path, 1)
    newer = _save(tmp_path, 2)
    os.remove(os.path.join(newer, "COMPLETE"))
    with pytest.warns(UserWarning, match=f"skipping checkpoint: .*{newer} is incomplete"):
        assert latest_checkpoint(str(tmp_path)) == complete
    with pytest.raises(CheckpointError, match=f"{newer} is incomplete: no COMPLETE marker"):
        load_checkpoint(newer, *_model(0))


def test_unreadable_marker_is_skipped(tmp_path: Path) -> None:
    complete = _save(tmp_path, 1)
    newer = _save(tmp_path, 2)
    Path(newer, "COMPLETE").write_text("{not json")
    with pytest.warns(UserWarning, match=f"skipping checkpoint: .*{newer} has an unreadable"):
        assert latest_checkpoint(str(tmp_path)) == complete
    with pytest.raises(CheckpointError, match=f"{newer} has an unreadable COMPLETE marker"):
        load_checkpoint(newer, *_model(0))


def test_truncated_file_is_skipped(tmp_path: Path) -> None:
    complete = _save(tmp_path, 1)
    newer = _save(tmp_path, 2)
    shard = _shard_file(newer)
    os.truncate(shard, os.path.getsize(shard) // 2)
    name = os.path.basename(shard)
    with pytest.warns(UserWarning, match=f"skipping checkpoint: .*{newer} is corrupted: {name}"):
        assert latest_checkpoint(str(tmp_path)) == complete
    with pytest.raises(CheckpointError, match=f"{newer} is corrupted: {name} is .* bytes"):
        load_checkpoint(newer, *_model(0))


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    params = [p.detach().clone() for p in model.parameters()]
    return params + [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]


def _assert_corruption_refused(path: str, name: str) -> None:
    """``load_checkpoint`` names ``name`` before the model or optimizer changed."""
    model, optimizer = _model(0)
    before = _snapshot(model, optimizer)
    match = f"{re.escape(path)} is corrupted: {re.escape(name)} has CRC32 [0-9a-f]{{8}}, the marker"
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, model, optimizer)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, optimizer)))


def _assert_skipped(directory: Path, previous: str, name: str) -> None:
    with pytest.warns(UserWarning, match=f"skipping checkpoint: .* {re.escape(name)} has CRC32"):
        assert latest_checkpoint(str(directory)) == previous


def test_marker_records_checksums(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    marker = json.loads(Path(path, "COMPLETE").read_text())
    names = sorted(n for n in os.listdir(path) if n != "COMPLETE")
    assert marker["version"] == 2 and sorted(marker["crc32"]) == sorted(marker["files"]) == names
    for name in names:
        assert marker["crc32"][name] == zlib.crc32(Path(path, name).read_bytes())


def test_overwritten_in_place_is_refused(tmp_path: Path) -> None:
    previous = _save(tmp_path, 1)
    path = _save(tmp_path, 2)
    metadata = os.path.join(path, ".metadata")
    size = os.path.getsize(metadata)
    Path(metadata).write_bytes(b"\0" * size)  # same size: only reading it can tell
    _assert_corruption_refused(path, ".metadata")
    _assert_skipped(tmp_path, previous, ".metadata")


def _flip_bit_in_tensor(path: str, tensor: torch.Tensor) -> str:
    """Flip the lowest bit of ``tensor``'s first element where it is stored."""
    shard = _shard_file(path)
    data = bytearray(Path(shard).read_bytes())
    at = data.find(tensor.detach().numpy().tobytes())
    assert at >= 0 and data.find(tensor.detach().numpy().tobytes(), at + 1) < 0
    data[at] ^= 1
    Path(shard).write_bytes(bytes(data))
    return shard


def test_flipped_bit_in_tensor_data_is_refused(tmp_path: Path) -> None:
    previous = _save(tmp_path, 1)
    path = _save(tmp_path, 2)
    saved_model, _ = _model(2)
    shard = _flip_bit_in_tensor(path, saved_model[0].weight)
    # torch's DCP loads it silently: one weight is off by one ulp.
    model, optimizer = _model(0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    assert not torch.equal(model_sd["0.weight"], saved_model[0].weight)
    assert torch.equal(model_sd["0.bias"], saved_model[0].bias)
    _assert_corruption_refused(path, os.path.basename(shard))
    _assert_skipped(tmp_path, previous, os.path.basename(shard))


def test_marker_without_checksums_loads_on_sizes(tmp_path: Path) -> None:
    path = _save(tmp_path, 1)
    marker_file = Path(path, "COMPLETE")
    marker = json.loads(marker_file.read_text())
    del marker["version"], marker["crc32"]  # a marker written before checksums existed
    marker_file.write_text(json.dumps(marker))
    with pytest.warns(UserWarning, match=f"{re.escape(path)} has no checksums"):
        assert latest_checkpoint(str(tmp_path)) == path
    with pytest.warns(UserWarning, match=f"{re.escape(path)} has no checksums"):
        assert load_checkpoint(path, *_model(0)).step == 1


def test_keep_last_prunes_oldest_complete(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step_00000003", "step_00000004"]


def test_prune_keeps_the_only_complete_checkpoint(tmp_path: Path) -> None:
    broken = _save(tmp_path, 9)
    os.remove(os.path.join(broken, "COMPLETE"))  # newer, but not complete
    stale = tmp_path / "step_00000001.tmp"
    shutil.copytree(broken, stale)  # an interrupted save of an older step
    only = _save(tmp_path, 5, keep_last=1)
    with pytest.warns(UserWarning, match=f"skipping checkpoint: .*{broken} is incomplete"):
        assert latest_checkpoint(str(tmp_path)) == only
    # The new checkpoint and the incomplete newer one stay; the stale .tmp goes.
    assert sorted(os.listdir(tmp_path)) == ["step_00000005", "step_00000009"]


def test_save_same_step_again_replaces(tmp_path: Path) -> None:
    _save(tmp_path, 2)
    path = _save(tmp_path, 2)
    marker = json.loads(Path(path, "COMPLETE").read_text())
    assert (marker["step"], marker["world_size"]) == (2, 1)
    assert sorted(os.listdir(tmp_path)) == ["step_00000002"]


@pytest.mark.parametrize(("step", "keep_last", "match"), [(1, 0, "keep_last"), (-1, 2, "step")])
def test_bad_arguments(tmp_path: Path, step: int, keep_last: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _save(tmp_path, step, keep_last=keep_last)
    assert not os.listdir(tmp_path)
