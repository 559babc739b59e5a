"""FSDPState: the hooks that drive one ``fully_shard`` call's groups through an iteration.

The lifecycle of a parameter, and the method that performs each step:

1. ``fully_shard``: shard the parameters (`FSDPParamGroup.__init__`), register the
   sharded params and the hooks (`FSDPState.register_hooks`).
2. Lazy init at the root's first forward (`FSDPState.lazy_init`): the first state whose
   forward runs is the root; it creates the CommContext and hands it to every group.
3. Pre-forward (`FSDPState.pre_forward`): unshard (one all-gather), register the
   post-backward node on the inputs.
4. Post-forward (`FSDPState.post_forward`): reshard per ``reshard_after_forward``,
   register the pre-backward hook on the outputs.
5. Pre-backward (`FSDPState.pre_backward`): unshard again if resharded, prefetch the
   next group's all-gather, queue the final callback.
6. Post-backward (`FSDPState.post_backward`): reduce-scatter the gradients (one
   collective), reshard.
7. Final callback (`FSDPState.finalize_backward`): post-backward for groups that
   had none, wait for the in-flight reduce-scatters, reset per-iteration state.
8. Optimizer step on the sharded DTensors: plain ``torch.optim``, no FSDP code.
"""

from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import torch
import torch.nn as nn
from torch.autograd import Variable
from torch.autograd import profiler as autograd_profiler
from torch.utils.hooks import RemovableHandle

from ..api import MixedPrecisionPolicy
from .activations import grad_tensors, map_tensors, replace_grad_tensors
from .comm_context import CommContext
from .observer import CommObserver
from .param import FSDPParam
from .param_group import FSDPParamGroup, TrainingState, is_in_backward
from .profiler_labels import ProfilerLabels
from .streams import CommStreams, streams_for

_P = ParamSpec("_P")
_R = TypeVar("_R")

# The attribute under which a module keeps its FSDPState. Stored in the module's
# __dict__ (not as a submodule) so it never shows up in module traversals.
STATE_ATTR = "_dtensor_fsdp_state"


def _run_eagerly(hook: Callable[_P, _R]) -> Callable[_P, _R]:
    """``hook`` as torch's FSDP2 runs its own: outside any ``torch.compile`` graph.

    A compiled module (``block.compile()``, ``torch.compile(model)``) calls its forward
    hooks from inside the compiled frame (and compiled autograd would call the backward
    ones from its graph). FSDP's steps communicate, wait and swap parameters: nothing a
    graph should capture. Dynamo runs a disabled module hook eagerly, between graphs,
    without a graph break (as it runs torch's), so the compiled forward sees the
    unsharded parameters as plain graph inputs (the modules carry torch's managed-module
    marks, set in `fully_shard`). It must be the hook itself that is disabled: a hook
    that calls a disabled function breaks the graph there.
    """
    return torch._dynamo.disable(hook, recursive=True, reason="dtensor_fsdp hooks run eagerly")


def state_of(module: nn.Module) -> "FSDPState | None":
    return module.__dict__.get(STATE_ATTR)


class FSDPState:
    """Hooks and root bookkeeping for one ``fully_shard`` call (its groups: one per mesh)."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        groups: list[FSDPParamGroup],
        auto_reshard_after_forward: bool,
        mp_policy: MixedPrecisionPolicy,
        device: torch.device,
    ) -> None:
        self.modules = modules
        # One group per data-parallel mesh the call's parameters are on (several when
        # shard_placement_fn puts some on another mesh, e.g. MoE experts on the expert
        # mesh), in the order their first parameters come; none when every parameter
        # already belonged to a subgroup. See [Note: several groups of one call].
        self.groups = groups
        self.device = device  # the mesh's: where the root moves its forward inputs
        self.mp_policy = mp_policy
        self.auto_reshard_after_forward = auto_reshard_after_forward
        self.is_root: bool | None = None  # decided at lazy init
        self.root: FSDPState | None = None
        self.ctx: CommContext | None = None
        self.states_in_tree: list[FSDPState] = []  # the root's: every state under it
        self.forward_prefetch: list[FSDPState] = []
        self.backward_prefetch: list[FSDPState] | None = None  # None: implicit
        self.max_in_flight_reduce_scatters = 1  # torch's default; read at lazy init
        # The root's check observer (`set_check`: FSDPModule.set_divergence_check and
        # set_nonfinite_grad_check; ranks agree before each collective,
        # observe/consistency.py), attached to every group of the tree at lazy init:
        # one for the tree, since its sequence numbers count per process group across
        # groups. None when both checks are off.
        self.check: CommObserver | None = None
        # Builds the root's watchdog observer at lazy init, when the tree is known
        # (fully_shard installs the flight recorder's, observe/watchdog.py;
        # FSDPModule.set_collective_watchdog replaces it); None: no watchdog.
        self.make_watchdog: Callable[[FSDPState], CommObserver | None] | None = None
        self.watchdog: CommObserver | None = None  # the root's, built at lazy init
        self.post_optim_event: torch.Event | None = None  # root only, used once
        self.is_labelled = False  # root: its groups hold profiler labels (set_labels)
        self.shared_streams: CommStreams | None = None  # share_comm_ctx, read at lazy init
        # The (pre-forward, post-forward) hook handles of each module in ``modules``,
        # in that order: a tool that wraps the forward hooks (torch's FSDPMemTracker,
        # through integrations/) removes one and stores the handle of its replacement.
        self.forward_hook_handles: list[tuple[RemovableHandle, RemovableHandle]] = []

    def __getattr__(self, name: str) -> Any:
        # Only reached for a missing attribute. Frameworks written for torch's FSDP2 reach
        # its private state through ``module._get_fsdp_state()`` (``_state_ctx``,
        # ``_comm_ctx``, ...), which returns this object for our modules: name what
        # happened instead of a bare "no attribute". Still an AttributeError, so that
        # hasattr() and getattr() with a default behave as for any missing attribute.
        if name.startswith("__"):  # protocol probes (copy, pickle): no explanation due
            raise AttributeError(name)
        raise AttributeError(
            f"dtensor_fsdp's FSDPState has no attribute {name!r}. If a framework read it "
            "through FSDPModule._get_fsdp_state(), it expects torch FSDP2's private state, "
            "which dtensor_fsdp does not have: use the public FSDPModule API, or torch's "
            "fully_shard for this model"
        )

    def fsdp_params(self) -> list[FSDPParam]:
        """Every parameter of this call, group by group."""
        return [p for g in self.groups for p in g.fsdp_params]

    # Initialization #

    def register_hooks(self) -> None:
        for module in self.modules:
            pre = module.register_forward_pre_hook(
                self.pre_forward_hook(module), prepend=True, with_kwargs=True
            )
            post = module.register_forward_hook(self.post_forward_hook(module))
            self.forward_hook_handles.append((pre, post))

    def lazy_init(self) -> None:
        """Become the root: share one CommContext with every state in the tree."""
        if self.ctx is not None:
            return
        states = states_under(self.modules)
        for state in states:
            if state.ctx is not None:
                raise RuntimeError(
                    f"fully_shard module {_describe(state.modules)} already ran forward as part "
                    f"of another root; run forward through the root module "
                    f"{_describe(self.modules)} first (FSDP picks the root at the first forward)"
                )
        assign_fqns(self.modules, states)
        ctx = CommContext(
            max_in_flight_reduce_scatters(states), self.shared_streams or streams_for(self.device)
        )
        groups = [g for s in states for g in s.groups]
        # A parameter replaced since fully_shard by another group's sharded param (a tie
        # made after fully_shard) is refused before any group adopts anything.
        tree_params = [p for g in groups for p in g.fsdp_params]
        owners = {id(p.sharded_param): p for p in tree_params}
        for group in groups:
            group.check_replacements(owners)
        # Groups first: one that refuses (params still on meta) leaves no state rooted.
        for group in groups:
            group.lazy_init(ctx)
        for state in states:
            state.ctx = ctx
            state.root = self
            state.is_root = state is self
        for group in groups:
            group.tree_params = tree_params
            group.set_observer("check", self.check)
        self.states_in_tree = states
        self.set_watchdog(self.make_watchdog(self) if self.make_watchdog is not None else None)
        # The root's params are needed as soon as backward starts: keep them unsharded.
        if self.auto_reshard_after_forward:
            for group in self.groups:
                group.reshard_after_forward = False

    def set_check(self, check: CommObserver | None) -> None:
        """Root: attach ``check`` (FSDPModule.set_divergence_check and
        set_nonfinite_grad_check build it) to every group of the tree, replacing the
        one there; before lazy init the tree is not known yet and lazy init does it."""
        self.check = check
        if self.ctx is None:
            return
        for state in self.states_in_tree:
            for group in state.groups:
                group.set_observer("check", check)

    def set_watchdog(self, watchdog: CommObserver | None) -> None:
        """Root, after lazy init: attach ``watchdog`` to every group of the tree,
        replacing the one there (FSDPModule.set_collective_watchdog)."""
        self.watchdog = watchdog
        for state in self.states_in_tree:
            for group in state.groups:
                group.set_observer("watchdog", watchdog)

    def set_labels(self, is_labelled: bool) -> None:
        """Root: give every group of the tree profiler labels, or take them back (see
        [Note: profiler labels], profiler_labels.py)."""
        self.is_labelled = is_labelled
        for state in self.states_in_tree:
            for group in state.groups:
                if group.labels is not None:
                    group.labels.close()
                group.labels = ProfilerLabels(group.fqn) if is_labelled else None

    # Runtime #

    def pre_forward_hook(self, module: nn.Module):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return self.pre_forward(module, args, kwargs)

        return _run_eagerly(hook)

    def post_forward_hook(self, module: nn.Module):
        def hook(_module: nn.Module, args: tuple, output: Any) -> Any:
            return self.post_forward(module, output)

        return _run_eagerly(hook)

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.ctx is None:
            self.lazy_init()
        assert self.ctx is not None
        if self._is_recomputing_in_backward():
            # The recomputation must see what the forward saw: the same input cast.
            return self._cast_forward_inputs(args, kwargs)
        if self.is_root:
            self.ctx.begin_forward(self.post_optim_event)
            self.post_optim_event = None
            # torch's flag, a module attribute: no call without a profiler.
            if autograd_profiler._is_profiler_enabled is not self.is_labelled:
                self.set_labels(autograd_profiler._is_profiler_enabled)
            if self.device.type not in ("cpu", "meta"):
                # As DDP and torch's FSDP2: inputs may arrive on the host.
                args, kwargs = inputs_to_device((args, kwargs), self.device)
        args, kwargs = self._cast_forward_inputs(args, kwargs)
        if not self.groups:
            return args, kwargs
        # fully_shard([a, b]): as torch's group hooks, the first module's forward starts
        # the group and only its inputs carry the post-backward. A later module's inputs
        # would fire it while the earlier modules still compute grads (b's input grads
        # come before a's), and reshard and reduce-scatter the group twice.
        # Its explicit forward prefetch too, issued once per forward of the group: a
        # later module's would re-gather a target resharded in between.
        starts_group = any(g.training_state != TrainingState.FORWARD for g in self.groups)
        for group in self.groups:
            group.pre_forward()
        if not starts_group:
            return args, kwargs
        self.ctx.prefetch_forward([g for s in self.forward_prefetch for g in s.groups])
        return self._register_post_backward(args, kwargs)

    def post_forward(self, module: nn.Module, output: Any) -> Any:
        assert self.ctx is not None
        if self.is_root:
            self.ctx.end_forward()
        elif not self.ctx.is_in_forward:
            # A module run outside the root's forward (a chunked loss's output head):
            # no later copy-out of this forward releases the all-gather output its
            # copy-out kept, as torch's releases at the end of the iteration's first
            # forward. See [Note: forward all-gather overlap].
            self.ctx.release_kept_all_gather()
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        if self._is_recomputing_in_backward():
            return output
        for group in self.groups:
            group.post_forward(module)
        if any(g.is_forward_incomplete() for g in self.groups):
            # A list group's module before the last, or called on its own: as torch's
            # group hooks, the group's post-forward waits for its other modules (the
            # root's post-forward completes it if they do not run).
            return output
        if self.groups and not is_in_backward():  # a recompute is not a forward
            self.ctx.record_post_forward(self.groups)
        # Also without groups of its own (a root whose parameters all belong to its
        # children), as torch's: its pre-backward queues the end-of-backward callback.
        output = self._register_pre_backward(output)
        if self.is_root and not is_in_backward():
            # Whether or not the root has parameters of its own: [Note: partly run
            # list groups].
            output = self._complete_incomplete_forwards(output)
        return output

    # [Note: partly run list groups]
    # A list group ``fully_shard([norm, head])`` whose forward runs only some of its
    # modules: torchtitan's chunked loss runs the root's forward up to the hidden
    # states (``norm`` but not ``head``), then ``head`` on its own per chunk, a
    # backward per chunk, and the hidden states' backward last. As torch's FSDP2:
    # 1. the root's post-forward completes the group (`_complete_incomplete_forwards`,
    #    also for a root without parameters of its own): reshard, and a pre-backward
    #    on the root's output, so the hidden states' backward re-gathers it;
    # 2. a module run on its own starts the group's forward (all-gather, post-backward
    #    node on its inputs) but does not complete it: no reshard, no pre-backward on
    #    its output, so each chunk's all-gather is reused by nothing else;
    # 3. each chunk's backward reduces the group's grads at that post-backward node,
    #    and since no pre-backward queued the end-of-backward callback, the
    #    post-backward queues `land_gradients` alone: the grads land before that
    #    backward returns, and the iteration's forward order (the hidden states'
    #    backward prefetch) and step guard stay for the backward still to come.

    def _complete_incomplete_forwards(self, output: Any) -> Any:
        """At the end of the root's forward, complete every list group whose forward ran
        only some of its modules (torch's ``_force_complete_incomplete_states``, in the
        same order): reshard it per ``reshard_after_forward`` and register its
        pre-backward on the root's output, so its backward re-gathers it."""
        for state in reversed(self.states_in_tree):
            incomplete = [g for g in state.groups if g.is_forward_incomplete()]
            if state is self or not incomplete:
                continue
            for group in incomplete:
                group.complete_forward()
            self.ctx.record_post_forward(state.groups)
            output = state._register_pre_backward(output)
        return output

    @_run_eagerly
    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        assert self.ctx is not None and self.root is not None
        if not self.ctx.is_backward_callback_queued:
            self.ctx.is_backward_callback_queued = True
            Variable._execution_engine.queue_callback(self.root.finalize_backward)
        pending = [g for g in self.groups if g.training_state != TrainingState.PRE_BACKWARD]
        if pending:
            for group in pending:
                group.pre_backward()
            # A target's groups in reverse: backward runs them last to first.
            explicit = (
                None
                if self.backward_prefetch is None
                else [g for s in self.backward_prefetch for g in reversed(s.groups)]
            )
            self.ctx.prefetch_backward(self.groups, explicit)
        return grad

    @_run_eagerly
    def post_backward(self) -> None:
        assert self.ctx is not None and self.root is not None
        # Last group first, as torch's chained per-group nodes fire.
        for group in reversed(self.groups):
            group.post_backward()
        if not (self.ctx.is_backward_callback_queued or self.ctx.is_landing_callback_queued):
            # No pre-backward of this backward queued the end-of-backward callback: a
            # list group's module run on its own ([Note: partly run list groups]).
            # The reduce-scatters just issued must still land before backward returns.
            self.ctx.is_landing_callback_queued = True
            Variable._execution_engine.queue_callback(self.root.land_gradients)

    @_run_eagerly
    def finalize_backward(self) -> None:
        """The root's end-of-backward callback, for every group in the tree."""
        assert self.ctx is not None and self.is_root
        for state in self.states_in_tree:
            for group in reversed(state.groups):
                group.finalize_backward()
        self.land_gradients()
        self.ctx.reset()

    @_run_eagerly
    def land_gradients(self) -> None:
        """Root: finish every reduction in flight, so that every sharded grad has
        landed when backward returns, as in torch (whose set_is_last_backward(False)
        only skips waiting for the device streams). The end of each backward:
        `finalize_backward`'s, or alone after a backward that no FSDP output started
        (see `post_backward`), which leaves the iteration's state to the backward
        still to come."""
        assert self.ctx is not None and self.is_root
        self.ctx.is_landing_callback_queued = False
        self.ctx.wait_for_reduce_scatters()
        # CPU offload: the host reads the sharded grads next (the optimizer, or the next
        # micro-batch's add), so their device-to-host copies must have landed, as in
        # torch whatever set_is_last_backward says.
        for state in self.states_in_tree:
            for group in state.groups:
                group.reduction.wait_for_offloaded_grads(self.ctx.streams)

    def reset_iter_state(self) -> None:
        """Recover after an exception in forward or backward (root only): the failed
        iteration's in-flight reduce-scatters and gradients are discarded."""
        if self.ctx is not None:
            self.ctx.abandon_reduce_scatters()
        for state in self.states_in_tree or [self]:
            for group in state.groups:
                group.reshard()
                group.reset_iter_state()
                group.discard_gradients()
        if self.ctx is not None:
            self.ctx.reset()

    # Hook plumbing #

    def _cast_forward_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            return cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _is_recomputing_in_backward(self) -> bool:
        # Activation checkpointing re-runs forward inside this group's backward; the
        # pre-backward hook already unsharded the group, and nothing may be registered
        # again. After the group's post-backward (reentrant AC over two forwards: the
        # first forward's region is recomputed later) it is an ordinary forward again.
        return any(g.training_state == TrainingState.PRE_BACKWARD for g in self.groups)

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not torch.is_grad_enabled():
            return args, kwargs
        inputs = grad_tensors((args, kwargs))
        if not inputs:
            return args, kwargs
        return replace_grad_tensors((args, kwargs), list(_PostBackward.apply(self, *inputs)))

    def _register_pre_backward(self, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return output
        for tensor in grad_tensors(output):
            tensor.register_hook(self.pre_backward)
        return output


class _PostBackward(torch.autograd.Function):
    """Identity in forward; its backward runs once the gradients w.r.t. the module's
    inputs are computed, i.e. after every gradient of the module's parameters."""

    @staticmethod
    def forward(ctx: Any, state: FSDPState, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.state = state
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.state.post_backward()
        return (None, *grads)


def inputs_to_device(inputs: Any, device: torch.device) -> Any:
    """Move every tensor in nested forward inputs to ``device`` (tensors in lists,
    tuples, named tuples, dicts and dataclasses), like torch's ``_to_kwargs`` for
    DDP/FSDP2."""
    return map_tensors(lambda t: t if t.device == device else t.to(device), inputs)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in nested inputs or outputs to ``dtype`` (a
    differentiable cast)."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def states_under(modules: tuple[nn.Module, ...]) -> list[FSDPState]:
    """Every distinct FSDPState in the subtrees of ``modules``, in pre-order."""
    seen: dict[int, FSDPState] = {}
    for root in modules:
        for module in root.modules():
            state = state_of(module)
            if state is not None and id(state) not in seen:
                seen[id(state)] = state
    return list(seen.values())


def max_in_flight_reduce_scatters(states: list[FSDPState]) -> int:
    """The bound of a root's tree: the largest ``set_reduce_scatter_max_input_buffers``
    over its groups, as torch resolves its per-group values (1 without any group)."""
    return max((s.max_in_flight_reduce_scatters for s in states if s.groups), default=1)


def assign_fqns(roots: tuple[nn.Module, ...], states: list[FSDPState]) -> None:
    """Name each group and parameter by its path from the root, for messages and traces
    (at fully_shard time, bottom-up, the root is not known yet)."""
    names: dict[int, str] = {}
    for root in roots:
        for name, module in root.named_modules():
            names.setdefault(id(module), name)
    for state in states:
        name = names.get(id(state.modules[0]), "")
        labels = [g.mesh_info.label for g in state.groups]
        for index, group in enumerate(state.groups):
            # Groups of one call on several meshes are told apart by their axes (and
            # their index, for axes of the same name on different meshes).
            label = (
                labels[index] if labels.count(labels[index]) == 1 else f"{labels[index]}#{index}"
            )
            group.fqn = f"{name} [{label}]".strip() if len(state.groups) > 1 else name
            for fsdp_param in group.fsdp_params:
                slot = fsdp_param.slots[0]
                prefix = names.get(id(slot.module), "")
                fsdp_param.fqn = f"{prefix}.{slot.name}" if prefix else slot.name


def _describe(modules: tuple[nn.Module, ...]) -> str:
    return ", ".join(type(m).__name__ for m in modules)
