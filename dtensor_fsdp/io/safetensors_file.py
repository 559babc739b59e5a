"""The safetensors file of ``save_full_state_dict`` and ``load_full_state_dict``, written
one tensor at a time and read and checked by the ``safetensors`` package.

[Note: streamed safetensors] safetensors' own writers (``safetensors.torch.save_file``,
``serialize_file``) take every tensor at once: the whole model in host memory on rank 0.
The format (https://huggingface.co/docs/safetensors/index#format) is an 8-byte
little-endian header length, a JSON header (name -> ``dtype``, ``shape``,
``data_offsets``; ``__metadata__``: str -> str), then the tensors' bytes back to back.
The header depends on names, dtypes and shapes only, all known before anything is
gathered, so ``encode_header`` writes it first and ``write_tensor`` appends each tensor
as it is gathered: one full tensor in memory at a time (torch's DCP writes its
consolidated safetensors headers the same way, ``_consolidate_hf_safetensors``). What we
do not write by hand: the dtype names are asked of the installed safetensors
(``_dtype_name``), and ``check_written`` re-opens the finished file with
``safetensors.safe_open``, whose parser checks the header and that the offsets cover the
data exactly, and compares its names, dtypes and shapes with the header we meant to
write. ``read_state_dict`` reads through ``safe_open`` too, so a malformed file is
refused by safetensors' hardened parser and raises one ``ValueError`` naming the file.
"""

import ctypes
import json
from collections.abc import Mapping
from typing import Any, BinaryIO

import safetensors
import safetensors.torch
import torch
from safetensors import SafetensorError, safe_open

_METADATA_KEY = "__metadata__"
# What transformers' save_pretrained writes; from_pretrained before transformers 4.48.2
# fails on a file without it (AttributeError on the missing metadata).
_METADATA = {"format": "pt"}
_ALIGNMENT = 8  # the header is padded with spaces so the data starts 8-byte aligned

Header = dict[str, Any]  # the JSON header: name -> {"dtype", "shape", "data_offsets"}


def plan_header(state_dict: Mapping[str, Any]) -> Header:
    """The header of a file holding ``state_dict``'s values in its order (DTensors count
    with their full shape).

    Raises:
        ValueError: naming the key, for a value that is not a tensor, of a dtype
            safetensors cannot hold, or the reserved key ``__metadata__``.
    """
    header: Header = {_METADATA_KEY: _METADATA}
    names: dict[torch.dtype, str] = {}
    offset = 0
    for key, value in state_dict.items():
        if key == _METADATA_KEY:
            raise ValueError(
                f"save_full_state_dict: the key '{key}' is reserved by the safetensors "
                "format; rename the module attribute, or save with format='torch'"
            )
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"save_full_state_dict: '{key}' is a {type(value).__name__}, not a tensor; "
                "the safetensors format holds tensors only: save with format='torch'"
            )
        if value.dtype not in names:
            names[value.dtype] = _dtype_name(key, value.dtype)
        nbytes = value.numel() * value.element_size()
        header[key] = {
            "dtype": names[value.dtype],
            "shape": list(value.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    return header


def _dtype_name(key: str, dtype: torch.dtype) -> str:
    """safetensors' name for ``dtype`` (``"F32"``, ``"BF16"``, ...), as the installed
    safetensors writes it: it serializes one element of ``dtype``, and the name and shape
    it records are read back. A packed dtype (``float4_e2m1fn_x2``: two values per
    element) records another shape than torch's and is refused with the rest."""
    name = None
    try:
        itemsize = torch.empty(0, dtype=dtype).element_size()
        one = torch.zeros(itemsize, dtype=torch.uint8).view(dtype)  # (1,)
        ((_, entry),) = safetensors.deserialize(safetensors.torch.save({key: one}))
        if list(entry["shape"]) == [1]:
            name = entry["dtype"]
    except Exception:  # noqa: BLE001 - versions raise differently (0.8: KeyError); any is a no
        pass
    if name is None:
        raise ValueError(
            f"save_full_state_dict: '{key}' has dtype {dtype}, which safetensors "
            f"{safetensors.__version__} cannot hold: cast it, or save with format='torch'"
        )
    return name


def encode_header(header: Header) -> bytes:
    """The file's first bytes: the header's length (8 bytes, little-endian) and JSON."""
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _ALIGNMENT)
    return len(encoded).to_bytes(8, "little") + encoded


def write_tensor(file: BinaryIO, tensor: torch.Tensor) -> None:
    """Append ``tensor``'s bytes (a host tensor) to ``file``, without a copy of them."""
    tensor = tensor.contiguous()
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes:
        # A view of the tensor's memory (alive through this call): `bytes(...)` of it
        # would hold a second copy of the largest tensor.
        file.write((ctypes.c_char * nbytes).from_address(tensor.data_ptr()))


def check_written(path: str, header: Header) -> None:
    """Re-open the finished file with safetensors' parser and compare it with ``header``.

    Raises:
        RuntimeError: naming the file, if safetensors refuses it or reads other names,
            dtypes or shapes (a bug of the writer, never of the user's model).
    """
    try:
        with safe_open(path, framework="pt") as f:
            slices = {key: f.get_slice(key) for key in f.keys()}
            written = {k: (s.get_dtype(), list(s.get_shape())) for k, s in slices.items()}
            metadata = f.metadata()
    except SafetensorError as exc:
        raise RuntimeError(
            f"save_full_state_dict wrote {path}, which safetensors refuses: {exc}"
        ) from exc
    meant = {k: (v["dtype"], v["shape"]) for k, v in header.items() if k != _METADATA_KEY}
    if written != meant or metadata != _METADATA:
        raise RuntimeError(
            f"save_full_state_dict wrote {path}, but safetensors reads other tensors from "
            "it than were written"
        )


def read_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file ``path``, in the file's order.

    Raises:
        ValueError: naming ``path`` and safetensors' reason, if the file is malformed.
    """
    try:
        with safe_open(path, framework="pt") as f:
            # get_tensor maps the file (copy-on-write): a later write into the file would
            # show through, and truncating it would crash the process (SIGBUS) when the
            # tensor is read. A clone owns its memory; one tensor is copied at a time.
            return {key: f.get_tensor(key).clone() for key in f.offset_keys()}
    except SafetensorError as exc:
        raise ValueError(
            f"load_full_state_dict: {path} is not a valid safetensors file: {exc}"
        ) from exc
