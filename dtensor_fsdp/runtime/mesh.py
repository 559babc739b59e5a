"""MeshInfo: which mesh axis FSDP shards over, and the process group behind it; and
SpmdLayout: the mesh and placements of one parameter, tensor-parallel ones included."""

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..api import DataParallelMeshDims


@dataclass(frozen=True)
class MeshInfo:
    """The data-parallel view of a ``DeviceMesh``.

    A 1-D mesh shards over its only axis (FSDP). The shard axis is always the last data
    parallel axis; ``replicate_axis`` is set only for hybrid sharding (HSDP).
    """

    mesh: DeviceMesh
    shard_axis: int
    replicate_axis: int | None = None
    # dp_mesh_dims: the full SPMD mesh the parameters live on, and the axes of it that
    # are data parallel (shard axis first). None: the mesh above is all there is.
    spmd_mesh: DeviceMesh | None = None
    spmd_dp_axes: tuple[int, ...] = ()

    # Sizes and ranks are read per parameter at every step; a mesh's never change, so
    # they are computed once (``DeviceMesh.size`` and ``get_local_rank`` are Python).
    # The process group is not cached: it stays out of copies and pickles of this.

    @property
    def shard_group(self) -> dist.ProcessGroup:
        return self.mesh.get_group(self.shard_axis)

    @functools.cached_property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_axis)

    @functools.cached_property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_axis)

    @functools.cached_property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard axis (what torch hands ``fsdp_pre_all_gather``);
        built once, as subclasses may key caches on it."""
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        if names is not None:
            return self.mesh[names[self.shard_axis]]
        return DeviceMesh.from_group(self.shard_group, self.mesh.device_type)

    @property
    def label(self) -> str:
        """The data-parallel axes' names (``pg=<size>`` if unnamed), replicate axis
        first, for messages and traces."""
        names = self.mesh.mesh_dim_names
        axes = (self.replicate_axis, self.shard_axis) if self.is_hsdp else (self.shard_axis,)
        return ",".join(
            names[axis] if names is not None else f"pg={self.mesh.size(axis)}"
            for axis in axes
            if axis is not None
        )

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_axis is not None

    @property
    def replicate_group(self) -> dist.ProcessGroup:
        assert self.replicate_axis is not None
        return self.mesh.get_group(self.replicate_axis)

    @functools.cached_property
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
    """A 1-D mesh over the whole default process group: on the accelerator, as in torch,
    if the group has a backend for it (``"cpu:gloo"`` has none for CUDA), else the CPU.
    Like torch's ``fully_shard(mesh=None)``, it initializes the default process group
    (``env://``, as torchrun sets up) if nothing has yet."""
    if not dist.is_initialized():
        dist.init_process_group()
    device_type = _accelerator_type()
    if device_type != "cpu" and backend_for(dist.group.WORLD, torch.device(device_type)) is None:
        device_type = "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def mesh_info_for(mesh: DeviceMesh) -> MeshInfo:
    """Build the MeshInfo of the mesh given to ``fully_shard``, or say why it cannot be used."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects mesh to be a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return MeshInfo(mesh=mesh, shard_axis=0)
    if mesh.ndim == 2:
        if mesh.mesh_dim_names is None:
            raise UnnamedMeshError(
                "Please init the 2D mesh for HSDP with mesh_dim_names specified: got "
                f"{mesh}. Name its axes, e.g. init_device_mesh(device, (replicas, shards), "
                "mesh_dim_names=('replicate', 'shard'))"
            )
        # HSDP: replicate over axis 0 (across nodes), shard over axis 1 (within a node).
        return MeshInfo(mesh=mesh, shard_axis=1, replicate_axis=0)
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim}-D): pass "
        "a 1-D mesh (FSDP) or a 2-D (replicate, shard) mesh (HSDP); for tensor "
        "parallelism pass the data-parallel sub-mesh, e.g. mesh['dp'] or "
        "mesh['replicate', 'shard'], or the full mesh with dp_mesh_dims"
    )


class UnnamedMeshError(ValueError, AssertionError):
    """A 2-D mesh without ``mesh_dim_names``. A ValueError (a user mistake), and an
    AssertionError because that is what torch's fully_shard raises for it."""


def same_process_groups(
    mesh_info: MeshInfo, mesh: object, shard_axis: object, replicate_axis: object
) -> bool | None:
    """Whether ``mesh``'s ``shard_axis`` (and ``replicate_axis``, None for none) are the
    process groups ``mesh_info`` shards (and replicates) over, as torch's FSDP2 groups
    parameters; None if the arguments do not describe a data-parallel mesh."""
    if not isinstance(mesh, DeviceMesh) or not isinstance(shard_axis, int):
        return None
    if replicate_axis is not None and not isinstance(replicate_axis, int):
        return None
    replicate = None if replicate_axis is None else mesh.get_group(replicate_axis)
    ours = mesh_info.replicate_group if mesh_info.is_hsdp else None
    return mesh.get_group(shard_axis) is mesh_info.shard_group and replicate is ours


@dataclass(frozen=True)
class SpmdLayout:
    """Where one parameter's DTensors live.

    ``mesh``/``placements`` describe the sharded param: the data-parallel mesh for a
    plain parameter; for a tensor-parallel one (a DTensor on a TP mesh), the data
    parallel and the TP mesh concatenated (their axes side by side, as torch's FSDP2
    builds it), with FSDP's shard placement in front of the TP placements.
    ``unsharded_mesh``/``unsharded_placements`` describe the unsharded param, which for
    a DTensor param is again the original DTensor; ``unsharded_dp_axes`` are its data
    parallel axes (``dp_mesh_dims`` only), on which gradients are left as they are for
    the reduce-scatter to combine.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    unsharded_mesh: DeviceMesh | None = None
    unsharded_placements: tuple[Placement, ...] | None = None
    unsharded_dp_axes: frozenset[int] = frozenset()


def spmd_mesh_info(mesh: DeviceMesh, dp_mesh_dims: DataParallelMeshDims) -> MeshInfo:
    """MeshInfo for ``fully_shard(mesh=full_mesh, dp_mesh_dims=...)``: shard (and for
    HSDP replicate) over the named axes of the full SPMD mesh."""
    if not isinstance(dp_mesh_dims, DataParallelMeshDims):
        if not (hasattr(dp_mesh_dims, "shard") and hasattr(dp_mesh_dims, "replicate")):
            raise TypeError(
                f"dp_mesh_dims must be a DataParallelMeshDims, got {type(dp_mesh_dims).__name__}"
            )
        # torch's own DataParallelMeshDims (a user switching one import line keeps it).
        dp_mesh_dims = DataParallelMeshDims(dp_mesh_dims.shard, dp_mesh_dims.replicate)
    names = mesh.mesh_dim_names
    shard, replicate = (
        _one_name(dp_mesh_dims.shard, "shard"),
        _one_name(dp_mesh_dims.replicate, "replicate"),
    )
    if shard is None:
        raise NotImplementedError(
            "dp_mesh_dims without a shard axis (pure replication, DDP) is not supported"
        )
    missing = [n for n in (shard, replicate) if n is not None and n not in (names or ())]
    if missing:
        raise ValueError(
            f"dp_mesh_dims names {missing}, which mesh {mesh} (dims {names}) does not have"
        )
    assert names is not None
    dp_names = (shard,) if replicate is None else (replicate, shard)
    dp_info = mesh_info_for(mesh[dp_names])
    return MeshInfo(
        mesh=dp_info.mesh,
        shard_axis=dp_info.shard_axis,
        replicate_axis=dp_info.replicate_axis,
        spmd_mesh=mesh,
        spmd_dp_axes=tuple(names.index(n) for n in (shard, replicate) if n is not None),
    )


def _one_name(names: str | tuple[str, ...] | None, role: str) -> str | None:
    if names is None or isinstance(names, str):
        return names
    if len(names) == 1:
        return names[0]
    raise NotImplementedError(
        f"dp_mesh_dims.{role}={names}: flattening several mesh axes into one {role} axis is "
        "not supported; name one axis (flatten the mesh yourself)"
    )


def _spmd_dims_layout(
    mesh_info: MeshInfo, param: torch.Tensor, fqn: str, shard_dim: int
) -> SpmdLayout:
    """dp_mesh_dims: ``param`` is a DTensor on the full mesh, Replicate on the DP axes."""
    spmd_mesh = mesh_info.spmd_mesh
    if not isinstance(param, DTensor) or param.device_mesh != spmd_mesh:
        where = (
            f"a DTensor on {param.device_mesh}" if isinstance(param, DTensor) else "a plain tensor"
        )
        raise ValueError(
            f"parameter '{fqn}' is {where}; with dp_mesh_dims every parameter must be a DTensor "
            f"on the mesh passed to fully_shard ({spmd_mesh}), e.g. via distribute_module"
        )
    placements = list(param.placements)
    for axis in mesh_info.spmd_dp_axes:
        if not isinstance(placements[axis], Replicate):
            raise ValueError(
                f"parameter '{fqn}' has {placements[axis]} on data-parallel mesh axis "
                f"{axis}; expected Replicate() there (was it sharded by fully_shard already?)"
            )
    shard_axis = mesh_info.spmd_dp_axes[0]
    # The DP chunks interleave with any shards of the same dim on axes to the right.
    split_factor = math.prod(
        spmd_mesh.size(axis)
        for axis in range(shard_axis + 1, spmd_mesh.ndim)
        if isinstance(placements[axis], Shard) and placements[axis].dim == shard_dim
    )
    placements[shard_axis] = (
        _StridedShard(shard_dim, split_factor=split_factor)
        if split_factor > 1
        else Shard(shard_dim)
    )
    return SpmdLayout(
        spmd_mesh,
        tuple(placements),
        spmd_mesh,
        tuple(param.placements),
        frozenset(mesh_info.spmd_dp_axes),
    )


class MeshMismatchError(ValueError, RuntimeError):
    """A TP param's mesh cannot be combined with the data-parallel mesh. A ValueError
    (a user mistake), and a RuntimeError because that is what torch's fully_shard
    raises for it (``DeviceMesh._concatenate``)."""


def _concatenate(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """The mesh with ``dp_mesh``'s axes, then ``tp_mesh``'s, as torch's FSDP2 joins them.

    Both must be views of one world (same ranks, in the same order) on disjoint axes.
    """
    # Private API, as in torch's own _fsdp_param.py; torch 2.11-2.14 all have it.
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:
        return _root_with_tp_part(dp_mesh, tp_mesh, fqn)
    try:
        return concatenate([dp_mesh, tp_mesh])
    except RuntimeError as error:
        raise MeshMismatchError(
            f"parameter '{fqn}' is a DTensor on {tp_mesh}, which cannot be combined with the "
            f"data-parallel mesh {dp_mesh} ({error}). Build both from one mesh: e.g. "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')) and pass "
            "mesh['tp'] to parallelize_module and mesh['dp'] to fully_shard, or unflatten "
            "one world mesh into views whose data-parallel and TP axes do not overlap"
        ) from None


def _root_with_tp_part(dp_mesh: DeviceMesh, tp_mesh: DeviceMesh, fqn: str) -> DeviceMesh:
    """Without ``DeviceMesh._concatenate``: the data-parallel mesh's root, if its axes
    are the data-parallel ones then ``tp_mesh``'s."""
    root = dp_mesh._get_root_mesh()
    tp_names = tuple(tp_mesh.mesh_dim_names or ())
    expected_names = tuple(dp_mesh.mesh_dim_names or ()) + tp_names
    if root.mesh_dim_names != expected_names or root[tp_names] != tp_mesh:
        raise MeshMismatchError(
            f"parameter '{fqn}' is a DTensor on {tp_mesh}, which is not the tensor-parallel "
            f"part of the data-parallel mesh's root mesh (expected dims {expected_names}). "
            "Build one mesh, e.g. init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', "
            "'tp')), parallelize the model on mesh['tp'] and pass mesh['dp'] to fully_shard"
        )
    return root


def spmd_layout(mesh_info: MeshInfo, param: torch.Tensor, fqn: str, shard_dim: int) -> SpmdLayout:
    """The layout of ``param`` under FSDP on ``mesh_info``, sharded on ``shard_dim`` (of
    the TP-local tensor for a TP param), or a ValueError naming ``fqn``.

    A TP param's mesh may be any mesh that torch can concatenate with the data-parallel
    one: a sub-mesh of the same root (``init_device_mesh((dp, tp))``), or of another
    view of the same world (``world._unflatten``, as torchtitan builds them).
    """
    if mesh_info.spmd_mesh is not None:
        return _spmd_dims_layout(mesh_info, param, fqn, shard_dim)
    dp_placements = (*mesh_info.placements[:-1], Shard(shard_dim))
    if not isinstance(param, DTensor):
        return SpmdLayout(mesh_info.mesh, dp_placements)
    tp_mesh, unsharded_placements = param.device_mesh, tuple(param.placements)
    dp_mesh = mesh_info.mesh
    if tp_mesh == dp_mesh or set(dp_mesh.mesh_dim_names or ()) & set(tp_mesh.mesh_dim_names or ()):
        raise MeshMismatchError(
            f"parameter '{fqn}' is already a DTensor on the data-parallel mesh {dp_mesh} "
            "(Cannot concatenate overlapping meshes). Either an earlier fully_shard call "
            "sharded it: a parameter shared between modules must be in one group, so call "
            "fully_shard on their common ancestor, or fully_shard([module_a, module_b]); or "
            "the mesh passed to fully_shard is its tensor-parallel one: pass the data "
            "parallel mesh"
        )
    mesh = _concatenate(dp_mesh, tp_mesh, fqn)
    if not all(isinstance(p, (Shard, Replicate)) for p in unsharded_placements):
        raise ValueError(
            f"parameter '{fqn}' has placements {unsharded_placements}; fully_shard composes with "
            "Shard and Replicate tensor-parallel placements only"
        )
    # FSDP shards the TP-local tensor. If TP also shards that dim, the data parallel
    # chunks interleave with the TP ones: a strided shard, as torch does.
    split_factor = math.prod(
        tp_mesh.size(axis)
        for axis, p in enumerate(unsharded_placements)
        if isinstance(p, Shard) and p.dim == shard_dim
    )
    if split_factor > 1:
        dp_placements = (*dp_placements[:-1], _StridedShard(shard_dim, split_factor=split_factor))
    placements = (*dp_placements, *unsharded_placements)
    return SpmdLayout(mesh, placements, tp_mesh, unsharded_placements)


def validate_post_forward_size(mesh_info: MeshInfo, size: int) -> None:
    """``reshard_after_forward=size`` must divide the shard world size."""
    world_size = mesh_info.shard_size
    if size < 1 or world_size % size != 0:
        raise ValueError(
            f"reshard_after_forward={size} must be a divisor of the shard world size "
            f"{world_size} (e.g. the number of ranks per node), or a bool: if passing "
            f"reshard_after_forward as an int, it should be a factor of {world_size}, "
            f"not {size}"
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


def backend_for(group: dist.ProcessGroup, device: torch.device) -> object | None:
    """The backend object (e.g. ``ProcessGroupGloo``) that runs ``group``'s collectives
    on ``device``'s tensors; ``None`` where the group has none for it or cannot say
    (torch's threaded and fake test groups). ``dist.get_backend`` names the group, not
    the device's backend: ``"undefined"`` or ``"cuda:nccl,cpu:gloo"`` are common."""
    try:
        return group._get_backend(device)
    except (AttributeError, NotImplementedError, RuntimeError):
        return None


def _accelerator_type() -> str:
    accelerator = torch.accelerator.current_accelerator()
    return accelerator.type if accelerator is not None else "cpu"
