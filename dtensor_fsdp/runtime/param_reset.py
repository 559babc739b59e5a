"""Re-deriving a sharded parameter after user code replaced it: checking and
adopting a Parameter registered in its place, and moving a replaced local tensor into
the group's new sharded buffer (see [Note: re-deriving the sharded state] in
group_layout.py); moving a sharded parameter onto a copy of its shard on another device
(a phase offload); at lazy init, refusing parameters never materialized.

Off the per-step path (it runs only after user code changed a parameter): `FSDPParam`
(param.py) owns the parameter's runtime life.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .extension import AllGatherExtension, has_all_gather_extension
from .param import FSDPParam, mp_dtypes


def rederive_sharded_buffer(
    fsdp_params: list[FSDPParam], device: torch.device, pin: bool
) -> torch.Tensor:
    """A new sharded buffer on ``device`` for the local tensors that replaced the
    params' (in place of the group's ``fsdp_params``, sorted in place into the
    buffer's order: see [Note: sharded buffer] (all_gather_layout.py)), re-deriving
    each parameter (`reset_sharded_param`). Returns the buffer (1-D uint8)."""
    fsdp_params.sort(key=lambda p: -p.registered_local().dtype.itemsize)
    sizes = [reset_buffer_nbytes(p) for p in fsdp_params]
    sharded_buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device, pin_memory=pin)
    for fsdp_param, segment in zip(fsdp_params, sharded_buffer.split(sizes), strict=True):
        reset_sharded_param(fsdp_param, segment)
    return sharded_buffer


def reset_sharded_param(fsdp_param: FSDPParam, segment: torch.Tensor) -> None:
    """Re-derive this parameter from what replaced its local tensor (see `is_current`):
    take its dtype (and the policy's dtypes for it), copy its values into
    ``segment`` of the group's new sharded buffer and make that the local tensor.

    Args:
        segment: 1-D uint8 of `reset_buffer_nbytes` bytes, on the device of the
            replaced local tensor.
    """
    local = fsdp_param.registered_local()  # (*local_shape), the new dtype and device
    fsdp_param.dtype = local.dtype
    fsdp_param.param_dtype, fsdp_param.reduce_dtype = mp_dtypes(
        fsdp_param.mp_policy, fsdp_param.dtype
    )
    fsdp_param._sharding_spec = fsdp_param._init_sharding_spec()
    fsdp_param.extension = (
        AllGatherExtension(fsdp_param.fqn, fsdp_param.slots[0].module, fsdp_param.shape)
        if has_all_gather_extension(local)
        else None
    )
    with torch.no_grad():
        if fsdp_param.extension is not None:
            # A subclass is padded on its own, as in `_init_sharded_subclass`.
            fsdp_param._padded_shard = local.new_zeros(fsdp_param.geometry.padded_local_shape)
            if segment.is_pinned():
                fsdp_param._padded_shard = fsdp_param._padded_shard.pin_memory()
        else:
            fsdp_param._padded_shard = fsdp_param.padded_shard_view(segment)
            fsdp_param._padded_shard.zero_()
        view = fsdp_param._padded_shard[: fsdp_param.geometry.local_shape[0]]  # (*local_shape)
        view.copy_(local)
    # The same Parameter and DTensor objects, so optimizers, hooks and .grad built on
    # them stay valid; only the storage behind the local tensor changes (same dtype,
    # shape and device). torch's FSDP2 swaps the local tensor the same way.
    fsdp_param.sharded_param._local_tensor = view
    fsdp_param._sharded_local = view
    fsdp_param._init_unsharded_param()


def move_sharded_param(fsdp_param: FSDPParam, segment: torch.Tensor) -> None:
    """Make ``segment`` this parameter's storage: 1-D uint8 of `sharded_buffer_nbytes`
    that already holds a copy of its padded shard, on any device (pinned host memory
    for a phase offload, the device again after it: post_training/offload.py).

    The sharded param stays the same Parameter object (optimizers and hooks keep it),
    now a DTensor over ``segment`` on ``segment``'s device. A DTensor's device is fixed
    when it is made, so its local tensor cannot just be replaced as in
    `reset_sharded_param`: the param is swapped with a new one (``swap_tensors``, as
    ``nn.Module._apply`` moves a DTensor parameter), keeping its Python attributes. Its
    grad must have been taken off first: a grad lives on its parameter's device.
    """
    param = fsdp_param.sharded_param
    assert param.grad is None, f"{fsdp_param.fqn}: take the grad off before moving the param"
    padded = fsdp_param.padded_shard_view(segment)  # (*padded_local_shape)
    local = padded[: fsdp_param.geometry.local_shape[0]]  # (*local_shape)
    moved = nn.Parameter(fsdp_param._sharded_dtensor(local), requires_grad=param.requires_grad)
    moved.__dict__.update(param.__dict__)  # swap_tensors swaps the attribute dicts too
    torch.utils.swap_tensors(param, moved)
    fsdp_param._padded_shard = padded
    fsdp_param._sharded_local = local


def check_replacement(fsdp_param: FSDPParam, owners: dict[int, FSDPParam]) -> None:
    """Raise unless the object that replaced the sharded param (`is_replaced`) can
    become it: an ``nn.Parameter`` wrapping a contiguous DTensor with the sharded
    param's mesh, placements, global shape and local shape, that is no other FSDP
    parameter's (``owners``: sharded param id -> FSDPParam, of every group known).

    Raises:
        ValueError: naming the parameter, what replaced it and the fix.
    """
    new = fsdp_param._registered()
    owner = owners.get(id(new))
    if owner is not None and owner is not fsdp_param:
        # torch's FSDP2 accepts this and all-gathers the tied values twice, with a
        # wrong result when the shard is padded; one FSDPParam per tie is not built.
        raise ValueError(
            f"FSDP parameter '{fsdp_param.fqn}' was replaced after fully_shard by the sharded "
            f"parameter '{owner.fqn}' (a tie made after fully_shard). Tie parameters "
            "before fully_shard, and put the tied modules in one FSDP group "
            "(fully_shard([module_a, module_b]) or their common ancestor): FSDP then "
            "shards one parameter registered in both places"
        )
    layout = (
        f"global shape {tuple(fsdp_param.global_shape)}, local shape "
        f"{tuple(fsdp_param._sharded_local.shape)}, placements {fsdp_param.layout.placements} on "
        f"{fsdp_param.layout.mesh}"
    )
    if not (isinstance(new, nn.Parameter) and isinstance(new, DTensor)):
        what = f"a {type(new).__name__}, not an nn.Parameter wrapping a DTensor"
    elif (
        new.device_mesh == fsdp_param.layout.mesh
        and tuple(new.placements) == fsdp_param.layout.placements
        and new.shape == fsdp_param.global_shape
        and new._local_tensor.shape == fsdp_param._sharded_local.shape
        and new.is_contiguous()
    ):
        return
    else:
        what = (
            f"a DTensor of global shape {tuple(new.shape)}, local shape "
            f"{tuple(new._local_tensor.shape)}, placements {tuple(new.placements)} on "
            f"{new.device_mesh}" + ("" if new.is_contiguous() else ", not contiguous")
        )
    raise ValueError(
        f"FSDP parameter '{fsdp_param.fqn}' was replaced after fully_shard by {what}. FSDP "
        "adopts a replacing parameter if it is an nn.Parameter wrapping a contiguous "
        f"DTensor laid out as the one it replaces ({layout}), e.g. computed from other "
        "sharded parameters or made with distribute_tensor(full, mesh, placements); or "
        "copy the new values into the registered parameter in place"
    )


def check_materialized(fsdp_params: list[FSDPParam], offload: bool) -> None:
    """At lazy init, after the group re-derived what it could: refuse to train on
    params still on meta, or (CPU offload) materialized elsewhere than on the CPU, with
    torch's types and wording.

    Raises:
        RuntimeError: naming the parameters and the fix.
    """
    on_meta = [p.fqn for p in fsdp_params if p.registered_local().is_meta]
    if on_meta:
        raise RuntimeError(
            "FSDP parameters should be materialized from meta device before training, "
            f"but the following were still on meta device: {on_meta}. Call "
            "module.to_empty(device=...) on the root, then initialize the values (e.g. "
            "inside dtensor_fsdp.init_unsharded(model), or reset_parameters())"
        )
    not_on_cpu = [
        (p.fqn, p.registered_local().device)
        for p in fsdp_params
        if offload and p.registered_local().device.type != "cpu"
    ]
    if not_on_cpu:
        raise RuntimeError(
            "FSDP parameters should be materialized on CPU when enabling CPU offloading. "
            'For example, load a CPU state dict or call module.to_empty(device="cpu"). '
            f"Found following parameters on non-CPU device: {not_on_cpu}"
        )


def adopt_replacement(fsdp_param: FSDPParam) -> None:
    """Make the object that replaced the sharded param (checked by
    `check_replacement`) the sharded param, registered in every slot, as torch's
    FSDP2 does: the user's Parameter is then what the optimizer steps and
    ``state_dict`` returns. Its local tensor is not in the group's sharded buffer
    yet: `is_current` is False until the group re-derives it
    (`FSDPParamGroup.reset_sharded_params`)."""
    new = fsdp_param._registered()
    assert isinstance(new, nn.Parameter), f"{fsdp_param.fqn}: adopting an unchecked replacement"
    fsdp_param.sharded_param = new
    fsdp_param._register(new)


def reset_buffer_nbytes(fsdp_param: FSDPParam) -> int:
    """`sharded_buffer_nbytes` for the local tensor that replaced this one."""
    local = fsdp_param.registered_local()
    if has_all_gather_extension(local):
        return 0
    return fsdp_param.padded_shard_numel * local.dtype.itemsize
