"""One source's full tensor: issued asynchronously (`start_gather`), finished later
(`GatherInFlight.finish`), so that a bucket's gathers run while the consumer reads the
bucket before it.

An FSDP parameter is gathered from its padded shard in the group's sharded buffer, read
in place ([Note: sharded buffer] in runtime/all_gather_layout.py), over its group's
shard process group, into a tensor that becomes the full one without a copy (Shard(0)).
Then, for a parameter that is a DTensor on another mesh as well (tensor or expert
parallel), DTensor gathers the rest (``full_tensor()`` of the unsharded param). On gloo
the gather is one broadcast per rank straight into the output's rows: gloo's
``all_gather_into_tensor`` stages through a temporary as large as its output and runs
about 3x slower than the broadcasts on this machine (``bench_weight_sync.py`` measures
both); other backends (NCCL) use ``all_gather_into_tensor``.

Anything else (a parameter dtensor_fsdp does not manage, a buffer, an all-gather
extension's subclass, a parameter replaced since its group's last all-gather) is
``full_tensor()`` or the tensor itself, cast.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..runtime.mesh import backend_for
from ..runtime.shard_geometry import contiguous_stride, wrap_local
from .sources import Source


@dataclass
class GatherInFlight:
    """One source's gather: its output and the collectives still writing into it."""

    source: Source
    # (W, *padded_local_shape): the shard group's padded shards, when ``is_rows``;
    # else the full tensor already.
    output: torch.Tensor
    works: list[dist.Work]
    is_rows: bool

    def finish(self) -> torch.Tensor:
        """Wait, and return the full tensor (the global shape)."""
        for work in self.works:
            work.wait()
        if not self.is_rows:
            return self.output
        fsdp_param = self.source.fsdp_param
        assert fsdp_param is not None
        geometry = fsdp_param.geometry
        rows = self.output  # (W, *padded_local_shape)
        if geometry.dim == 0:
            # W padded chunks back to back are the padded full tensor: a view.
            full = rows.view(geometry.padded_unsharded_shape)[: fsdp_param.shape[0]]
        else:  # (*shape[:dim], W, shape[dim] / W, ...): concatenated along dim, a copy
            full = rows.movedim(0, geometry.dim).flatten(geometry.dim, geometry.dim + 1)
        layout = fsdp_param.layout
        if layout.unsharded_mesh is None:
            return full
        # Tensor or expert parallel: ``full`` is this rank's local tensor of the
        # unsharded param (a DTensor on its TP/EP mesh); DTensor gathers the rest.
        unsharded = wrap_local(
            full.contiguous(),
            layout.unsharded_mesh,
            layout.unsharded_placements,
            fsdp_param.global_shape,
            contiguous_stride(fsdp_param.global_shape),
        )
        return unsharded.full_tensor()


def start_gather(source: Source, dtype: torch.dtype) -> GatherInFlight:
    """Issue the gather of ``source`` as ``dtype`` (cast before the collective: the
    cast of the full tensor, bitwise)."""
    fsdp_param = source.fsdp_param
    if not _reads_sharded_buffer(source):
        value = source.value.full_tensor() if isinstance(source.value, DTensor) else source.value
        return GatherInFlight(source, value.detach().to(dtype), [], is_rows=False)
    assert fsdp_param is not None and source.group is not None
    shard = source.group.all_gather_layout.padded_shards[fsdp_param]  # (*padded_local_shape)
    mesh_info = fsdp_param.mesh_info
    world_size, rank = mesh_info.shard_size, mesh_info.shard_rank
    device = mesh_info.device
    rows = torch.empty((world_size, *shard.shape), dtype=dtype, device=device)
    if world_size == 1:
        rows[0].copy_(shard)
        return GatherInFlight(source, rows, [], is_rows=True)
    group = mesh_info.shard_group
    if _is_gloo(group, device):
        rows[rank].copy_(shard)  # cast, and to the device under CPU offload
        works = [
            dist.broadcast(rows[src], group=group, group_src=src, async_op=True)
            for src in range(world_size)
        ]
    else:
        local = shard.to(device=device, dtype=dtype)
        works = [dist.all_gather_into_tensor(rows, local, group=group, async_op=True)]
    return GatherInFlight(source, rows, [w for w in works if w is not None], is_rows=True)


def _reads_sharded_buffer(source: Source) -> bool:
    """Whether ``source`` is gathered from its group's sharded buffer: an FSDP param
    without all-gather extension whose local tensor is still its buffer segment."""
    fsdp_param = source.fsdp_param
    return fsdp_param is not None and fsdp_param.extension is None and fsdp_param.is_current()


def _is_gloo(group: dist.ProcessGroup, device: torch.device) -> bool:
    backend = backend_for(group, device)
    return dist.is_gloo_available() and isinstance(backend, dist.ProcessGroupGloo)
