"""A sharded parameter's full tensor for init code (`init_unsharded`): build it
(empty, or all-gathered from the shards), register it in the parameter's slots, and
keep this rank's chunk of what init code wrote into it.

Off the training path: `FSDPParam` (param.py) owns the parameter's runtime life.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime.collectives import _all_gather_single
from ..runtime.param import FSDPParam


def init_device(fsdp_param: FSDPParam) -> torch.device:
    """Where ``init_unsharded`` puts this parameter's full tensor: the compute device,
    also under CPU offload, so that init code draws from the generator the unsharded
    model's eager init draws from there (the CPU's gives other values than a GPU's);
    the write-back copies this rank's chunk to the offloaded shard."""
    return fsdp_param.compute_device


def full_for_init(fsdp_param: FSDPParam, gathered: bool) -> torch.Tensor:
    """A plain full tensor of this parameter in its original dtype, for init code:
    uninitialized, or with ``gathered`` all-gathered from every rank's shard (a
    collective over the shard group that every rank must join)."""
    if not gathered:
        return torch.empty(fsdp_param.shape, dtype=fsdp_param.dtype, device=init_device(fsdp_param))
    geometry = fsdp_param.geometry
    # Copies only under CPU offload: the collective runs on the mesh's device.
    shard = fsdp_param._padded_shard.to(init_device(fsdp_param))  # (*padded_local_shape)
    rows = shard.new_empty((geometry.world_size, *geometry.padded_local_shape))
    # 1-D on both sides: gloo checks the shapes.
    _all_gather_single(rows.view(-1), shard.reshape(-1), group=fsdp_param.mesh_info.shard_group)
    if geometry.dim == 0:  # W padded chunks back to back: the first rows are it
        full = rows.view(geometry.padded_unsharded_shape)[: fsdp_param.shape[0]]  # (*shape)
    else:  # (*shape[:dim], W, shape[dim] / W, ...) -> (*shape): concat along dim
        full = rows.movedim(0, geometry.dim).reshape(fsdp_param.shape)
    return full


def register_full_for_init(fsdp_param: FSDPParam) -> nn.Parameter:
    """Register a temporary full parameter in the original dtype, for init code to
    fill exactly as it would fill the unsharded model (the eager path of
    ``init_unsharded``, for tensor-parallel and all-gather-extension params)."""
    full = full_for_init(fsdp_param, gathered=False)
    param = nn.Parameter(fsdp_param._as_unsharded(full), requires_grad=fsdp_param.requires_grad)
    fsdp_param._register(param)
    return param


def register_for_init(fsdp_param: FSDPParam, param: nn.Parameter | None) -> None:
    """Register ``param`` (``init_unsharded``'s lazy full parameter) in every slot,
    or, with None, the sharded param again."""
    fsdp_param._register(fsdp_param.sharded_param if param is None else param)


def write_back_from_init(fsdp_param: FSDPParam, full: torch.Tensor) -> None:
    """Keep this rank's chunk of the initialized full parameter (a plain tensor or,
    for TP, a DTensor) in the sharded param."""
    data = full.to_local() if isinstance(full, DTensor) else full
    with torch.no_grad():
        fsdp_param._sharded_local.copy_(fsdp_param.geometry.local_chunk(data.detach()))
