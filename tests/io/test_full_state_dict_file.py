"""The safetensors file of ``save_full_state_dict`` / ``load_full_state_dict``, in one
process (no process group: the module's own tensors are the full ones).

Malformed files (issue 19 item 5) are refused by safetensors' parser: ours raises one
``ValueError`` that names the file and keeps safetensors' reason, where torch's own
reader of safetensors checkpoints (``torch.distributed.checkpoint``'s
``HuggingFaceStorageReader``) and ``safetensors.torch.load_file`` raise a bare
``SafetensorError`` with the same reason and no file name. The files we write are read
bitwise by ``safetensors.torch.load_file`` and hold what ``safetensors.torch.save_file``
writes for the same tensors (names, dtype names, shapes, bytes).
"""

import json
import os
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader

from dtensor_fsdp import load_full_state_dict, save_full_state_dict
from dtensor_fsdp.io.safetensors_file import check_written, plan_header

FILE = "model.safetensors"  # torch's reader reads every *.safetensors of a directory


class _Holder(nn.Module):
    """A module whose state dict is ``tensors`` (as buffers), in order."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        for name, tensor in tensors.items():
            self.register_buffer(name, tensor)


def _header(entries: object, data: bytes = b"", size: int | None = None) -> bytes:
    encoded = json.dumps(entries).encode()
    return struct.pack("<Q", len(encoded) if size is None else size) + encoded + data


def _f32(offsets: list[int], shape: list[int]) -> dict:
    return {"a": {"dtype": "F32", "shape": shape, "data_offsets": offsets}}


def _truncated(directory: Path) -> bytes:
    """A file of ours with its last 4 bytes cut off."""
    save_full_state_dict(nn.Linear(2, 2), str(directory / "whole.safetensors"))
    return (directory / "whole.safetensors").read_bytes()[:-4]


# name -> (the file's bytes, from a scratch directory; safetensors' reason)
MALFORMED: dict[str, tuple[Callable[[Path], bytes], str]] = {
    "empty": (lambda d: b"", "header too small"),
    "header_size_2_62": (lambda d: struct.pack("<Q", 1 << 62) + b"{}", "header too large"),
    "header_past_end": (lambda d: struct.pack("<Q", 100) + b"{}", "invalid header length"),
    "not_json": (lambda d: struct.pack("<Q", 5) + b"{abc}", "invalid JSON in header"),
    "unknown_dtype": (
        lambda d: _header({"a": {"dtype": "X99", "shape": [2], "data_offsets": [0, 8]}}, b"0" * 8),
        "unknown variant `X99`",
    ),
    "header_is_a_list": (lambda d: _header([1, 2]), "invalid type: sequence"),
    "truncated_data": (_truncated, "incomplete metadata, file not fully covered"),
    "offsets_out_of_range": (
        lambda d: _header(_f32([0, 800], [2]), b"0" * 8),
        "invalid shape, data type, or offset for tensor",
    ),
    "offsets_not_shape": (
        lambda d: _header(_f32([0, 8], [3]), b"0" * 8),
        "invalid shape, data type, or offset for tensor",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_malformed_file_raises_value_error_naming_it(tmp_path: Path, case: str) -> None:
    make, reason = MALFORMED[case]
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    path = directory / FILE
    path.write_bytes(make(tmp_path))

    with pytest.raises(ValueError) as ours:
        load_full_state_dict(str(path))
    with pytest.raises(SafetensorError) as torch_reader:
        HuggingFaceStorageReader(str(directory)).read_metadata()
    with pytest.raises(SafetensorError) as load_file:
        safetensors.torch.load_file(str(path))

    message = str(ours.value)
    assert str(path) in message and "not a valid safetensors file" in message, message
    assert reason in str(torch_reader.value), str(torch_reader.value)
    # safetensors' reason, whole, as torch's reader and load_file report it.
    assert str(torch_reader.value) in message and str(load_file.value) in message, message
    assert isinstance(ours.value.__cause__, SafetensorError)


def test_missing_file_raises_file_not_found_naming_it(tmp_path: Path) -> None:
    path = str(tmp_path / FILE)
    with pytest.raises(FileNotFoundError, match="No such file") as ours:
        load_full_state_dict(path)
    with pytest.raises(FileNotFoundError):
        safetensors.torch.load_file(path)
    with pytest.raises(FileNotFoundError):
        torch.load(path, weights_only=True)
    assert path in str(ours.value)


def test_directory_raises_is_a_directory_naming_it(tmp_path: Path) -> None:
    # safe_open's own error for a directory ("No such device") names no file.
    with pytest.raises(IsADirectoryError) as ours:
        load_full_state_dict(str(tmp_path))
    with pytest.raises(IsADirectoryError):
        torch.load(str(tmp_path), weights_only=True)
    assert str(tmp_path) in str(ours.value)


def _every_dtype() -> dict[str, torch.Tensor]:
    """One small tensor of every dtype safetensors holds, odd sizes and a 0-size one."""
    gen = torch.Generator().manual_seed(0)
    raw = torch.randint(0, 256, (3 * 5 * 8,), dtype=torch.uint8, generator=gen)
    dtypes = [
        torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64,
        torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64,
        torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64,
    ]  # fmt: skip
    tensors = {}
    for dtype in dtypes:
        size = torch.empty(0, dtype=dtype).element_size()
        values = (raw[:15] % 2).bool() if dtype == torch.bool else raw[: 15 * size].view(dtype)
        tensors["t_" + str(dtype).removeprefix("torch.")] = values.reshape(3, 5).clone()
    tensors["empty"] = torch.zeros(0, 4)
    tensors["scalar"] = torch.tensor(1.5)
    return tensors


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_round_trip_through_safetensors_is_bitwise(tmp_path: Path) -> None:
    tensors = _every_dtype()
    ours, theirs = str(tmp_path / "ours.safetensors"), str(tmp_path / "theirs.safetensors")
    save_full_state_dict(_Holder(tensors), ours)
    safetensors.torch.save_file(tensors, theirs, metadata={"format": "pt"})

    by_load_file = safetensors.torch.load_file(ours)
    by_us = load_full_state_dict(ours)
    reference = safetensors.torch.load_file(theirs)
    assert list(by_us) == list(tensors)  # the module's order
    assert sorted(by_load_file) == sorted(reference) == sorted(tensors)
    for key, tensor in tensors.items():
        assert same_bits(by_load_file[key], tensor), key
        assert same_bits(by_us[key], tensor), key
        assert same_bits(reference[key], tensor), key
    with safe_open(ours, framework="pt") as f, safe_open(theirs, framework="pt") as g:
        assert f.metadata() == g.metadata() == {"format": "pt"}
        for key in tensors:
            assert f.get_slice(key).get_dtype() == g.get_slice(key).get_dtype(), key
            assert f.get_slice(key).get_shape() == g.get_slice(key).get_shape(), key
    assert sorted(os.listdir(tmp_path)) == ["ours.safetensors", "theirs.safetensors"]


def test_torch_save_format_round_trip(tmp_path: Path) -> None:
    tensors = _every_dtype()
    path = str(tmp_path / "model.pt")
    save_full_state_dict(_Holder(tensors), path, format="torch")
    loaded = load_full_state_dict(path)
    assert all(same_bits(loaded[k], v) for k, v in tensors.items())


def test_loaded_tensors_do_not_map_the_file(tmp_path: Path) -> None:
    """safe_open's tensors map the file; ours are copies, so a later write into the file
    (in place, not through save_full_state_dict's rename) leaves them as they were. (A
    mapped tensor reads the new bytes; after a truncation, it crashes the process with
    SIGBUS, which is why this test only overwrites.)"""
    tensors = {"w": torch.arange(4096, dtype=torch.float32)}
    path = tmp_path / FILE
    save_full_state_dict(_Holder(tensors), str(path))
    loaded = load_full_state_dict(str(path))
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) - 4096)
        f.write(b"\0" * 4096)
    assert torch.equal(loaded["w"], tensors["w"])


@pytest.mark.parametrize(
    "dtype", [torch.complex128, torch.float4_e2m1fn_x2, torch.bits8, torch.uint4], ids=str
)
def test_dtype_safetensors_cannot_hold_writes_nothing(tmp_path: Path, dtype: torch.dtype) -> None:
    # float4_e2m1fn_x2 packs two values per element: safetensors records another shape.
    module = nn.Linear(2, 2)
    module.register_buffer("odd", torch.empty(0, dtype=dtype))
    path = tmp_path / FILE
    with pytest.raises(ValueError, match=rf"'odd' has dtype {dtype}, which safetensors"):
        save_full_state_dict(module, str(path))
    assert os.listdir(tmp_path) == []
    if dtype == torch.complex128:  # safetensors' own writer refuses it too, unnamed
        with pytest.raises(Exception):  # noqa: B017 - safetensors 0.8 raises a bare KeyError
            safetensors.torch.save_file({"odd": torch.zeros(1, dtype=dtype)}, str(path))


def test_non_tensor_and_reserved_keys_are_refused_by_name(tmp_path: Path) -> None:
    class WithExtraState(nn.Linear):
        def get_extra_state(self) -> dict:
            return {"step": 3}

        def set_extra_state(self, state: dict) -> None:
            pass

    path = tmp_path / FILE
    with pytest.raises(ValueError, match=r"'_extra_state' is a dict, not a tensor"):
        save_full_state_dict(WithExtraState(2, 2), str(path))
    with pytest.raises(ValueError, match=r"'__metadata__' is reserved"):
        save_full_state_dict(_Holder({"__metadata__": torch.zeros(1)}), str(path))
    assert os.listdir(tmp_path) == []


def test_check_written_refuses_a_file_other_than_planned(tmp_path: Path) -> None:
    path = str(tmp_path / FILE)
    save_full_state_dict(_Holder({"a": torch.zeros(2, 3)}), path)
    check_written(path, plan_header({"a": torch.zeros(2, 3)}))
    with pytest.raises(RuntimeError, match="reads other tensors"):
        check_written(path, plan_header({"a": torch.zeros(3, 2)}))
    with open(path, "ab") as f:
        f.write(b"\0")
    with pytest.raises(RuntimeError, match="which safetensors refuses"):
        check_written(path, plan_header({"a": torch.zeros(2, 3)}))
