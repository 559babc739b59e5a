"""Switching a model sharded by ``fully_shard`` between eager and graph mode.

In graph mode nothing runs in hooks: every module that owns a sharded parameter gets
a class with a property per parameter name, which returns the unsharded tensor while
its FSDP module's forward runs and the sharded parameter otherwise; every FSDP module
gets a forward that gathers its parameters (`gather.gather`, traceable), binds them,
runs the original forward and unbinds them. The module keeps its sharded parameters
registered, so ``parameters()``, state dicts, checkpoints, optimizers and the planner
see exactly what they see in eager mode.

The lifecycle of a parameter in graph mode, as the compiled graph runs it:
sharded DTensor --(forward: gather)--> unsharded tensor, bound --(forward ends)-->
unbound (freed after its last use; re-gathered in backward when the group reshards
after forward: `backend.mark_reshard`) --(backward)--> gradient reduced and landed as
the sharded DTensor's ``.grad``.

Settings are read when graph mode is enabled: enable it again after changing one.
"""

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime.collectives import ReductionPlan
from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from ..runtime.reduction.landing import NO_OVERFLOW_RISK
from ..runtime.reduction.reduce_scatter import gradient_divisors
from ..runtime.state import FSDPState, cast_floating, inputs_to_device, state_of, states_under
from ..runtime.tensor_utils import contiguous_stride
from .gather import GatherSpec, ReductionSpec, ShardSpec, gather

# The graph nodes of a gather whose group reshards after forward carry this custom
# annotation (``torch.fx.traceback.annotate``); `backend.mark_reshard` finds them.
RESHARD_ANNOTATION = {"dtensor_fsdp": "reshard_after_forward"}
_GRAPH = "_dtensor_fsdp_graph"  # an FSDP module's __dict__ key: its `ModuleGather`
_EAGER_FORWARD = "_dtensor_fsdp_eager_forward"  # an instance ``forward`` found at enable


@dataclass(frozen=True)
class BoundParam:
    """Where one gathered tensor is bound, and how it is presented (TP: as a DTensor)."""

    slots: tuple[tuple[nn.Module, str], ...]
    fsdp_param: FSDPParam


@dataclass(frozen=True)
class Gather:
    """One gather of an FSDP module's forward: what it gathers and where it binds it."""

    spec: GatherSpec
    params: tuple[BoundParam, ...]
    reshard: bool  # re-gathered in backward (reshard_after_forward)
    group: FSDPParamGroup  # read at each trace: requires_gradient_sync
    # Gradient accumulation without sync: a leaf whose ``.grad`` sums the micro-batches'
    # unsharded gradients (gather.py). Expanded from one element: it holds no memory.
    accumulator: torch.Tensor


@dataclass(frozen=True)
class ModuleGather:
    """What one FSDP module's forward gathers, and how it treats inputs and outputs."""

    gathers: tuple[Gather, ...]
    input_dtype: torch.dtype | None  # mixed precision's cast_forward_inputs
    output_dtype: torch.dtype | None
    input_device: torch.device | None  # the root moves host inputs to the mesh's device


def enable_graph_mode(root: nn.Module) -> None:
    """Switch ``root`` (the root of a ``fully_shard`` tree) and everything under it to
    graph mode. Idempotent: enabling again re-reads the settings."""
    root_state = state_of(root)
    if root_state is None or root_state.is_root is False:
        raise ValueError(
            f"graph mode needs the root of a fully_shard tree; {type(root).__name__} is "
            + ("not one (another root ran it)" if root_state else "not passed to fully_shard")
            + ": call it on the model whose forward you run, after fully_shard(model)"
        )
    # As eager's first forward: the root decides who is root, and names the groups
    # (errors below name them).
    root_state.lazy_init()
    states = states_under((root,))
    for state in states:
        _check_supported(state)
    disable_graph_mode(root)
    # Sharded parameters registered everywhere: a root kept unsharded after a no_grad
    # forward (as torch's) would otherwise be bound as plain Parameters.
    for state in states:
        for group in state.groups:
            group.reshard()
    for state in states:
        for handles in state.forward_hook_handles:
            for handle in handles:
                handle.remove()
        state.forward_hook_handles.clear()
        for module in state.modules:
            module.__dict__[_GRAPH] = _module_gather(state, module, is_root=state is root_state)
    for module, names in _graph_modules(states).items():
        _swap_class(module, names)


def disable_graph_mode(root: nn.Module) -> None:
    """Back to eager mode: the original classes and FSDP's hooks."""
    states = states_under((root,))
    for module, names in _graph_modules(states).items():
        original = getattr(type(module), "_dtensor_fsdp_eager_class", None)
        if original is not None:
            for name in names:
                module.__dict__.pop(_bound_attribute(name), None)
            module.__class__ = original
        if _GRAPH in module.__dict__:
            del module.__dict__["forward"]
            if _EAGER_FORWARD in module.__dict__:
                module.__dict__["forward"] = module.__dict__.pop(_EAGER_FORWARD)
    for state in states:
        was_graph = False
        for module in state.modules:
            was_graph |= module.__dict__.pop(_GRAPH, None) is not None
        if was_graph:
            state.register_hooks()


def is_graph_mode(module: nn.Module) -> bool:
    return _GRAPH in module.__dict__


def gather_specs(root: nn.Module) -> list[GatherSpec]:
    """The gathers of every FSDP module under ``root`` in graph mode."""
    return [
        spec
        for module in root.modules()
        if _GRAPH in module.__dict__
        for spec in (planned.spec for planned in module.__dict__[_GRAPH].gathers)
    ]


def _graph_modules(states: list[FSDPState]) -> dict[nn.Module, tuple[str, ...]]:
    """Every module whose class graph mode swaps (FSDP modules and owners of sharded
    parameters), with the names of the sharded parameters it owns."""
    names: dict[nn.Module, set[str]] = {}
    for state in states:
        for module in state.modules:
            names.setdefault(module, set())
        for fsdp_param in state.fsdp_params():
            for slot in fsdp_param.slots:
                names.setdefault(slot.module, set()).add(slot.name)
    return {module: tuple(sorted(owned)) for module, owned in names.items()}


def _check_supported(state: FSDPState) -> None:
    """Features of the eager runtime graph mode does not have yet: a clear error."""
    for group in state.groups:
        reduction = group.reduction
        unsupported = {
            "CPU offload (offload_policy)": group.offload is not None,
            "set_custom_all_gather": group.custom_all_gather is not None,
            "set_custom_reduce_scatter": reduction.custom_reduce_scatter is not None,
            "set_comm_precision": reduction.comm_precision is not None,
            "set_all_reduce_hook": reduction.all_reduce_hook is not None,
            "an all-gather extension (fsdp_pre_all_gather)": any(
                p.extension is not None for p in group.fsdp_params
            ),
            "HSDP with set_requires_all_reduce(False)": group.mesh_info.is_hsdp
            and not reduction.requires_all_reduce,
            "register_fsdp_forward_method": any(
                _is_registered_method(value) for m in group.modules for value in vars(m).values()
            ),
        }
        for feature, used in unsupported.items():
            if used:
                raise NotImplementedError(
                    f"graph mode does not support {feature} yet (fully_shard module "
                    f"{group.fqn or type(group.modules[0]).__name__!r}): use eager mode "
                    "for this model, or turn it off"
                )


def _is_registered_method(value: object) -> bool:
    function = getattr(value, "__func__", None)
    return function is not None and function.__qualname__.startswith(
        "register_fsdp_forward_method."
    )


def _module_gather(state: FSDPState, module: nn.Module, is_root: bool) -> ModuleGather:
    gathers = []
    for group in state.groups:
        # fully_shard([a, b]): each module gathers the parameters under it.
        params = [p for p in group.fsdp_params if _owned_by(p, module)]
        if not params:
            continue
        spec = GatherSpec(
            shards=tuple(_shard_spec(p) for p in params),
            group=group.mesh_info.shard_group.group_name,
            world_size=group.mesh_info.shard_size,
            reduction=_reduction_spec(group, params),
            fqn=group.fqn,
        )
        bound = tuple(BoundParam(tuple((s.module, s.name) for s in p.slots), p) for p in params)
        # lazy_init already cleared it for a root left to decide (torch's default).
        reshard = bool(group.reshard_after_forward)
        gathers.append(Gather(spec, bound, reshard, group, _accumulator(spec, group)))
    policy = state.mp_policy
    return ModuleGather(
        gathers=tuple(gathers),
        input_dtype=policy.param_dtype if policy and policy.cast_forward_inputs else None,
        output_dtype=policy.output_dtype if policy else None,
        input_device=state.device if is_root and state.device.type not in ("cpu", "meta") else None,
    )


def _accumulator(spec: GatherSpec, group: FSDPParamGroup) -> torch.Tensor:
    numel = spec.world_size * sum(s.padded_local_numel for s in spec.shards if s.requires_grad)
    zero = torch.zeros(1, dtype=spec.reduction.reduce_dtype, device=group.device)
    return zero.expand(numel).requires_grad_()


def _owned_by(fsdp_param: FSDPParam, module: nn.Module) -> bool:
    under = {id(m) for m in module.modules()}
    return any(id(slot.module) in under for slot in fsdp_param.slots)


def _shard_spec(fsdp_param: FSDPParam) -> ShardSpec:
    geometry = fsdp_param.geometry
    return ShardSpec(
        local_shape=tuple(geometry.local_shape),
        padded_local_shape=tuple(geometry.padded_local_shape),
        shape=tuple(fsdp_param.shape),
        dim=geometry.dim,
        dtype=fsdp_param.dtype,
        gather_dtype=fsdp_param.param_dtype,
        requires_grad=fsdp_param.requires_grad,
    )


def _reduction_spec(group: FSDPParamGroup, params: list[FSDPParam]) -> ReductionSpec:
    """The eager reduction's choices for ``group`` (gradient_reduction.py), fixed."""
    reduction = group.reduction
    mesh_info = group.mesh_info
    reduce_dtype = params[0].reduce_dtype
    replicate_group = mesh_info.replicate_group if mesh_info.is_hsdp else None
    plan = ReductionPlan.choose(
        reduction.reduce_scatter_group,
        replicate_group,
        group.device,
        prefer_average=reduction.gradient_divide_factor is None
        and not reduction.force_sum_reduction
        and reduce_dtype in NO_OVERFLOW_RISK,
        custom=None,
    )
    pre_divisor, post_divisor = gradient_divisors(
        plan,
        reduce_dtype,
        reduction.gradient_divide_factor,
        mesh_info.shard_size,
        mesh_info.replicate_size,
    )
    all_reduce = replicate_group is not None and reduction.requires_all_reduce
    return ReductionSpec(
        reduce_dtype=reduce_dtype,
        use_all_to_all=plan.use_all_to_all,
        reduce_scatter_op="avg" if plan.average_in_reduce_scatter else "sum",
        pre_divisor=pre_divisor,
        post_divisor=post_divisor,
        replicate_group=replicate_group.group_name if all_reduce else None,
        replicate_size=mesh_info.replicate_size if all_reduce else 1,
        all_reduce_op="avg" if plan.average_in_all_reduce else "sum",
        land_unused=reduction.reduce_scatter_unused_params,
    )


# Class swaps #

_GRAPH_CLASSES: dict[tuple[type, tuple[str, ...]], type] = {}


def _swap_class(module: nn.Module, names: tuple[str, ...]) -> None:
    """The properties live on a class (a property on an instance does nothing); the
    gathering forward on the instance, so that it wraps whatever ``forward`` the
    instance had (code that patches ``block.forward``, as activation checkpointing
    recipes do, would otherwise shadow a class-level one)."""
    cls = type(module)
    if (cls, names) not in _GRAPH_CLASSES:
        namespace: dict[str, Any] = {name: _bound_property(name) for name in names}
        namespace.update({_bound_attribute(name): None for name in names})
        namespace["_dtensor_fsdp_eager_class"] = cls
        _GRAPH_CLASSES[cls, names] = type(f"Graph{cls.__name__}", (cls,), namespace)
    if _GRAPH in module.__dict__:
        own = module.__dict__.get("forward")
        if own is not None:
            module.__dict__[_EAGER_FORWARD] = own
        inner = own if own is not None else types.MethodType(cls.forward, module)
        module.__dict__["forward"] = types.MethodType(_graph_forward(inner), module)
    module.__class__ = _GRAPH_CLASSES[cls, names]


def _bound_attribute(name: str) -> str:
    """The instance attribute that holds parameter ``name``'s unsharded tensor while its
    FSDP module's forward runs (None otherwise: the class default). A plain attribute,
    set and reset with ``setattr``: what dynamo traces on every torch we support (it
    cannot trace edits of ``module.__dict__`` on 2.11)."""
    return f"_dtensor_fsdp_unsharded_{name}"


def _bound_property(name: str) -> property:
    attribute = _bound_attribute(name)

    def get(module: nn.Module) -> torch.Tensor:
        bound = getattr(module, attribute)
        return bound if bound is not None else module._parameters[name]

    return property(get, doc=f"{name}: unsharded during its FSDP module's forward")


def _graph_forward(forward: Any) -> Any:
    """``forward`` (bound) wrapped: gather and bind, run, unbind (also on an error)."""

    def graph_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        plan: ModuleGather = self.__dict__[_GRAPH]
        if plan.input_device is not None:
            args, kwargs = inputs_to_device((args, kwargs), plan.input_device)
        if plan.input_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), plan.input_dtype)
        bound = _bind(plan)
        try:
            output = forward(*args, **kwargs)
        finally:
            for module, name in bound:
                setattr(module, _bound_attribute(name), None)
        if plan.output_dtype is not None:
            output = cast_floating(output, plan.output_dtype)
        return output

    return graph_forward


def _bind(plan: ModuleGather) -> list[tuple[nn.Module, str]]:
    bound = []
    for planned in plan.gathers:
        shards = [p.slots[0][0]._parameters[p.slots[0][1]].to_local() for p in planned.params]
        # Dynamo guards on the flag and on whether a sum is pending: a step with
        # micro-batches without sync runs up to three graphs (no sync, sync with and
        # without a pending sum), each compiled once.
        sync = planned.group.requires_gradient_sync
        # Only a forward that will have a backward consumes the pending sum (not an
        # evaluation between micro-batches).
        pending = planned.accumulator.grad if sync and torch.is_grad_enabled() else None
        if pending is not None:
            planned.accumulator.grad = None  # consumed by this micro-batch's reduction
        arguments = (planned.spec, shards, sync, planned.accumulator, pending)
        if planned.reshard:
            with torch.fx.traceback.annotate(RESHARD_ANNOTATION):
                unsharded = gather(*arguments)
        else:
            unsharded = gather(*arguments)
        for param, tensor in zip(planned.params, unsharded):
            value = _presented(param.fsdp_param, tensor)
            for module, name in param.slots:
                setattr(module, _bound_attribute(name), value)
                bound.append((module, name))
    return bound


def _presented(fsdp_param: FSDPParam, tensor: torch.Tensor) -> torch.Tensor:
    """The unsharded tensor as eager presents it: for TP, a DTensor on the TP mesh."""
    layout = fsdp_param.layout
    if layout.unsharded_mesh is None:
        return tensor
    return DTensor.from_local(
        tensor,
        layout.unsharded_mesh,
        layout.unsharded_placements,
        run_check=False,
        shape=fsdp_param.global_shape,
        stride=contiguous_stride(fsdp_param.global_shape),
    )
