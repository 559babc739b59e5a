"""MeshInfo: which mesh axis FSDP shards over, and the process group behind it."""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel view of a ``DeviceMesh``.

    A 1-D mesh shards over its only axis (FSDP). The shard axis is always the last data
    parallel axis; ``replicate_axis`` is set only for hybrid sharding (HSDP).
    """

    mesh: DeviceMesh
    shard_axis: int
    replicate_axis: int | None = None

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_axis)

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_axis)

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_axis)

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_axis is not None

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        assert self.replicate_axis is not None
        return self.mesh.get_group(self.replicate_axis)

    @property
    def replicate_size(self) -> int:
        return 1 if self.replicate_axis is None else self.mesh.size(self.replicate_axis)

    @property
    def placements(self) -> tuple[Placement, ...]:
        """The sharded params' placements: ``(Shard(0),)``, or for HSDP
        ``(Replicate(), Shard(0))``."""
        if self.replicate_axis is None:
            return (Shard(0),)
        return (Replicate(), Shard(0))

    @property
    def device(self) -> torch.device:
        return mesh_device(self.mesh)


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over the whole default process group, on the backend's natural device."""
    if not dist.is_initialized():
        raise ValueError(
            "fully_shard(mesh=None) needs an initialized default process group: call "
            "torch.distributed.init_process_group() first (torchrun sets up its environment)"
        )
    backend = dist.get_backend()
    device_type = "cpu" if backend == "gloo" else _accelerator_type()
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Build the MeshInfo of the mesh given to ``fully_shard``, or say why it cannot be used."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return MeshInfo(mesh=mesh, shard_axis=0)
    if mesh.ndim == 2:
        # HSDP: replicate over axis 0 (across nodes), shard over axis 1 (within a node).
        return MeshInfo(mesh=mesh, shard_axis=1, replicate_axis=0)
    raise ValueError(
        f"fully_shard got a {mesh.ndim}-D mesh {mesh}: pass a 1-D mesh (FSDP) or a 2-D "
        "(replicate, shard) mesh (HSDP); for tensor parallelism pass the data-parallel "
        "sub-mesh, e.g. mesh['dp'] or mesh['replicate', 'shard']"
    )


def validate_post_forward_size(mesh_info: MeshInfo, size: int) -> None:
    """``reshard_after_forward=size`` must divide the shard world size."""
    world_size = mesh_info.shard_size
    if size < 1 or world_size % size != 0:
        raise ValueError(
            f"reshard_after_forward={size} must be a divisor of the shard world size "
            f"{world_size} (e.g. the number of ranks per node), or a bool"
        )


def post_forward_mesh_info(mesh_info: MeshInfo, size: int) -> MeshInfo:
    """The mesh of ``size``-rank blocks of consecutive shard ranks that hpZ reshards to
    after forward: rank r keeps its block's slice r % size of the unsharded params.

    Creates process groups, so every rank must call it, in the same order.
    """
    assert 1 < size < mesh_info.shard_size
    # (..., W / size, size): the last axis groups consecutive shard ranks; for HSDP the
    # replicate axis stays in front and is not used after forward.
    ranks = mesh_info.mesh.mesh.reshape(*mesh_info.mesh.mesh.shape[:-1], -1, size)
    mesh = DeviceMesh(mesh_info.mesh.device_type, ranks.flatten(0, -2))
    return MeshInfo(mesh=mesh, shard_axis=1)


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device of this rank's tensors: the mesh's device type, on the current index."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    device_module = getattr(torch, mesh.device_type, None)
    if device_module is None or not hasattr(device_module, "current_device"):
        raise ValueError(f"mesh device type {mesh.device_type!r} has no torch device module")
    return torch.device(mesh.device_type, device_module.current_device())


def _accelerator_type() -> str:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"
