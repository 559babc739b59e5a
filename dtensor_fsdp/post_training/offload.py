"""Phase offload: a model's sharded parameters, sharded gradients and its optimizer's
state to (pinned) host memory while an inference engine uses the device, and back.

Group by group, in group-sized chunks: a group's sharded buffer is copied whole into
one host buffer, and its gradients and optimizer state each into one host chunk; every
copy is issued without waiting (``non_blocking`` from and into pinned memory), so the
groups' copies queue back to back on the device's copy engine, and the host waits once,
at the end of `offload_states` (the host copies are then complete). The device's memory
goes back to the caching allocator as each group's tensors are replaced: it is reused
only by work queued after the copies.

The parameters stay the same ``Parameter`` objects (the optimizer keeps them), moved by
the group (`FSDPParamGroup.move_sharded_buffer`); the gradients and the optimizer's
state tensors are replaced by DTensors (or tensors) of the same layout over the host
chunks, and back. The values are copied exactly, so training after a round trip is
bitwise training without one.

What stays: groups under ``CPUOffloadPolicy`` (already on the host), state tensors not
on the mesh's device (Adam's ``step`` on the CPU), parameters dtensor_fsdp does not
manage and buffers.
"""

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup, TrainingState
from ..runtime.shard_geometry import wrap_local
from .sources import fsdp_groups


@dataclass
class _Chunk:
    """Tensors copied into one buffer, largest element size first (aligned views)."""

    buffer: torch.Tensor  # 1-D uint8
    views: list[torch.Tensor]  # each a view of ``buffer``, in the order given


@dataclass
class _GroupState:
    """One group's offloaded tensors."""

    group: FSDPParamGroup
    params: torch.Tensor | None  # the host copy of the sharded buffer; None once reloaded
    grads: dict[FSDPParam, torch.Tensor] = field(default_factory=dict)  # moved grads
    states: dict[tuple[FSDPParam, str], torch.Tensor] = field(default_factory=dict)


@dataclass
class OffloadedStates:
    """What `offload_states` moved to the host, for `reload_states`."""

    device: torch.device  # where it goes back
    groups: list[_GroupState]
    optimizer: torch.optim.Optimizer | None
    params_on_host: bool = True
    optimizer_on_host: bool = False


def offload_states(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, pin_memory: bool = True
) -> OffloadedStates:
    """Move ``model``'s sharded parameters and gradients, and ``optimizer``'s state, to
    host memory, group by group; the device keeps none of them.

    Call it between iterations (after the optimizer step, or after backward), on every
    rank (no collective is issued). Until `reload_states` the model may run forwards
    (from the host copy, as under CPU offload: slow), give its state dict or stream its
    weights; not train, and the optimizer may not step.

    Args:
        model: a ``fully_shard`` module (its tree's groups move).
        optimizer: also move its state (the tensors on the device); ``None`` keeps the
            optimizer's state on the device.
        pin_memory: use pinned host memory on an accelerator (asynchronous copies both
            ways), as ``CPUOffloadPolicy(pin_memory=True)``.

    Returns:
        The record `reload_states` takes.

    Raises:
        ValueError: ``model`` has no dtensor_fsdp group; a group is inside a forward
            or backward, or
            holds accumulated, not yet reduced gradients (``set_requires_gradient_sync
            (False)``, HSDP's ``set_requires_all_reduce(False)``). Nothing is moved
            then.
        NotImplementedError: a parameter with an all-gather extension (a tensor
            subclass such as float8), which is not in its group's sharded buffer.
    """
    groups = [g for g in fsdp_groups(model) if g.offload is None]
    _check_movable(model, groups)
    device = groups[0].device if groups else torch.device("cpu")
    pin = pin_memory and device.type not in ("cpu", "meta")
    for group in groups:
        group.reshard()  # frees the unsharded params on the device
    states = [_offload_group(group, pin) for group in groups]
    offloaded = OffloadedStates(device, states, optimizer)
    if optimizer is not None:
        for state in states:
            entries = [
                (fsdp_param, key, value)
                for fsdp_param in state.group.fsdp_params
                for key, value in optimizer.state.get(fsdp_param.sharded_param, {}).items()
                if isinstance(value, torch.Tensor) and value.device.type == device.type
            ]
            state.states = _move_optimizer_state(optimizer, entries, torch.device("cpu"), pin)
        offloaded.optimizer_on_host = True
    _wait_for_copies(device, pin)
    return offloaded


def reload_states(offloaded: OffloadedStates, *, optimizer: bool = True) -> None:
    """Move back what `offload_states` moved, group by group, onto the device it came
    from; the model and the optimizer are then exactly as before the offload.

    Args:
        offloaded: `offload_states`'s record.
        optimizer: also move the optimizer's state back; ``False`` leaves it on the
            host so that forward and backward run without it: call
            ``reload_states(offloaded)`` again before ``optimizer.step()``, which then
            runs on the device.

    Raises:
        RuntimeError: a group's sharded buffer is not the host copy any more (its
            parameters were replaced or moved while offloaded). Nothing is moved then.
    """
    if offloaded.params_on_host:
        for state in offloaded.groups:
            _check_reloadable(state)
        for state in offloaded.groups:
            state.group.reshard()  # a forward may have run from the host copy
            _reload_group(state, offloaded.device)
            state.params = None  # the host copy goes (pinned: once its copy is done)
        offloaded.params_on_host = False
    if optimizer and offloaded.optimizer_on_host and offloaded.optimizer is not None:
        states = offloaded.optimizer.state
        for state in offloaded.groups:
            # What offload_states moved, unless the user replaced it since.
            entries = [
                (fsdp_param, key, value)
                for (fsdp_param, key), value in state.states.items()
                if states.get(fsdp_param.sharded_param, {}).get(key) is value
            ]
            _move_optimizer_state(offloaded.optimizer, entries, offloaded.device, False)
            state.states.clear()
        offloaded.optimizer_on_host = False


def _check_reloadable(state: _GroupState) -> None:
    if state.group.sharded_buffer is not state.params:
        raise RuntimeError(
            f"reload_states: group '{state.group.fqn or 'root'}' no longer holds its "
            "offloaded parameters: they were replaced or moved after offload_states "
            "(model.to(), param.data = ...); nothing was reloaded"
        )


def _check_movable(model: nn.Module, groups: list[FSDPParamGroup]) -> None:
    if not fsdp_groups(model):
        raise ValueError(
            f"offload_states: {type(model).__name__} has no fully_shard group: pass a "
            "module fully_shard was called on (the root, to move the whole model)"
        )
    for group in groups:
        name = group.fqn or "root"
        if group.training_state != TrainingState.IDLE:
            raise ValueError(
                f"offload_states: group '{name}' is inside a forward or backward: "
                "offload between iterations"
            )
        extended = [p.fqn for p in group.fsdp_params if p.extension is not None]
        if extended:
            raise NotImplementedError(
                f"offload_states: {extended} have all-gather extensions (tensor "
                "subclasses), which live outside their group's sharded buffer"
            )
        pending = [
            p.fqn
            for p in group.fsdp_params
            if p.partial_reduced_grad is not None or p.unsharded_grad is not None
        ]
        if pending:
            raise ValueError(
                f"offload_states: {pending} hold accumulated gradients not reduced yet "
                "(set_requires_gradient_sync(False) or set_requires_all_reduce(False)): "
                "offload after the backward that reduces them"
            )


def _offload_group(group: FSDPParamGroup, pin: bool) -> _GroupState:
    params = _host_empty(group.sharded_buffer.numel(), pin)
    params.copy_(group.sharded_buffer, non_blocking=pin)
    with_grads = [p for p in group.fsdp_params if p.sharded_param.grad is not None]
    grads = [p.sharded_param.grad for p in with_grads]
    chunk = _copy_into_chunk([g.to_local() for g in grads], torch.device("cpu"), pin)
    for fsdp_param in with_grads:
        fsdp_param.sharded_param.grad = None  # a grad lives on its param's device
    group.move_sharded_buffer(params)
    moved = {}
    for fsdp_param, grad, view in zip(with_grads, grads, chunk.views, strict=True):
        moved[fsdp_param] = fsdp_param.sharded_param.grad = _like(grad, view)
    return _GroupState(group, params, moved)


def _reload_group(state: _GroupState, device: torch.device) -> None:
    group, params = state.group, state.params
    assert params is not None
    buffer = torch.empty_like(params, device=device)
    buffer.copy_(params, non_blocking=params.is_pinned())
    with_grads = list(state.grads)
    grads = [state.grads[p] for p in with_grads]
    chunk = _copy_into_chunk([g.to_local() for g in grads], device, False)
    for fsdp_param in with_grads:
        fsdp_param.sharded_param.grad = None
    group.move_sharded_buffer(buffer)
    for fsdp_param, grad, view in zip(with_grads, grads, chunk.views, strict=True):
        fsdp_param.sharded_param.grad = _like(grad, view)
    state.grads.clear()


def _move_optimizer_state(
    optimizer: torch.optim.Optimizer,
    entries: list[tuple[FSDPParam, str, torch.Tensor]],
    target: torch.device,
    pin: bool,
) -> dict[tuple[FSDPParam, str], torch.Tensor]:
    """Replace each ``optimizer.state[param][key]`` of ``entries`` by a copy on
    ``target``, all in one chunk; returns the copies by (param, key)."""
    locals_ = [v.to_local() if isinstance(v, DTensor) else v for _, _, v in entries]
    chunk = _copy_into_chunk(locals_, target, pin)
    moved = {}
    for (fsdp_param, key, value), view in zip(entries, chunk.views, strict=True):
        moved[(fsdp_param, key)] = optimizer.state[fsdp_param.sharded_param][key] = _like(
            value, view
        )
    return moved


def _copy_into_chunk(tensors: Iterable[torch.Tensor], device: torch.device, pin: bool) -> _Chunk:
    """One buffer on ``device`` holding a copy of each tensor (copies issued, not
    waited), laid out largest element size first so that each view is aligned."""
    tensors = list(tensors)
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    sizes = [tensors[i].numel() * tensors[i].element_size() for i in order]
    buffer = (
        _host_empty(sum(sizes), pin)
        if device.type == "cpu"
        else torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    )
    views: list[torch.Tensor] = [buffer] * len(tensors)
    for index, segment in zip(order, buffer.split(sizes), strict=True):
        tensor = tensors[index]
        view = segment.view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor, non_blocking=pin or tensor.is_pinned())
        views[index] = view
    return _Chunk(buffer, views)


def _like(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``value`` (a DTensor or a tensor) over ``local``, a copy of its local tensor."""
    if not isinstance(value, DTensor):
        return local
    return wrap_local(local, value.device_mesh, value.placements, value.shape, value.stride())


def _host_empty(nbytes: int, pin: bool) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _wait_for_copies(device: torch.device, pin: bool) -> None:
    """The host waits once for every device-to-host copy (only the pinned ones were
    asynchronous)."""
    if pin:
        torch.accelerator.synchronize(device)
