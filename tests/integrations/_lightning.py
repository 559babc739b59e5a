"""What the Lightning tests share: the environment that makes Lightning join the
harness's gloo group, the two ``parallelize_fn``s of the shared MLP (written for
torch's names, or calling ours), and a distributed checkpoint's structure for comparing
ours with torch's."""

import os
from pathlib import Path
from typing import Any

import torch.distributed.fsdp as torch_fsdp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

import dtensor_fsdp


def lightning_environment(rank: int, world_size: int) -> None:
    """Lightning's ``LightningEnvironment``: processes created outside it (the harness
    has joined the gloo group already, which Lightning then keeps). Set before every
    ``Trainer``/``Fabric``: a ``Trainer``'s teardown deletes ``WORLD_SIZE``."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))


def checkpoint_structure(path: Path) -> dict[str, Any]:
    """A distributed checkpoint folder's files and, per key of its metadata, the
    global shape and the chunks (offsets, sizes) each rank wrote; "bytes" for
    pickled values (optimizer hyperparameters)."""
    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    entries = {}
    for key, entry in metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = sorted((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            entries[key] = (tuple(entry.size), str(entry.properties.dtype), chunks)
        else:
            entries[key] = "bytes"
    return {"files": sorted(p.name for p in path.iterdir()), "entries": entries}


def parallelize_with_torch_names(model: nn.Module, mesh: Any) -> nn.Module:
    """The user's parallelize_fn, as written for torch: looks fully_shard up at call
    time, so the switch decides whose it is."""
    for block in (model[0], model[2]):
        torch_fsdp.fully_shard(block, mesh=mesh["data_parallel"])
    torch_fsdp.fully_shard(model, mesh=mesh["data_parallel"])
    return model


def parallelize_with_ours(model: nn.Module, mesh: Any) -> nn.Module:
    """The same, calling ours directly (no switch needed for it to shard)."""
    for block in (model[0], model[2]):
        dtensor_fsdp.fully_shard(block, mesh=mesh["data_parallel"])
    dtensor_fsdp.fully_shard(model, mesh=mesh["data_parallel"])
    return model


def launch_fabric(parallelize_fn: Any) -> Any:
    """A launched Fabric on the harness's 2 gloo ranks (CPU), with Lightning's FSDP2
    strategy calling ``parallelize_fn`` (data parallel only)."""
    from lightning.fabric import Fabric  # optional: the tests skip without lightning
    from lightning.fabric.strategies import ModelParallelStrategy

    fabric = Fabric(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(
            parallelize_fn, data_parallel_size=2, tensor_parallel_size=1
        ),
    )
    fabric.launch()
    return fabric
