"""FSDPModule, the class ``fully_shard`` mixes into each module it shards, with its
``set_*`` methods and ``unshard``/``reshard``, and UnshardHandle."""

import warnings
from collections.abc import Callable, Mapping
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from .api import (
    AllGather,
    CommPrecisionPolicy,
    FSDPGroupInfo,
    ReduceScatter,
)
from .graph.pending import reduce_pending
from .graph.switch import group_graphs, is_graph_mode
from .io.load_checks import validate_state_dict
from .io.state_dict import residual_states
from .observe.consistency import CollectiveCheck
from .observe.flight_recorder import FlightRecorder
from .observe.trace import CommTrace, TraceObserver
from .observe.watchdog import DEFAULT_DEADLINE, watchdog_factory
from .runtime.comm_strategies import (
    DefaultAllGather,
    DefaultReduceScatter,
    ProcessGroupAllocAllGather,
    ProcessGroupAllocReduceScatter,
    SymmMemAllGather,
    SymmMemReduceScatter,
)
from .runtime.param_group import FSDPParamGroup
from .runtime.reduction.error_feedback import attribute_tree
from .runtime.state import FSDPState, assign_fqns, max_in_flight_reduce_scatters, state_of

# Public module class #


class FSDPModule:
    """Mixed into every module passed to ``fully_shard`` (``isinstance(m, FSDPModule)``)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Instances are made by fully_shard's class swap, never constructed directly:
        # ``FSDPLinear(...)`` builds a plain Linear, as in torch.
        orig_cls = cls.__mro__[2]
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _get_fsdp_state(self) -> FSDPState:
        state = state_of(self)  # type: ignore[arg-type]
        assert state is not None, "FSDPModule without FSDP state"
        return state

    def _fsdp_states(self, recurse: bool) -> list[FSDPState]:
        if not recurse:
            return [self._get_fsdp_state()]
        seen: dict[int, FSDPState] = {}
        for module in self.modules():  # type: ignore[attr-defined]
            state = state_of(module)
            if state is not None:
                seen.setdefault(id(state), state)
        return list(seen.values())

    @property
    def _fsdp_error_feedback(self) -> SimpleNamespace:  # error_feedback.RESIDUALS_ATTR
        """This module's error-feedback residuals as state-dict values, by their params'
        keys (``module._fsdp_error_feedback.layers.0.weight``): the attribute path that
        the state-dict keys ``<module>._fsdp_error_feedback.<param key>`` name, which
        torch's ``get_state_dict`` walks. Empty without error feedback. See [Note:
        error-feedback residuals in state dicts] in error_feedback.py."""
        module: nn.Module = self  # type: ignore[assignment]
        return attribute_tree(residual_states(self._get_fsdp_state(), module))

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        """``to()``, ``to_empty()``, ``half()``, ``cuda()``...: apply to the sharded params,
        then re-derive the group's sharded state from what they became (see [Note:
        re-deriving the sharded state] in group_layout.py)."""
        self.reshard()
        result = super()._apply(*args, **kwargs)  # type: ignore[misc]
        for group in self._own_groups():
            group.reset_sharded_params()
        return result

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        # torch raises AssertionError with this wording; the sharded params are views
        # into per-group buffers and hooks close over FSDP state, neither of which a
        # generic deepcopy can rebuild.
        raise AssertionError(
            "FSDP does not support deepcopy. Please use state dict for serialization. "
            "dtensor_fsdp: build a new model, fully_shard it, and load_state_dict("
            "model.state_dict()) into it"
        )

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, atomic: keys and every value (type, device,
        shape, dtype) are checked for the whole state dict before any value is copied
        (see ``validate_state_dict``). Values may be sharded DTensors of any placement or
        plain full tensors."""
        original_name = type(self).__mro__[2].__name__  # FSDP<cls>, FSDPModule, <cls>
        validate_state_dict(self, original_name, state_dict, strict, assign)  # type: ignore[arg-type]
        return super().load_state_dict(state_dict, strict=strict, assign=assign)  # type: ignore[misc]

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones. Not recursive."""
        for group in self._own_groups():
            group.reshard()

    def unshard(self, async_op: bool = False) -> "UnshardHandle | None":
        """All-gather the parameters and register the unsharded ones. Not recursive.

        Args:
            async_op: return an ``UnshardHandle`` to wait on instead of waiting here.

        Returns:
            An ``UnshardHandle`` if ``async_op``, else ``None``.
        """
        groups = self._own_groups()
        for group in groups:
            group.unshard(async_op=async_op)
        return UnshardHandle(groups) if async_op else None

    def reset_iter_state(self) -> None:
        """After an exception in forward or backward, reshard and reset per-iteration
        state so the next iteration starts clean. Call it on the root."""
        self._get_fsdp_state().reset_iter_state()

    def run_post_backward(self) -> None:
        """Run the post-backward of every group in this module's FSDP tree now, then the
        end of backward, as when a backward finishes: gradients accumulated under
        ``set_requires_gradient_sync(False)`` are reduce-scattered (one collective per
        group, none for a group without gradients) and land on the sharded params, and
        each group reshards per ``set_reshard_after_backward``.

        dtensor_fsdp only: torch has no public name for it. torch's pipeline stages do
        the same at the end of a step through torch-internal state (each group's
        ``post_backward()``, then the root's final callback);
        ``dtensor_fsdp.pipelining.PipelineStage`` calls this instead. Call it between
        backwards, on the root or any module of its tree (it acts on the whole tree, as
        torch's does). Before the first forward it does nothing (torch's internal calls
        raise ``AttributeError`` there); with nothing accumulated (a second call
        included) it issues no collective, as torch's.
        """
        root = self._get_fsdp_state().root
        if root is None:
            return  # no forward yet: nothing was accumulated
        if is_graph_mode(root.modules[0]):
            reduce_pending(group_graphs(root.modules[0]))
            return
        groups: dict[int, FSDPParamGroup] = {}
        for module in root.modules:  # pre-order, root first: torch's order of states
            for group in module._groups(recurse=True):  # type: ignore[attr-defined]
                groups.setdefault(id(group), group)
        for group in groups.values():
            group.post_backward()
        root.finalize_backward()

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last before the optimizer step. Accepted as
        torch's is; it changes nothing here: every sharded grad has landed when any
        backward returns (on an accelerator that is a stream wait, which does not block
        the host, so there is nothing to skip), and CPU-offloaded grads are on the host,
        as torch makes them whatever this says."""
        del is_last_backward
        self._get_fsdp_state()  # the same error as torch's on a module without state

    def _warn_if_graph_mode(self, setter: str) -> None:
        """Graph mode reads the settings when it is enabled (dtensor_fsdp/graph)."""
        if is_graph_mode(self):
            warnings.warn(
                f"{type(self).__name__} is in graph mode, which read its settings when it "
                f"was enabled: {setter} takes effect once dtensor_fsdp.compile (or "
                "enable_graph_mode) runs again",
                stacklevel=3,
            )

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Whether backward reduce-scatters gradients. ``False`` accumulates unsharded
        gradients locally (gradient accumulation without communication)."""
        for group in self._groups(recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces gradients over the replicate axis. ``False``
        still reduce-scatters within the shard axis and keeps the partial result, which
        the next backward with all-reduce adds in (gradient accumulation across nodes
        at intra-node cost). No effect on a 1-D mesh. Read at every forward in graph
        mode (dtensor_fsdp/graph), as ``set_requires_gradient_sync``."""
        for group in self._groups(recurse):
            group.reduction.update(requires_all_reduce=requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after forward (to the full mesh:
        it replaces an int ``reshard_after_forward``, as torch's). Set before the first
        forward, it holds for the root too, which otherwise keeps its parameters."""
        self._warn_if_graph_mode("set_reshard_after_forward")
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be a bool, got {reshard_after_forward!r}")
        for state in self._fsdp_states(recurse):
            state.auto_reshard_after_forward = False
            for group in state.groups:
                group.reshard_after_forward = reshard_after_forward
                group.post_forward_mesh_info = None

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Whether to free the unsharded parameters after backward. ``False`` keeps them
        for the next forward (gradient accumulation without re-all-gathering)."""
        for group in self._groups(recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters right after this module's, in forward."""
        self._get_fsdp_state().forward_prefetch = [_state_for_prefetch(m) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """All-gather these modules' parameters right after this module's, in backward,
        instead of the default (the module that ran before this one in forward). An
        empty list restores the default, as in torch."""
        states = [_state_for_prefetch(m) for m in modules]
        self._get_fsdp_state().backward_prefetch = states or None

    def set_reduce_scatter_max_input_buffers(
        self, max_input_buffers: int, *, recurse: bool = True
    ) -> None:
        """Sets how many gradient reduce-scatter input buffers may be in flight at once.

        Each group's reduce-scatter input (its gradients, copied into one buffer) lives
        until the reduce-scatter is waited. With ``k`` buffers, the oldest in flight is
        waited before the next group allocates its own, so at most ``k`` exist at once
        and a group's reduce-scatter may overlap the backward of the next ``k`` groups.
        The default, ``1`` as in torch's FSDP2, overlaps each reduce-scatter with the
        next group's backward; a larger value helps only when one reduce-scatter
        outlasts the next group's whole backward, at the cost of one more group gradient
        buffer per step of ``k`` (see benchmarks/README.md, ``bench_inflight.py``).

        The whole root's tree uses the largest value set on any of its modules, as in
        torch. Unlike torch, which reads it once at the first forward, a later call
        also takes effect (from the next reduce-scatter).

        Args:
            max_input_buffers (int): reduce-scatter input buffers in flight, ``>= 1``.
            recurse (bool): Whether to set for all FSDP submodules or just this one.

        Raises:
            TypeError: ``max_input_buffers`` is not an int (a bool included).
            ValueError: ``max_input_buffers`` is below 1.
        """
        # bool is an int subclass: True must not silently mean 1.
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(
                f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}: "
                "pass the number of reduce-scatters in flight, e.g. 1 (the default)"
            )
        if max_input_buffers < 1:
            raise ValueError(
                f"max_input_buffers must be a positive int, got {max_input_buffers}: use 1 "
                "(the default: wait for each reduce-scatter before the next is issued) or more"
            )
        for state in self._fsdp_states(recurse):
            state.max_in_flight_reduce_scatters = max_input_buffers
            root = state.root
            if root is not None and root.ctx is not None:
                root.ctx.max_in_flight_reduce_scatters = max_in_flight_reduce_scatters(
                    root.states_in_tree
                )

    def set_comm_trace(self, trace: CommTrace | None) -> None:
        """Record every collective and lifecycle step of this module's tree into
        ``trace`` (``None`` stops recording), named by their paths from this module.
        dtensor_fsdp only: not in torch."""
        states = self._fsdp_states(recurse=True)
        assign_fqns((self,), states)  # type: ignore[arg-type]
        observer = TraceObserver(trace) if trace is not None else None
        for group in self._groups(recurse=True):
            group.set_observer("trace", observer)

    def describe_groups(self, recurse: bool = True) -> list[FSDPGroupInfo]:
        """Describe the parameter groups of this module's ``fully_shard`` call, and with
        ``recurse`` those of every call in its tree (each once, in ``modules()`` order):
        their names in ``CommTrace`` events, modules, sizes and reshard setting. Reads
        only: it issues nothing and works on meta and fake tensors too. dtensor_fsdp
        only: not in torch.

        Returns:
            One ``FSDPGroupInfo`` per group.
        """
        return [_describe(group) for group in self._groups(recurse)]

    def set_divergence_check(
        self, enabled: bool = True, *, timeout: timedelta | float | None = None
    ) -> None:
        """Before every FSDP collective of this root's tree, check that all ranks are
        about to issue the same one (same module, phase, kind, size and sequence
        number), so control flow that diverges between ranks raises
        ``CollectiveMismatchError`` on every rank, naming what each rank was about to
        do, instead of aborting (gloo) or hanging (NCCL). Costs one small synchronous
        all-gather per collective. Call it on the root, on every rank. dtensor_fsdp
        only: not in torch.

        Args:
            enabled: switch the check on or off, from the next collective on.
            timeout: how long (seconds or a ``timedelta``) a rank waits for the others
                at one check before raising; ``None``: the process group's timeout.
                A short one also fails legitimately slow ranks (a long evaluation or
                checkpoint on one rank while the others start the next step).
        """
        if isinstance(timeout, (int, float)):
            timeout = timedelta(seconds=timeout)
        state = self._root_state_for_checks()
        checks = state.check
        finite_grads = isinstance(checks, CollectiveCheck) and checks.finite_grads
        state.set_check(_collective_check(state, enabled, finite_grads, timeout))

    def set_nonfinite_grad_check(self, enabled: bool = True) -> None:
        """Before each reduce-scatter of this root's tree, check every rank's unsharded
        gradients for NaN/Inf; if any rank has one, every rank raises
        ``NonFiniteGradError`` naming, per offending rank, the first such parameter,
        before the reduction spreads it to every rank. Off by default: it costs a
        max-abs per gradient and one small all-gather per reduce-scatter, and fp16
        training with a GradScaler expects (and skips) occasional Infs. Call it on the
        root, on every rank. dtensor_fsdp only: not in torch."""
        state = self._root_state_for_checks()
        checks = state.check
        signatures = isinstance(checks, CollectiveCheck) and checks.signatures
        timeout = checks.timeout if isinstance(checks, CollectiveCheck) else None
        state.set_check(_collective_check(state, signatures, enabled, timeout))

    def set_collective_watchdog(
        self, enabled: bool = True, *, deadline: timedelta | float = DEFAULT_DEADLINE
    ) -> None:
        """Bound how long a rank waits in an FSDP collective. On by default, with a
        60 s deadline: every rank records its FSDP collectives in a ring buffer (no
        communication, no store call: under 1% of a step's host calls), and a host
        wait that lasts ``deadline`` makes every rank publish its records through the
        c10d store and compare them. Only positive evidence is an error: diverged
        ranks (a block skipped, a parameter unused on some ranks only) raise
        ``CollectiveMismatchError`` on every rank, naming which rank diverged, where
        (module, phase, step) and what each rank was doing; a wait the backend failed
        (a rank it killed, its own timeout) is logged at once and raises, naming the
        ranks that stopped answering. A rank that gives no answer (busy in a call that
        holds the GIL) or is merely behind gets a ``CollectiveStragglerWarning`` and
        the wait goes on, up to the process group's own timeout. The
        wait is bounded on the host (CPU tensors: gloo); on an accelerator, where the
        wait is a stream wait, a thread polls the works in flight and, past the
        deadline, compares the records the same way and aborts the process group on
        an error (NCCL; not yet run on a GPU: docs/observe.md). Call it on the
        root, on every rank, in the same order. dtensor_fsdp only: torch's FSDP2 waits
        for the backend's timeout (``set_divergence_check`` is the strict check before
        every collective).

        Args:
            enabled: record and watch (``True``, the default) or neither.
            deadline: how long (seconds or a ``timedelta``) a host waits in one
                collective before the ranks compare records. Far below the process
                group's timeout (NCCL's default is 10 minutes); long enough for a
                legitimately slow collective, which only draws a warning anyway.

        Raises:
            ValueError: ``deadline`` is not positive.
        """
        if isinstance(deadline, (int, float)):
            deadline = timedelta(seconds=deadline)
        if deadline <= timedelta(0):
            raise ValueError(
                f"set_collective_watchdog: deadline must be positive, got {deadline}: pass "
                "seconds, e.g. 60.0 (the default), or set_collective_watchdog(False)"
            )
        state = self._root_state_for_checks()
        state.make_watchdog = watchdog_factory(deadline) if enabled else None
        if state.ctx is None:
            return  # lazy init builds it
        if isinstance(state.watchdog, FlightRecorder) and state.watchdog.stop_watchdog:
            state.watchdog.stop_watchdog()
        state.set_watchdog(state.make_watchdog(state) if state.make_watchdog else None)

    def _root_state_for_checks(self) -> FSDPState:
        # Before lazy init the root is not known yet: it reads its own settings then.
        state = self._get_fsdp_state()
        if state.ctx is not None and not state.is_root:
            raise ValueError(
                "set_divergence_check / set_nonfinite_grad_check / set_collective_watchdog "
                "apply to a whole FSDP "
                "tree: call them on its root module, the one whose forward runs first"
            )
        return state

    def set_comm_precision(
        self, policy: CommPrecisionPolicy | None, *, recurse: bool = True
    ) -> None:
        """Quantized communication: what the all-gather and the gradient reduction carry
        for this module's groups (``recurse``: and every FSDP module under it) from the
        next collective on; ``None`` communicates exactly again. Per-group opt-out: call
        it with ``None`` on a submodule after setting it on the root. dtensor_fsdp only:
        not in torch.

        Raises:
            TypeError: ``policy`` is not a ``CommPrecisionPolicy`` or None.
        """
        if policy is not None and not isinstance(policy, CommPrecisionPolicy):
            raise TypeError(
                f"set_comm_precision expects a CommPrecisionPolicy or None, got {policy!r}"
            )
        for group in self._groups(recurse):
            group.set_comm_precision(policy)

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Run this group's all-gathers with ``comm``, which also allocates their output.
        Not recursive. ``comm`` receives 1-D uint8 tensors (the group's shards as bytes)
        and is called with ``async_op=True``; it must return a ``Work``.

        Raises:
            ValueError: the module's call made groups on several meshes, as torch's.
        """
        for group in self._single_mesh_groups("set_custom_all_gather"):
            group.set_all_gather_comm(comm)

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Run this group's reduce-scatters with ``comm``, which also allocates their
        output. Not recursive. ``comm`` gets a 1-D input of W equal chunks and
        ``ReduceOp.SUM``; FSDP divides afterwards.

        Raises:
            ValueError: the module's call made groups on several meshes, as torch's.
        """
        for group in self._single_mesh_groups("set_custom_reduce_scatter"):
            group.reduction.update(strategy=comm)

    def set_all_reduce_hook(
        self, hook: Callable[[torch.Tensor], None], *, stream: Any = None
    ) -> None:
        """Call ``hook(reduce_output)`` on this group's reduced gradients, in place,
        before they land on ``.grad``: the reduce-scatter output (FSDP) or the
        all-reduce output (HSDP), 1-D. Not recursive.

        Args:
            hook: ``hook(reduce_output) -> None``; ``None`` removes it.
            stream: on an accelerator, the stream to run the hook on: it waits for the
                reduction, and the gradients land after the hook. As in torch, it stays
                set until another ``stream`` is given, and is refused for native HSDP
                (there the hook runs where the all-reduce's result is read). On the host
                (CPU, gloo) there are no streams and it changes nothing.

        Raises:
            ValueError: ``stream`` with a 2-D (HSDP) mesh; ``stream`` without a hook
                (also an ``AssertionError``, torch's type, which torch raises at the
                first backward); the module's call made groups on several meshes, as
                torch's.
        """
        groups = self._single_mesh_groups("set_all_reduce_hook")
        if stream is not None and any(g.mesh_info.is_hsdp for g in groups):
            raise ValueError(
                "stream cannot be set when using native HSDP: the hook runs after the "
                "replicate all-reduce; call set_all_reduce_hook(hook) without stream"
            )
        if stream is not None and hook is None:
            raise SetterError(
                "all reduce hook stream is specified but hook itself is missing: pass the "
                "hook with its stream, or neither"
            )
        for group in groups:
            group.reduction.update(hook=hook)
            if stream is not None:
                group.reduction.all_reduce_hook_stream = stream

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Give the root an event marking the end of the optimizer step, to wait on
        before its next forward's all-gathers; used once, then discarded.

        dtensor_fsdp issues all-gathers from the current stream, which already runs
        after the optimizer step, so waiting on the event adds no ordering; it is
        accepted so code written for torch's FSDP2 runs unchanged.
        """
        self._get_fsdp_state().post_optim_event = event

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        self.set_gradient_divide_factor(factor)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size
        (e.g. 1.0 when the loss is already a global mean). Not recursive, as torch's:
        torchtitan calls it on every FSDP module."""
        self._warn_if_graph_mode("set_gradient_divide_factor")
        if factor <= 0:
            raise ValueError(f"gradient divide factor must be positive, got {factor}")
        for group in self._own_groups():
            group.reduction.update(gradient_divide_factor=factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only ever ask collectives to SUM (no AVG or PREMUL_SUM), dividing separately.
        Not recursive, as torch's. On gloo this is always the case."""
        self._warn_if_graph_mode("set_force_sum_reduction_for_comms")
        for group in self._own_groups():
            group.reduction.update(force_sum_reduction=enable)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Reduce-scatter zeros for trainable parameters that got no gradient, so ranks
        that used different parameters (conditional compute, MoE) still issue the same
        collective. Like DDP's ``find_unused_parameters``."""
        self._warn_if_graph_mode("set_reduce_scatter_unused_params")
        for group in self._groups(recurse):
            group.reduction.update(reduce_unused=reduce_scatter_unused_params)

    def set_separate_reduce_scatter_group(
        self, enable: bool = True, *, recurse: bool = True
    ) -> None:
        """Run gradient reduce-scatters on a process group of their own (``True``), or
        on the shard group shared with the all-gathers again (``False``).

        One communicator runs one collective at a time, so on the shared group a
        backward all-gather waits for the reduce-scatter issued before it (and vice
        versa); on two groups over the same ranks they can progress concurrently, as
        far as the network allows. As in torch, one new group is created per set of
        shard ranks (``dist.new_group(ranks, use_local_synchronization=True)``) and
        shared by the groups of one call; a group already separate keeps its own. This
        is collective for the shard ranks: call it on every rank, in the same order.
        Any backend (on gloo the reduction is an all-to-all on the new group). HSDP's
        replicate all-reduce keeps its group.

        Args:
            enable: ``True`` gives the reduce-scatters their own process group;
                ``False`` returns them to the shard group.
            recurse: for every FSDP module under this one, or just this one.
        """
        new_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        for group in self._groups(recurse):
            group.reduction.set_separate_reduce_scatter_group(enable, new_groups)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate this module's all-gather and reduce-scatter buffers with the process
        group's own allocator (``enable=True``), where its backend has one (NCCL's, for
        zero-copy transfers over NVLink SHARP or InfiniBand), else as usual: gloo has
        none, so on the host this changes nothing, as torch's. ``False`` returns to the
        caching allocator. Not recursive. As torch's, it cannot follow a custom
        all-gather or reduce-scatter, nor ``set_symm_mem_for_comm`` (whose strategies
        torch takes for custom ones); graph mode runs these strategies as opaque ops.

        Args:
            enable: whether to allocate from the process group.

        Raises:
            ValueError: this module's all-gather or reduce-scatter is a custom one
                (``set_custom_all_gather``, ``set_custom_reduce_scatter``,
                ``set_symm_mem_for_comm``), which allocates its own buffers; also an
                ``AssertionError``, as in torch.
        """
        groups = self._own_groups()
        method = "set_allocate_memory_from_process_group()"
        self._refuse_comms(groups, method, (DefaultAllGather, ProcessGroupAllocAllGather),
                           (DefaultReduceScatter, ProcessGroupAllocReduceScatter))  # fmt: skip
        for group in groups:
            if enable:
                group.set_all_gather_comm(ProcessGroupAllocAllGather(group.mesh_info.shard_group))
                strategy = ProcessGroupAllocReduceScatter(group.reduction.reduce_scatter_group)
            else:
                group.set_all_gather_comm(DefaultAllGather())
                strategy = DefaultReduceScatter()
            group.reduction.update(strategy=strategy)

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Allocate this module's all-gather buffers (and, with
        ``set_force_sum_reduction_for_comms(True)``, its reduce-scatter buffers) in
        symmetric memory, so that NCCL can run its copy-engine or symmetric-kernel
        all-gather. Not recursive. As torch's: a torch build without symmetric memory
        (a CPU one) raises ``RuntimeError``; it cannot follow a custom all-gather or
        reduce-scatter, nor ``set_allocate_memory_from_process_group_for_comm``. It is a
        collective over each group's ranks (a barrier, as torch's).

        Args:
            backend: the symmetric memory backend: ``"NCCL"`` (torch documents only
                it; ``"CUDA"`` and ``"NVSHMEM"`` are torch's other names).

        Raises:
            ValueError: ``backend`` is none of those (also a ``RuntimeError``, as in
                torch); a custom all-gather or reduce-scatter is set on this module (also
                an ``AssertionError``, as in torch).
            RuntimeError: this torch build has no symmetric memory ``backend``.
        """
        if backend not in _SYMMETRIC_MEMORY_BACKENDS:
            raise SymmetricMemoryBackendError(
                f"SymmetricMemory does not find allocation backend {backend}: pass "
                f"one of {_SYMMETRIC_MEMORY_BACKENDS} (torch's FSDP2 documents 'NCCL')"
            )
        groups = self._own_groups()
        self._refuse_comms(groups, "set_symm_mem()", (DefaultAllGather, SymmMemAllGather),
                           (DefaultReduceScatter, SymmMemReduceScatter))  # fmt: skip
        # Every strategy first (on a build without symmetric memory the first raises),
        # then set: nothing half-installed.
        all_gathers = [SymmMemAllGather(g.mesh_info.shard_group, backend) for g in groups]
        reduce_scatters = [
            SymmMemReduceScatter(g.reduction.reduce_scatter_group, backend)
            if g.reduction.force_sum_reduction
            else None
            for g in groups
        ]
        for group, all_gather, reduce_scatter in zip(groups, all_gathers, reduce_scatters):
            group.set_all_gather_comm(all_gather)
            if reduce_scatter is not None:
                group.reduction.update(strategy=reduce_scatter)

    def _refuse_comms(
        self,
        groups: list[FSDPParamGroup],
        method: str,
        all_gathers: tuple[type, ...],
        reduce_scatters: tuple[type, ...],
    ) -> None:
        """torch's check: ``method`` may replace only the strategies in its own family."""
        for group in groups:
            for kind, comm, allowed in (
                ("all gather", group.all_gather_comm, all_gathers),
                ("reduce scatter", group.reduction.reduce_scatter_comm, reduce_scatters),
            ):
                if not isinstance(comm, allowed):
                    raise SetterError(
                        f"cannot call {method} when {kind} comm is custom: "
                        f"{type(comm).__name__}. A custom {kind} allocates its own buffers"
                    )

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this group's parameters. ``False`` skips the backward
        all-gather (an expert setting, e.g. an embedding). Not recursive."""
        for group in self._own_groups():
            group.unshard_in_backward = unshard_in_backward

    def _own_groups(self) -> list[FSDPParamGroup]:
        return list(self._get_fsdp_state().groups)

    def _single_mesh_groups(self, method: str) -> list[FSDPParamGroup]:
        """This module's groups, refused when they are on several meshes: a custom
        collective or hook is written for one process group (torch's check)."""
        groups = self._own_groups()
        if len(groups) > 1:
            raise ValueError(
                f"{method} is not supported with multiple param groups (from per-param "
                "mesh via shard_placement_fn): the custom comm would be ambiguous across "
                f"groups with different meshes (axes {[g.mesh_info.label for g in groups]})"
            )
        return groups

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [g for s in self._fsdp_states(recurse) for g in s.groups]


# torch 2.13's symmetric memory allocation backends (torch.distributed._symmetric_memory).
_SYMMETRIC_MEMORY_BACKENDS = ("NCCL", "CUDA", "NVSHMEM")


class SetterError(ValueError, AssertionError):
    """An ``FSDPModule.set_*`` call torch's FSDP2 refuses with an AssertionError. A
    ValueError (a user mistake), and an AssertionError: torch's type."""


class SymmetricMemoryBackendError(ValueError, RuntimeError):
    """``set_symm_mem_for_comm`` with an unknown backend. A ValueError (a user mistake),
    and a RuntimeError: what torch's symmetric memory raises for it."""


def _describe(group: FSDPParamGroup) -> FSDPGroupInfo:
    post_forward = group.post_forward_mesh_info
    return FSDPGroupInfo(
        fqn=group.fqn,
        modules=tuple(group.modules),
        numel=sum(p.sharded_param.numel() for p in group.fsdp_params),  # DTensor: global
        unsharded_nbytes=group.mesh_info.shard_size
        * sum(p.all_gather_nbytes for p in group.fsdp_params),
        shard_size=group.mesh_info.shard_size,
        replicate_size=group.mesh_info.replicate_size,
        reshard_after_forward=(
            post_forward.shard_size if post_forward is not None else group.reshard_after_forward
        ),
    )


def _collective_check(
    root: FSDPState, signatures: bool, finite_grads: bool, timeout: timedelta | None
) -> CollectiveCheck | None:
    """The root's checks before collectives (observe/consistency.py), if any is on. A
    new one per setter call, on every rank alike: the sequence numbers restart."""
    if not (signatures or finite_grads):
        return None
    return CollectiveCheck(
        signatures=signatures,
        finite_grads=finite_grads,
        # Read when naming what other ranks sent, after lazy init: the tree is known.
        fqns=lambda: [g.fqn for s in root.states_in_tree for g in s.groups],
        on_failure=root.reset_iter_state,
        timeout=timeout,
    )


def _state_for_prefetch(module: Any) -> FSDPState:
    state = state_of(module) if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"prefetch targets must be modules passed to fully_shard, got {type(module).__name__}"
        )
    return state


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, groups: list[FSDPParamGroup]) -> None:
        self._groups = groups

    def wait(self) -> None:
        """Wait for the all-gathers and register the unsharded parameters."""
        for group in self._groups:
            group.wait_for_unshard()
        self._groups = []
