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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..runtime.param import FSDPParam
from ..runtime.shard_geometry import contiguous_stride
from ..runtime.state import FSDPState, cast_floating, inputs_to_device, state_of, states_under
from .gather import GatherPlan, StepInputs, gather
from .group_graph import GroupGraph, group_graph
from .observed import GROUP_ANNOTATION

_GRAPH = "_dtensor_fsdp_graph"  # an FSDP module's __dict__ key: its `ModuleGraph`
_EAGER_FORWARD = "_dtensor_fsdp_eager_forward"  # an instance ``forward`` found at enable
# An FSDP module's register_fsdp_forward_method methods, as eager registered them.
_EAGER_METHODS = "_dtensor_fsdp_eager_methods"


@dataclass
class Session:
    """The groups gathered since the outermost graph-mode forward began (the root's,
    or a module's called on its own) and where they are bound; everything is unbound
    when it ends. A group is gathered once per session, however many of its modules
    run and however often: a list group ``fully_shard([a, b])`` gathers once, and a
    block called twice reuses its gathered parameters, so autograd sums its two
    gradients before the one reduction, as eager's post-backward does."""

    depth: int = 0
    gathered: set[int] = field(default_factory=set)  # `GroupGraph.index`es
    bound: list[tuple[nn.Module, str]] = field(default_factory=list)


@dataclass(frozen=True)
class ModuleGraph:
    """What one FSDP module's forward gathers, and how it treats inputs and outputs."""

    groups: tuple[GroupGraph, ...]
    session: Session  # its root's
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
    session = Session()
    graphs: dict[int, GroupGraph] = {}
    process_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for state in states:
        for group in state.groups:
            graphs[id(group)] = group_graph(group, len(graphs), process_groups)
    for state in states:
        for handles in state.forward_hook_handles:
            for handle in handles:
                handle.remove()
        state.forward_hook_handles.clear()
        groups = tuple(graphs[id(group)] for group in state.groups)
        for module in state.modules:
            module.__dict__[_GRAPH] = _module_graph(state, groups, session, state is root_state)
    for module, names in _graph_modules(states).items():
        _swap_class(module, names)


def disable_graph_mode(root: nn.Module) -> None:
    """Back to eager mode: the original classes and FSDP's hooks, and ``root`` no
    longer compiled (``dtensor_fsdp.compile`` compiles it with ``nn.Module.compile``,
    whose graphs hold graph mode's gathers and no FSDP hooks). Training continues
    bitwise as a run that stayed eager. Sums of micro-batches without sync that no
    syncing forward consumed yet are dropped."""
    root.__dict__.pop("_compiled_call_impl", None)
    states = states_under((root,))
    for module, names in _graph_modules(states).items():
        original = getattr(type(module), "_dtensor_fsdp_eager_class", None)
        if original is not None:
            for name in names:
                module.__dict__.pop(_bound_attribute(name), None)
            module.__class__ = original
        if _GRAPH in module.__dict__:
            methods = module.__dict__.pop(_EAGER_METHODS, {})
            if "forward" not in methods:
                del module.__dict__["forward"]
                if _EAGER_FORWARD in module.__dict__:
                    module.__dict__["forward"] = module.__dict__.pop(_EAGER_FORWARD)
            module.__dict__.update(methods)
    for state in states:
        was_graph = False
        for module in state.modules:
            was_graph |= module.__dict__.pop(_GRAPH, None) is not None
        if was_graph:
            state.register_hooks()


def is_graph_mode(module: nn.Module) -> bool:
    return _GRAPH in module.__dict__


def group_graphs(root: nn.Module) -> list[GroupGraph]:
    """Every group under ``root`` in graph mode, in its tree's order."""
    graphs = {
        graph.index: graph
        for module in root.modules()
        if _GRAPH in module.__dict__
        for graph in module.__dict__[_GRAPH].groups
    }
    return [graphs[index] for index in sorted(graphs)]


def gather_plans(root: nn.Module) -> list[GatherPlan]:
    """The gathers of every group under ``root`` in graph mode."""
    return [graph.plan for graph in group_graphs(root)]


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
    """What graph mode cannot run: a clear error before anything is switched."""
    for group in state.groups:
        extended = [p.fqn for p in group.fsdp_params if p.extension is not None]
        if extended:
            raise NotImplementedError(
                f"graph mode does not support all-gather extensions (fsdp_pre_all_gather "
                f"tensor subclasses: {extended} of fully_shard module "
                f"{group.fqn or type(group.modules[0]).__name__!r}): AOT autograd traces "
                "the gradient of a subclass output (torchao's Float8TrainingTensor) as that "
                "subclass, which the reduction cannot take; use eager mode for this model "
                "(docs/graph.md)"
            )


def _module_graph(
    state: FSDPState, groups: tuple[GroupGraph, ...], session: Session, is_root: bool
) -> ModuleGraph:
    policy = state.mp_policy
    return ModuleGraph(
        groups=groups,
        session=session,
        input_dtype=policy.param_dtype if policy and policy.cast_forward_inputs else None,
        output_dtype=policy.output_dtype if policy else None,
        input_device=state.device if is_root and state.device.type not in ("cpu", "meta") else None,
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
        registered = _swap_registered_methods(module)
        if "forward" not in registered:
            own = module.__dict__.get("forward")
            if own is not None:
                module.__dict__[_EAGER_FORWARD] = own
            inner = own if own is not None else types.MethodType(cls.forward, module)
            module.__dict__["forward"] = types.MethodType(_graph_forward(inner), module)
    module.__class__ = _GRAPH_CLASSES[cls, names]


def _swap_registered_methods(module: nn.Module) -> dict[str, types.MethodType]:
    """``register_fsdp_forward_method``'s methods gather as the forward does (a
    generate() around compiled forwards: the forwards inside reuse its gathers);
    returns them as eager registered them."""
    registered = {
        name: value
        for name, value in vars(module).items()
        if isinstance(value, types.MethodType) and hasattr(value.__func__, "__wrapped__")
        and value.__func__.__qualname__.startswith("register_fsdp_forward_method.")
    }  # fmt: skip
    module.__dict__[_EAGER_METHODS] = registered
    for name, method in registered.items():
        original = types.MethodType(method.__func__.__wrapped__, module)
        module.__dict__[name] = types.MethodType(_graph_forward(original), module)
    return registered


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
    """``forward`` (bound) wrapped: gather and bind (once per session), run; the
    outermost one unbinds everything its session bound (also on an error)."""

    def graph_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        graph: ModuleGraph = self.__dict__[_GRAPH]
        if graph.input_device is not None:
            args, kwargs = inputs_to_device((args, kwargs), graph.input_device)
        if graph.input_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), graph.input_dtype)
        session = graph.session
        session.depth += 1
        try:
            for group_graph_ in graph.groups:
                if group_graph_.index not in session.gathered:
                    session.gathered.add(group_graph_.index)
                    _bind(group_graph_, session)
            output = forward(*args, **kwargs)
        finally:
            session.depth -= 1
            if session.depth == 0:
                _end(session)
        if graph.output_dtype is not None:
            output = cast_floating(output, graph.output_dtype)
        return output

    return graph_forward


def _end(session: Session) -> None:
    for module, name in session.bound:
        setattr(module, _bound_attribute(name), None)
    session.bound.clear()
    session.gathered.clear()


def _bind(graph: GroupGraph, session: Session) -> None:
    """Gather ``graph``'s group and bind its unsharded params (`_bound_property`)."""
    shards = [p.slots[0][0]._parameters[p.slots[0][1]].to_local() for p in graph.params]
    group = graph.group
    # Dynamo guards on the flags and on whether a sum is pending: a step with
    # micro-batches without sync runs up to three graphs (no sync, sync with and
    # without a pending sum), each compiled once; likewise HSDP's all-reduce.
    sync = group.requires_gradient_sync
    all_reduce = group.reduction.settings.requires_all_reduce
    # Only a forward that will have a backward consumes a pending sum (not an
    # evaluation between micro-batches).
    consumes = sync and torch.is_grad_enabled()
    pending = graph.accumulator.grad if consumes else None
    if pending is not None:
        graph.accumulator.grad = None  # consumed by this micro-batch's reduction
    pending_partial = graph.partial.grad if consumes and all_reduce else None
    if pending_partial is not None:
        graph.partial.grad = None
    step = StepInputs(
        sync, all_reduce, graph.accumulator, pending, graph.partial, pending_partial,
        graph.residuals,
    )  # fmt: skip
    # The observers name a graph's collectives by group (graph/observed.py).
    with torch.fx.traceback.annotate({GROUP_ANNOTATION: group.fqn}):
        unsharded = gather(graph.plan, shards, step)
    for param, tensor in zip(graph.params, unsharded, strict=True):
        value = _presented(param.fsdp_param, tensor)
        for module, name in param.slots:
            setattr(module, _bound_attribute(name), value)
            session.bound.append((module, name))


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
