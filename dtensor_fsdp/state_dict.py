"""State dicts of fully-sharded modules, and a streamed full export.

- ``model.state_dict()`` returns the sharded DTensors under the original FQNs, with no
  communication and no FSDP-specific key mangling; a pre-hook reshards the group first,
  so it never returns unsharded parameters (torch's FSDP2 does after a ``no_grad``
  forward of the root).
- ``model.load_state_dict(sd)`` takes sharded DTensors (any placements or mesh: they
  are redistributed) and plain full tensors (each rank keeps its own chunk: no rank
  broadcasts the model). ``FSDPModule.load_state_dict`` checks keys and shapes of
  everything before it copies anything, so a bad state dict leaves the model as it was
  (torch's raises after copying the rest). Values are copied into the sharded storage
  in place, cast to the parameter's dtype as ``nn.Module`` and torch's FSDP2 do: the
  zero-copy all-gather input stays intact.
- ``save_full_state_dict(model, path)`` writes a full, unsharded checkpoint from rank 0
  one tensor at a time (memory: the largest tensor), in the safetensors format, which
  needs no extra dependency to write (``safetensors.torch.load_file`` reads it too);
  ``format="torch"`` writes an ordinary ``torch.save`` file instead. Either way
  ``load_full_state_dict(path)`` reads it back as a plain state dict.
"""

import ctypes
import json
import os
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .state import FSDPState

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def register_state_dict_hooks(state: FSDPState) -> None:
    """Hook ``state``'s modules so their state dicts are sharded in and out."""
    for module in state.modules:
        module.register_state_dict_pre_hook(_reshard_before_state_dict(state))
        module.register_load_state_dict_pre_hook(_shard_loaded_values(state, module))
        module.register_load_state_dict_post_hook(_adopt_assigned(state))


def _reshard_before_state_dict(state: FSDPState) -> Callable[..., None]:
    def hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if state.group is not None:
            state.group.reshard()

    return hook


def _shard_loaded_values(state: FSDPState, root: nn.Module) -> Callable[..., None]:
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        if state.group is None:
            return
        state.group.reshard()
        for fsdp_param in state.group.fsdp_params:
            for slot in fsdp_param.slots:
                key = prefix + slot.key
                if slot.root is root and key in state_dict:
                    state_dict[key] = fsdp_param.to_sharded_value(state_dict[key])

    return hook


def _adopt_assigned(state: FSDPState) -> Callable[..., None]:
    def hook(module: nn.Module, incompatible_keys: Any) -> None:
        if state.group is not None:
            for fsdp_param in state.group.fsdp_params:
                fsdp_param.adopt_assigned()

    return hook


def validate_state_dict(
    module: nn.Module, module_name: str, state_dict: Mapping[str, Any], strict: bool
) -> None:
    """Raise, naming the keys, if ``state_dict`` cannot load into ``module`` whole.
    Another dtype is not a problem: the copy casts, as ``nn.Module``'s does.

    Raises:
        RuntimeError: missing or unexpected keys (``strict``), or a value whose shape
            differs from the module's.
    """
    expected = module.state_dict()
    problems = []
    if strict:
        missing = sorted(set(expected) - set(state_dict))
        unexpected = sorted(set(state_dict) - set(expected))
        if missing:
            problems.append(f"missing keys: {missing}")
        if unexpected:
            problems.append(f"unexpected keys: {unexpected}")
    for key in sorted(set(expected) & set(state_dict)):
        want, got = expected[key], state_dict[key]
        if not isinstance(got, torch.Tensor):
            continue
        if got.shape != want.shape:
            problems.append(f"'{key}': shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    if problems:
        raise RuntimeError(
            f"Error(s) loading state_dict for {module_name}; nothing was loaded:\n  "
            + "\n  ".join(problems)
        )


def save_full_state_dict(module: nn.Module, path: str, *, format: str = "safetensors") -> None:
    """Write ``module``'s full (unsharded) state dict to ``path``, from rank 0.

    Every rank must call it: each tensor is all-gathered, one at a time. The file
    appears atomically (written to ``path.tmp``, then renamed): a crash mid-write leaves
    no file at ``path``.

    Args:
        module: the (fully-sharded) module.
        path: the file to write.
        format: ``"safetensors"`` streams each tensor to the file as it is gathered, so
            rank 0 holds one full tensor at a time; ``"torch"`` is an ordinary
            ``torch.save`` of a plain state dict, which must be complete in host memory
            on rank 0 before it is written.
    """
    if format not in ("safetensors", "torch"):
        raise ValueError(
            f"save_full_state_dict: format must be 'safetensors' or 'torch', got {format!r}"
        )
    state_dict = module.state_dict()
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    temporary = f"{path}.tmp"
    if format == "torch":
        full = {key: _full_on_host(value) for key, value in state_dict.items()}
        if is_writer:
            torch.save(full, temporary)
    else:
        header = _safetensors_header(state_dict)
        handle = open(temporary, "wb") if is_writer else None
        if handle is not None:
            handle.write(len(header).to_bytes(8, "little"))
            handle.write(header)
        for value in state_dict.values():
            data = _host_bytes(_full_on_host(value))
            if handle is not None:
                handle.write(data)
        if handle is not None:
            handle.close()
    if is_writer:
        os.replace(temporary, path)
    if dist.is_initialized():
        dist.barrier()


def _safetensors_header(state_dict: dict[str, torch.Tensor]) -> bytes:
    entries: dict[str, Any] = {}
    offset = 0
    for key, value in state_dict.items():
        nbytes = value.numel() * value.element_size()
        entries[key] = {
            "dtype": _safetensors_dtype(key, value.dtype),
            "shape": list(value.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(entries, separators=(",", ":")).encode()
    return encoded + b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes


def _full_on_host(value: torch.Tensor) -> torch.Tensor:
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return full.detach().cpu()


def load_full_state_dict(path: str) -> dict[str, torch.Tensor]:
    """Read a file written by `save_full_state_dict` (either format) as a plain state
    dict, for an unsharded model."""
    if zipfile.is_zipfile(path):  # torch.save's format
        return torch.load(path, weights_only=True)
    by_name = {name: dtype for dtype, name in _SAFETENSORS_DTYPES.items()}
    with open(path, "rb") as f:
        header_size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_size))
        data = bytearray(f.read())
    state_dict = {}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        flat = torch.frombuffer(data, dtype=torch.uint8, count=end - start, offset=start)
        state_dict[key] = flat.view(by_name[entry["dtype"]]).reshape(entry["shape"]).clone()
    return state_dict


def _host_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of ``tensor``, copied to the host (no numpy dependency)."""
    host = tensor.contiguous()
    return ctypes.string_at(host.data_ptr(), host.numel() * host.element_size())


def _safetensors_dtype(key: str, dtype: torch.dtype) -> str:
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(
            f"save_full_state_dict: '{key}' has dtype {dtype}, which safetensors cannot hold"
        )
    return _SAFETENSORS_DTYPES[dtype]
