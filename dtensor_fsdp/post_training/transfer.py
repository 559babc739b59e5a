"""Weights across a process group, trainer to engine: the trainer's sending rank
broadcasts each bucket of a stream (`send_buckets`), the engine's ranks receive them
(`receive_buckets`) and load them (`load_weights`): the shape of vLLM's and SGLang's
weight-update protocols (a process group between the trainer's rank 0 and the engine's
workers, names, dtypes and shapes first, then the tensors), with a Hugging Face model
as the engine.

Per bucket: one ``broadcast_object_list`` of its metadata (each tensor's names, shape
and dtype; a tied tensor once, under all its names), then one broadcast per tensor,
into tensors the receivers allocate; ``None`` as metadata ends the stream. The
receivers hold one bucket at a time.
"""

from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

Pairs = Iterable[tuple[str, torch.Tensor]]
# Per tensor: (its names, shape, dtype).
_Entry = tuple[tuple[str, ...], tuple[int, ...], torch.dtype]


def send_buckets(
    buckets: Iterable[list[tuple[str, torch.Tensor]]], *, group: dist.ProcessGroup, src: int
) -> None:
    """Broadcast every bucket of ``buckets`` (e.g. ``stream_weights(model, rank=src)``)
    from global rank ``src`` to the other ranks of ``group``, which call
    `receive_buckets`; then the end of the stream.

    Args:
        buckets: ``(name, tensor)`` buckets; the tensors must be on a device that
            ``group``'s backend takes (CPU for gloo, CUDA for NCCL).
        group: the process group of the sender and the engine's ranks.
        src: the sender's global rank (this rank).
    """
    for bucket in buckets:
        tensors: dict[int, torch.Tensor] = {}
        names: dict[int, list[str]] = {}
        for name, tensor in bucket:
            tensors.setdefault(id(tensor), tensor)
            names.setdefault(id(tensor), []).append(name)
        entries: list[_Entry] = [
            (tuple(names[key]), tuple(t.shape), t.dtype) for key, t in tensors.items()
        ]
        dist.broadcast_object_list([entries], src=src, group=group)
        for tensor in tensors.values():
            dist.broadcast(tensor.contiguous(), src=src, group=group)
    dist.broadcast_object_list([None], src=src, group=group)


def receive_buckets(
    *, group: dist.ProcessGroup, src: int, device: torch.device | str = "cpu"
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The buckets that `send_buckets` broadcasts from global rank ``src``, one at a
    time, as ``(name, tensor)`` lists on ``device`` (a tensor sent under several names
    comes once, under each of them)."""
    while True:
        received: list[list[_Entry] | None] = [None]
        dist.broadcast_object_list(received, src=src, group=group)
        entries = received[0]
        if entries is None:
            return
        bucket = []
        for names, shape, dtype in entries:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, src=src, group=group)
            bucket += [(name, tensor) for name in names]
        yield bucket


def load_weights(module: nn.Module, weights: Pairs) -> list[str]:
    """Copy named full tensors into ``module``'s parameters and persistent buffers (by
    state-dict name), in place, cast to their dtypes: what an engine's weight loader
    does (vLLM's ``model.load_weights``), for a plain module such as a Hugging Face
    model. A tied parameter takes either of its names.

    Returns:
        The names loaded, in order.

    Raises:
        KeyError: a name the module has no tensor for (nothing after it is loaded).
        ValueError: a shape that differs from the module's.
    """
    targets = {**dict(module.named_parameters(remove_duplicate=False)), **_buffers(module)}
    loaded = []
    with torch.no_grad():
        for name, tensor in weights:
            target = targets.get(name)
            if target is None:
                raise KeyError(
                    f"load_weights: {type(module).__name__} has no parameter or persistent "
                    f"buffer {name!r} (check the stream's name_map)"
                )
            if target.shape != tensor.shape:
                raise ValueError(
                    f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the module's "
                    f"{tuple(target.shape)}"
                )
            target.copy_(tensor)
            loaded.append(name)
    return loaded


def _buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, submodule in module.named_modules(remove_duplicate=False):
        for key, buffer in submodule._buffers.items():
            if buffer is not None and key not in submodule._non_persistent_buffers_set:
                out[f"{prefix}.{key}" if prefix else key] = buffer
    return out
