"""Loading a checkpoint never runs code from its files (issue 11 item 1), in one process.

Each test tampers with one file of a real checkpoint so that unpickling it calls
``os.mkdir(marker)``, then rewrites the ``COMPLETE`` marker to match (it is plain JSON:
whoever can replace a file can rewrite it too). torch's own loaders (``dcp.load``,
``torch.load(weights_only=False)``) run the payload: the marker directory appears, which
also proves the payload is live. ``load_checkpoint`` must raise ``CheckpointError`` naming
the file or record, with the marker never created and the model untouched.
"""

import contextlib
import dataclasses
import os
import pickle
import re
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from dtensor_fsdp.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dtensor_fsdp.io.checkpoint_files import checksums, data_files, write_marker
from tests.io.test_checkpoint import _model

# DCP warns that it saves and loads in a single process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

STEP = 1


class _Payload:
    """Unpickling it calls ``os.mkdir(marker)``: the stand-in for arbitrary code."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.mkdir, (self.marker,))


def _save(directory: Path) -> str:
    model, optimizer = _model(STEP)
    return save_checkpoint(str(directory), STEP, model, optimizer, {"step": STEP})


def _forge_marker(path: str) -> None:
    """Rewrite ``COMPLETE`` to match the tampered files, as an attacker can."""
    write_marker(path, STEP, 1, checksums(path, data_files(path)))


def _assert_refused(path: str, match: str, marker: Path) -> None:
    model, optimizer = _model(0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match=match):
        load_checkpoint(path, model, optimizer)
    assert not marker.exists(), "the payload ran"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def _torch_dcp_load(path: str) -> None:
    """torch's plain DCP load of the same checkpoint (the reference)."""
    model, optimizer = _model(0)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    # Whether it fails afterwards does not matter: the payload has run by then.
    with contextlib.suppress(Exception, dcp.CheckpointException):
        dcp.load(state, checkpoint_id=path)


def test_metadata_payload_never_runs(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    marker = tmp_path / "payload_ran"
    metadata = Path(path, ".metadata")
    payload = pickle.dumps(_Payload(str(marker)))
    size = metadata.stat().st_size
    assert len(payload) < size
    # Padded to the original size (pickle stops at its STOP opcode): a sizes-only marker
    # still matches; _forge_marker makes any checksum match too.
    metadata.write_bytes(payload + b"\0" * (size - len(payload)))
    _forge_marker(path)
    assert latest_checkpoint(str(tmp_path / "ckpt")) == path  # the marker cannot tell
    refused = re.escape(f"{os.mkdir.__module__}.mkdir")
    _assert_refused(path, rf"{re.escape(str(metadata))} refers to {refused}", marker)
    _torch_dcp_load(path)
    assert marker.exists()


def test_extra_payload_never_runs(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    marker = tmp_path / "payload_ran"
    extra = Path(path, "extra.pt")
    torch.save({"extra": _Payload(str(marker)), "rank_extra": None}, extra)
    _forge_marker(path)
    _assert_refused(path, rf"{re.escape(path)}: refused to load extra\.pt", marker)
    torch.load(extra, weights_only=False)  # the reference: what a plain torch.load does
    assert marker.exists()


def _replace_bytes_record(path: str, fqn: str, data: bytes) -> None:
    """Point DCP's record ``fqn`` at ``data``, appended to the shard file."""
    metadata_file = Path(path, ".metadata")
    metadata = pickle.loads(metadata_file.read_bytes())  # our own test file
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    shard = Path(path, info.relative_path)
    offset = shard.stat().st_size
    with shard.open("ab") as f:
        f.write(data)
    metadata.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(data))
    metadata_file.write_bytes(pickle.dumps(metadata))


def test_bytes_record_payload_never_runs(tmp_path: Path) -> None:
    path = _save(tmp_path / "ckpt")
    marker = tmp_path / "payload_ran"
    fqn = "optim.param_groups.0.lr"
    record = tmp_path / "record.pt"
    torch.save(_Payload(str(marker)), record)
    _replace_bytes_record(path, fqn, record.read_bytes())
    _forge_marker(path)
    _assert_refused(path, rf"record {re.escape(fqn)} holds more than plain data", marker)
    _torch_dcp_load(path)
    assert marker.exists()
