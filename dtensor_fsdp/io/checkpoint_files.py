"""The files of one checkpoint directory, for ``dtensor_fsdp.io.verified_checkpoint``: the
``COMPLETE`` marker, checksums, ``extra.pt``, and DCP's reader and planner restricted
so that loading runs no code and follows no link.

Every function here acts on this process alone; which rank calls what is
``verified_checkpoint.py``'s business (its docstring holds [Note: checkpoint
completion]), and how the ranks agree ``rank_agreement.py``'s.

[Note: checkpoint checksums] The marker (format version 2) also records each file's
CRC32, which catches what sizes cannot: a file overwritten in place, a flipped bit.
CRC32 (``zlib.crc32``, about 1 GB/s on one core) detects every error burst up to 32
bits; it guards against corruption, not against an attacker, who can rewrite the
marker too (see [Note: loading runs no code]). On save every rank checksums a stripe of
the files (``names[rank::world_size]``) and rank 0 records them all; on load, and in
``latest_checkpoint`` under a process group, every rank verifies its stripe and the
ranks agree, so each file is read once per verification, not once per rank. Without a
process group ``latest_checkpoint`` verifies whole checkpoints. Markers without a
version (written before checksums existed) are loaded on sizes alone, with a warning.

[Note: no symlinks] Nothing inside the checkpoint directory is followed through a
symbolic link: a link may point anywhere, and a save would delete or overwrite what it
points to, a load read it. ``save_checkpoint`` refuses a ``step_N.tmp`` or ``step_N``
that is a link, before anything is written and again at the rename, and creates its
files with ``O_EXCL | O_NOFOLLOW``. ``load_checkpoint`` refuses a ``step_N`` that is a
link, requires every file the marker names to be a regular file (``lstat``), opens every
file with ``O_NOFOLLOW`` (DCP's reads too) and reads only files the marker names.
``latest_checkpoint`` skips linked step directories with a warning, and pruning never
deletes through a link. The parent directory itself may be a link (a mount chosen by
the user).

[Note: loading runs no code] A checkpoint's files are data, never code: whoever can
write to the checkpoint directory must not be able to run code in every rank that loads
it. Plain DCP unpickles ``.metadata`` with ``pickle`` and its non-tensor records with
``torch.load(weights_only=False)``, so a crafted file runs anything. Here ``.metadata``
goes through ``_MetadataUnpickler`` (only the classes DCP's ``Metadata`` is made of),
non-tensor records and ``extra.pt`` through ``torch.load(weights_only=True)``, and DCP
already reads tensor records with ``weights_only=True``. A refused file raises
``CheckpointError`` naming it; ``save_checkpoint`` refuses ``extra`` or ``rank_extra``
that would not load this way, before writing anything. The ``COMPLETE`` marker is no
defence here: it is plain JSON that anyone able to replace a file can rewrite too.
"""

import contextlib
import dataclasses
import io
import json
import os
import pickle
import stat
import warnings
import zlib
from collections.abc import Iterator
from typing import Any, BinaryIO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

MARKER = "COMPLETE"
EXTRA_FILE = "extra.pt"
TMP_SUFFIX = ".tmp"
_MARKER_VERSION = 2  # 2: sizes and CRC32s; none (1): sizes only
_CHUNK_BYTES = 8 << 20  # checksums read files in chunks of this size
# Opening the last component of a path with O_NOFOLLOW fails if it is a link (ELOOP),
# atomically; platforms without it (Windows) fall back to the lstat checks alone.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class CheckpointError(RuntimeError):
    """A checkpoint directory is incomplete, corrupted, does not fit the model, or a
    step of a save or load failed on some rank (the message names the rank)."""


# ---------------------------------------------------------------------------
# Links and plain files (see [Note: no symlinks])
# ---------------------------------------------------------------------------


def refuse_symlink(path: str) -> None:
    """Raise if ``path`` is a symbolic link (dangling or not)."""
    if os.path.islink(path):
        raise CheckpointError(
            f"{path} is a symbolic link (to {os.readlink(path)}): checkpoints are never "
            "read or written through links; remove the link (or pass the directory it "
            "points to)"
        )


def plain_file_size(file: str) -> int | None:
    """The size of the regular file ``file``, ``None`` if it does not exist.

    Raises:
        CheckpointError: if ``file`` is a link or not a regular file.
    """
    try:
        info = os.lstat(file)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        refuse_symlink(file)
    if not stat.S_ISREG(info.st_mode):
        raise CheckpointError(f"{file} is not a regular file")
    return info.st_size


@contextlib.contextmanager
def open_nofollow(file: str | os.PathLike, mode: str = "rb") -> Iterator[BinaryIO]:
    """``open(file, mode)`` ("rb", or "xb": create, never overwrite), refusing a link."""
    flags = {"rb": os.O_RDONLY, "xb": os.O_WRONLY | os.O_CREAT | os.O_EXCL}[mode]
    try:
        fd = os.open(file, flags | _NOFOLLOW | getattr(os, "O_BINARY", 0), 0o644)
    except OSError:
        if os.path.islink(file):
            refuse_symlink(str(file))
        raise
    with os.fdopen(fd, mode.replace("x", "w")) as f:
        yield f


def is_plain_name(name: str) -> bool:
    """Whether ``name`` names a file directly inside the checkpoint directory."""
    return name not in ("", ".", "..") and os.path.basename(name) == name and "\\" not in name


# ---------------------------------------------------------------------------
# The marker and checksums (see [Note: checkpoint completion] and [Note: checkpoint
# checksums])
# ---------------------------------------------------------------------------


def data_files(path: str) -> list[str]:
    """The names of the checkpoint's files, the marker excepted, sorted."""
    return sorted(name for name in os.listdir(path) if name != MARKER)


def file_crc32(file: str) -> int:
    crc = 0
    with open_nofollow(file) as f:
        while chunk := f.read(_CHUNK_BYTES):
            crc = zlib.crc32(chunk, crc)
    return crc


def checksums(path: str, names: list[str]) -> dict[str, int]:
    return {name: file_crc32(os.path.join(path, name)) for name in names}


def write_marker(staging: str, step: int, world_size: int, crc32: dict[str, int]) -> None:
    sizes = {name: os.lstat(os.path.join(staging, name)).st_size for name in crc32}
    marker = {
        "version": _MARKER_VERSION,
        "step": step,
        "world_size": world_size,
        "files": sizes,
        "crc32": crc32,
    }
    partial = os.path.join(staging, MARKER + TMP_SUFFIX)
    with open_nofollow(partial, "xb") as f:
        f.write(json.dumps(marker).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, os.path.join(staging, MARKER))  # never half-written


def read_marker(path: str) -> dict[str, Any]:
    """The marker of the complete checkpoint at ``path``, every file it names checked
    for its size and for being a regular file; see [Note: checkpoint completion].

    Returns:
        ``step``, ``world_size``, ``files`` (name -> size) and ``crc32`` (name -> CRC32,
        ``None`` for a marker written before checksums).

    Raises:
        CheckpointError: naming ``path`` and what is wrong with it.
    """
    if path.rstrip(os.sep).endswith(TMP_SUFFIX):
        raise CheckpointError(f"checkpoint {path} is a partial save (its name ends in .tmp)")
    refuse_symlink(path.rstrip(os.sep))
    marker_path = os.path.join(path, MARKER)
    try:
        with open_nofollow(marker_path) as f:
            marker = json.load(f)
        step, world_size, sizes = marker["step"], marker["world_size"], dict(marker["files"])
        crc32 = marker["crc32"] if marker.get("version") else None
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint {path} is incomplete: no {MARKER} marker (the save was interrupted)"
        ) from None
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"checkpoint {path} has an unreadable {MARKER} marker: {exc}"
        ) from exc
    for name, size in sizes.items():
        if not is_plain_name(name):
            raise CheckpointError(
                f"checkpoint {path}: its {MARKER} marker names {name!r}, which is not a file "
                "of the checkpoint directory"
            )
        actual = plain_file_size(os.path.join(path, name))
        if actual != size:
            found = "missing" if actual is None else f"{actual} bytes"
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {name} is {found}, the marker says {size} bytes"
            )
    return {"step": step, "world_size": world_size, "files": sizes, "crc32": crc32}


def verify_checksums(path: str, marker: dict[str, Any], stripe: slice = slice(None)) -> None:
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
            stacklevel=4,
        )
        return
    for name in sorted(expected)[stripe]:
        actual = file_crc32(os.path.join(path, name))
        if actual != expected[name]:
            raise CheckpointError(
                f"checkpoint {path} is corrupted: {name} has CRC32 {actual:08x}, "
                f"the marker says {expected[name]:08x}"
            )


# ---------------------------------------------------------------------------
# extra.pt (see [Note: loading runs no code])
# ---------------------------------------------------------------------------


def check_plain_data(what: str, value: Any) -> None:
    """Raise unless ``value`` round-trips through ``torch.save`` and
    ``torch.load(weights_only=True)``: what ``load_checkpoint`` will be able to read."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"{what} must hold plain data (tensors, numbers, strings, lists, dicts), which "
            f"load_checkpoint reads with weights_only=True: {type(exc).__name__}: {exc}"
        ) from exc


def write_extra(staging: str, saved: dict[str, Any]) -> None:
    with open_nofollow(os.path.join(staging, EXTRA_FILE), "xb") as f:
        torch.save(saved, f)


def load_extra(path: str) -> dict[str, Any]:
    file = os.path.join(path, EXTRA_FILE)
    try:
        with open_nofollow(file) as f:
            return torch.load(f, weights_only=True)  # see [Note: loading runs no code]
    except CheckpointError:
        raise
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {path}: refused to load {EXTRA_FILE}, it holds more than plain data "
            f"(tensors, numbers, strings, lists, dicts): {exc}"
        ) from exc
    except Exception as exc:
        raise CheckpointError(f"checkpoint {path}: could not read {EXTRA_FILE}: {exc}") from exc


# ---------------------------------------------------------------------------
# Restricted reading for DCP (see [Note: loading runs no code] and [Note: no symlinks])
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

    def __init__(self, file: BinaryIO, path: str) -> None:
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


class _NoFollowFileSystem(FileSystem):
    """DCP's local file system, opening files for reading with ``open_nofollow``."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if mode != "rb":
            raise CheckpointError(f"{path}: loading a checkpoint only reads files")
        with open_nofollow(path) as f:
            yield f  # type: ignore[misc]


class SafeReader(dcp.FileSystemReader):
    """DCP's file system reader, reading ``.metadata`` with ``_MetadataUnpickler``,
    opening no link, and reading only ``files`` (the marker's) of the checkpoint."""

    def __init__(self, path: str, files: set[str]) -> None:
        super().__init__(path)
        self.fs = _NoFollowFileSystem()
        self.files = files

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        # DCP names a rank-local metadata file __{rank}.metadata (when saved without
        # coordination); ours are always the global one.
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        file = os.path.join(str(self.path), name)
        with open_nofollow(file) as f:
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
        self._check_storage_files(file, metadata)
        # As FileSystemReader.read_metadata does.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _check_storage_files(self, file: str, metadata: Metadata) -> None:
        # The reader opens path / relative_path: "../x" or a file the marker does not
        # name would read outside what was verified.
        for info in (metadata.storage_data or {}).values():
            name = str(getattr(info, "relative_path", ""))
            if name not in self.files or not is_plain_name(name):
                raise CheckpointError(
                    f"checkpoint file {file} points to {name!r}, which is not one of the "
                    f"files its {MARKER} marker names"
                )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        # Non-tensor records first: one refused by SafeLoadPlanner then raises before
        # any tensor was read.
        is_bytes = [item.type == LoadItemType.BYTE_IO for item in plan.items]
        records = [item for item, b in zip(plan.items, is_bytes) if b]
        tensors = [item for item, b in zip(plan.items, is_bytes) if not b]
        super().read_data(dataclasses.replace(plan, items=records), planner).wait()
        return super().read_data(dataclasses.replace(plan, items=tensors), planner)


class SafeLoadPlanner(DefaultLoadPlanner):
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
        # The rest is DefaultLoadPlanner.load_bytes. The state dict is load_checkpoint's
        # own, so every container on the path exists (DCP's set_element, private, would
        # create missing ones).
        if not self.flatten_state_dict:
            self.state_dict[fqn] = obj
            return
        *parents, last = self.mappings[fqn]
        container = self.original_state_dict
        for key in parents:
            container = container[key]
        container[last] = obj
