"""fully_shard(), register_fsdp_forward_method and share_comm_ctx (FSDPModule: fsdp_module.py).

``fully_shard`` validates everything (validation.py) and builds the sharded parameters
off to the side before it changes anything, so an error leaves the module exactly as it
was (torch's FSDP2 registers hooks before its parameter checks).
"""

import functools
from collections.abc import Callable
from types import MethodType
from typing import Any, overload

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from .api import (
    DataParallelMeshDims,
    MixedPrecisionPolicy,
    OffloadPolicy,
)
from .fsdp_module import FSDPModule
from .io.state_dict import register_state_dict_hooks
from .observe.watchdog import watchdog_factory
from .param_checks import mark_replaced
from .runtime.mesh import (
    post_forward_mesh_info,
)
from .runtime.param_group import FSDPParamGroup
from .runtime.state import STATE_ATTR, FSDPState
from .runtime.streams import streams_for
from .validation import validate_call


@overload
def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> "FSDPModule": ...


@overload
def fully_shard(
    module: list[nn.Module],
    *,
    mesh: DeviceMesh | None = ...,
    reshard_after_forward: bool | int | None = ...,
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = ...,
    mp_policy: MixedPrecisionPolicy = ...,
    offload_policy: OffloadPolicy = ...,
    ignored_params: set[nn.Parameter] | None = ...,
    dp_mesh_dims: DataParallelMeshDims | None = ...,
) -> list["FSDPModule"]: ...


def fully_shard(
    module,
    *,
    mesh=None,
    reshard_after_forward=None,
    shard_placement_fn=None,
    mp_policy=MixedPrecisionPolicy(),
    offload_policy=OffloadPolicy(),
    ignored_params=None,
    dp_mesh_dims=None,
):
    """Shard ``module``'s parameters across the data-parallel ranks of ``mesh``, in place.

    Every parameter of ``module`` not already managed by an earlier ``fully_shard`` call
    (on a submodule) becomes an ``nn.Parameter`` wrapping a ``DTensor`` with ``Shard(0)``
    placement; together they form one group, all-gathered before ``module``'s forward in
    one collective and reduce-scattered after its backward in one collective. Call it
    bottom-up: on each transformer block, then on the root. A list of modules makes one
    group of all their parameters.

    Args:
        module: the module, or list of modules, to shard as one group.
        mesh: the data-parallel ``DeviceMesh``. ``None`` builds a 1-D mesh over the
            default process group (initialized from the environment first if need be, as
            torch does). Its device type decides where shards live.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward
            and all-gathers them again in backward; ``False`` keeps them until after
            backward; ``None`` means ``True``, except for the root, which keeps them.
        shard_placement_fn: maps a parameter to the ``Shard(dim)`` to shard it with, or
            ``None`` for ``Shard(0)``; a dim other than 0 must divide evenly. torch's
            ``ShardPlacementResult`` (placement and torch's ``FSDPMeshInfo``) is
            accepted too, on any data-parallel mesh of the same device type: the call
            then makes one group per mesh (MoE experts on the expert mesh), as torch's.
        mp_policy: mixed precision: all-gather and compute in ``param_dtype`` (the cast
            happens on the shard, before the all-gather), reduce in ``reduce_dtype``;
            the sharded params and grads the optimizer sees keep the original dtype.
        offload_policy: ``CPUOffloadPolicy()`` keeps sharded params, grads and hence
            optimizer state on the CPU; shards are copied to the device for the
            all-gather and reduced grads back to the CPU.
        ignored_params: parameters to leave alone: not sharded, not moved, not reduced.
        dp_mesh_dims: with it, ``mesh`` is the full SPMD mesh, every parameter a DTensor
            on it with ``Replicate()`` on the named data-parallel axes; FSDP shards over
            ``shard`` (and for HSDP replicates over ``replicate``). One axis name each.

    Returns:
        ``module``, now also an instance of ``FSDPModule`` (a list, for a list).

    Raises:
        TypeError: ``module`` is not a module or a list of modules.
        ValueError: a module was already passed to ``fully_shard``; a parameter is
            shared with another group, 0-dimensional, or on a device other than the
            mesh's; the mesh is not 1-D or 2-D, or is 2-D without ``mesh_dim_names``
            (also an ``AssertionError``, as in torch); ``shard_placement_fn`` returned something
            invalid (a ``Shard`` dim out of range is also an ``AssertionError``, as in
            torch); a tensor-parallel mesh cannot be concatenated with ``mesh`` (also a
            ``RuntimeError``, as in torch).
        NotImplementedError: a non-contiguous parameter, an uneven ``Shard(dim != 0)``,
            or another capability not built yet.
    """
    call = validate_call(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=shard_placement_fn,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        ignored_params=ignored_params,
        dp_mesh_dims=dp_mesh_dims,
    )
    modules = call.modules

    # Everything below mutates: nothing in it may raise on user input.
    groups = [
        FSDPParamGroup(
            group.params,
            modules,
            group.mesh_info,
            call.param_device,
            reshard_after_forward=call.reshard_after_forward,
            fqn="",
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            post_forward_mesh_info=(
                post_forward_mesh_info(group.mesh_info, group.post_forward_size)
                if group.post_forward_size is not None
                else None
            ),
        )
        for group in call.groups
    ]
    state = FSDPState(
        modules,
        groups,
        auto_reshard_after_forward=reshard_after_forward is None,
        mp_policy=mp_policy,
        device=call.mesh_info.device,
    )
    for group in groups[:-1]:  # backward reduces the last group first; it waits
        group.waits_for_reduce_scatters = False
    for group, sharding in zip(groups, call.groups, strict=True):
        group.to_sharded_modules()
        for source in sharding.params:
            mark_replaced(source, type(modules[0]).__name__)
    for owner, name, tensor in call.moved_buffers:
        owner._buffers[name] = tensor
    # The marks torch's fully_shard leaves on the modules it manages, on the same
    # modules: Hugging Face's generate() keeps the ranks stepping together (synced_gpus)
    # when the model has _is_fsdp_managed_module, and dynamo reads both: a marked
    # module's parameters are graph inputs it does not guard on, so swapping sharded
    # and unsharded parameters between calls does not recompile.
    for managed in call.managed_modules:
        managed._is_fsdp_managed_module = True
        managed._fsdp_use_orig_params = True
    for m in modules:
        m.__dict__[STATE_ATTR] = state
        m.__class__ = _fsdp_class_of(type(m))
    # On by default: see FSDPModule.set_collective_watchdog (a root reads its own).
    state.make_watchdog = watchdog_factory()
    state.register_hooks()
    register_state_dict_hooks(state)
    return module


# [Note: extra FSDP class bases] Classes that every ``FSDP<cls>`` made from now on also
# derives from, after ``cls`` in the MRO (so FSDPModule's and cls's methods win and
# ``__mro__[2]`` stays ``cls``). A framework adapter adds one so that frameworks asking
# ``isinstance(module, torch.distributed.fsdp.FSDPModule)`` recognise our modules
# (dtensor_fsdp/integrations/frameworks.py); the core itself never adds one. A process-wide
# list because the question is process-wide: a framework asks it of any module.
_extra_class_bases: list[type] = []


def add_fsdp_class_base(base: type) -> None:
    """Make every module that ``fully_shard`` shards from now on an instance of ``base``
    too (see [Note: extra FSDP class bases]). Modules sharded before keep their class.
    Adding a base already added does nothing."""
    if not isinstance(base, type):
        raise TypeError(f"add_fsdp_class_base takes a class, got {type(base).__name__}")
    if base not in _extra_class_bases:
        _extra_class_bases.append(base)


def remove_fsdp_class_base(base: type) -> None:
    """Undo ``add_fsdp_class_base(base)`` for modules sharded from now on; a base not
    added is ignored."""
    if base in _extra_class_bases:
        _extra_class_bases.remove(base)


def _fsdp_class_of(cls: type) -> type:
    return _fsdp_class(cls, tuple(_extra_class_bases))


@functools.cache
def _fsdp_class(cls: type, extra_bases: tuple[type, ...]) -> type:
    """``FSDP<cls>``: FSDPModule first in the MRO so its methods win, cls's still work,
    then the extra bases (see [Note: extra FSDP class bases])."""
    if issubclass(cls, FSDPModule):
        return cls
    bases = (FSDPModule, cls) + tuple(b for b in extra_bases if not issubclass(cls, b))
    return type(f"FSDP{cls.__name__}", bases, {})


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard before and reshard after, like ``forward``.

    For methods such as ``generate`` that use the parameters without calling forward.
    A method that calls forward (Hugging Face's ``generate()``, once per token) reshards
    the module's parameters when it returns, whatever ``reshard_after_forward`` says, as
    torch's. A module that is not an ``FSDPModule`` is left unchanged.
    """
    if not isinstance(module, FSDPModule):
        return
    method = getattr(module, method_name, None)
    if not callable(method):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r}")
    state = module._get_fsdp_state()
    original = getattr(type(module), method_name)

    # The forward hooks themselves, which run eagerly under torch.compile.
    pre_forward, post_forward = state.pre_forward_hook(module), state.post_forward_hook(module)

    def wrapped(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = pre_forward(self, args, kwargs)
        return post_forward(self, args, original(self, *args, **kwargs))

    # Graph mode wraps the original in its own gathers instead (graph/switch.py).
    wrapped.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(module, method_name, MethodType(wrapped, module))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """Share the communication context of several FSDP roots, e.g. the model chunks
    of pipeline parallelism, as torch's ``share_comm_ctx`` does.

    The roots then use the same side streams on an accelerator (streams.py), so the
    caching allocator's per-stream pools do not fragment memory across roots, as in
    torch. Each root keeps its own ``CommContext``, which holds per-iteration
    scheduling state (forward order, in-flight reduce-scatters) that must not mix
    between roots whose forwards and backwards interleave. On the host there are no
    streams, and this only validates its argument.

    Args:
        modules: the FSDP roots.

    Raises:
        ValueError: an element is not an ``FSDPModule``.
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"Expects list of FSDPModules but got {module}: share_comm_ctx takes modules "
                "that fully_shard returned"
            )
    if not modules:
        return
    streams = streams_for(modules[0]._get_fsdp_state().device)
    for module in modules:
        state = module._get_fsdp_state()
        state.shared_streams = streams
        if state.ctx is not None and state.is_root:
            state.ctx.streams = streams
