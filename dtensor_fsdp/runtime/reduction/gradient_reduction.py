"""GradientReduction: one group's gradients, from unsharded grads to sharded ``.grad``.

Post-backward has it take the group's unsharded grads (zeros for unused parameters if
asked), reshards, then has it pack them into one reduce-scatter (torch's order: the
unsharded params are freed before the reduce-scatter input exists). When the CommContext
finishes that collective, it reduces over HSDP's replicate axis (one all-reduce, or a
partial sum kept for later with ``set_requires_all_reduce(False)``), divides once by the
data parallel world size (or the user's factor), runs the user's all-reduce hook and
lands each parameter's chunk on its sharded ``.grad``.

Each job has its own module: reduce_scatter.py (the issue), replica.py (HSDP's
replicate axis), error_feedback.py, landing.py (divide, hook, ``.grad``); the
arithmetic is comm_math.py's, shared with graph mode; this class holds the ``set_*``
knobs, describes each reduction from them (comm_description.py) and keeps the order.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...api import CommPrecisionPolicy, CPUOffloadPolicy, ReduceScatter
from ..comm_context import CommContext
from ..comm_description import (
    ReductionDescription,
    ReductionSettings,
    describe_reduction,
    quantizes_reduction,
)
from ..comm_strategies import DefaultReduceScatter, is_custom
from ..mesh import MeshInfo
from ..observer import (
    Collective,
    Observers,
    UnshardedGrads,
    Watches,
    begin_wait,
    end_wait,
    observe_issue,
    wait_work,
)
from ..param import FSDPParam
from ..streams import CommStreams, StreamRole
from .error_feedback import ErrorFeedback
from .landing import land_sharded_grads, split_reduced
from .reduce_scatter import (
    IssuedReduceScatter,
    collect_grads,
    finish_any_reduce_scatter,
    issue_reduce_scatter,
)
from .replica import (
    ReplicaAllReduce,
    finish_replica_all_reduce,
    issue_replica_all_reduce,
    take_replica_parts,
)


class GradientReduction:
    """Reduces one group's gradients; holds the reduction's ``FSDPModule.set_*`` knobs
    (`settings`, replaced whole by `update`) and describes each reduction from them."""

    def __init__(
        self,
        fsdp_params: list[FSDPParam],
        mesh_info: MeshInfo,
        offload: CPUOffloadPolicy | None,
    ) -> None:
        """
        Args:
            fsdp_params: the group's parameters, in its buffer order.
            mesh_info: the group's data-parallel mesh.
            offload: CPU offload's policy, if on: the sharded grads land in host memory.
        """
        self.fsdp_params = fsdp_params
        self.mesh_info = mesh_info
        self.offload = offload
        # CPU offload on an accelerator: the event after this backward's asynchronous
        # device-to-host grad copies; the host waits for it at the end of backward.
        self.offload_event: object | None = None
        self.settings = ReductionSettings(
            shard_group=mesh_info.shard_group,
            replicate_group=mesh_info.replicate_group if mesh_info.is_hsdp else None,
            shard_size=mesh_info.shard_size,
            replicate_size=mesh_info.replicate_size,
            device=mesh_info.device,
            gradient_divide_factor=None,
            force_sum_reduction=False,
            strategy=DefaultReduceScatter(),
            policy=None,
            requires_all_reduce=True,  # HSDP: all-reduce over the replicate axis
            hook=None,
            offload=offload is not None,
            reduce_unused=False,
        )
        # set_all_reduce_hook(stream=): the accelerator stream the hook runs on; None: the
        # current one. Unused on the host.
        self.all_reduce_hook_stream: object | None = None
        # set_separate_reduce_scatter_group: a process group over the shard ranks for the
        # reduce-scatters alone; None: the shard group, shared with the all-gathers.
        self.separate_reduce_scatter_group: dist.ProcessGroup | None = None
        # The last description, with the settings and params it describes: a backward
        # like the last one (the usual case) reuses it.
        self._described: tuple[ReductionSettings, list[FSDPParam], ReductionDescription] | None
        self._described = None
        # Its residuals are also state-dict entries (see [Note: error-feedback residuals
        # in state dicts] in error_feedback.py).
        self.error_feedback = ErrorFeedback()

    # Settings #

    def update(self, **changes: Any) -> None:
        """Replace some of the settings (`ReductionSettings`' fields)."""
        self.settings = dataclasses.replace(self.settings, **changes)

    @property
    def requires_all_reduce(self) -> bool:
        return self.settings.requires_all_reduce

    @property
    def gradient_divide_factor(self) -> float | None:
        return self.settings.gradient_divide_factor

    @property
    def force_sum_reduction(self) -> bool:
        return self.settings.force_sum_reduction

    @property
    def reduce_scatter_comm(self) -> ReduceScatter:
        """The group's reduce-scatter strategy (comm_strategies.py)."""
        return self.settings.strategy

    @property
    def custom_reduce_scatter(self) -> ReduceScatter | None:
        """A user's ``set_custom_reduce_scatter`` strategy, if set."""
        strategy = self.settings.strategy
        return strategy if is_custom(strategy) else None

    @property
    def all_reduce_hook(self) -> Callable[[torch.Tensor], None] | None:
        return self.settings.hook

    @property
    def reduce_scatter_unused_params(self) -> bool:
        return self.settings.reduce_unused

    @property
    def comm_precision(self) -> CommPrecisionPolicy | None:
        return self.settings.policy

    @property
    def reduce_scatter_group(self) -> dist.ProcessGroup:
        """The process group the gradient reduce-scatters (and their checks) run on."""
        return self.settings.shard_group

    def set_separate_reduce_scatter_group(
        self, enable: bool, new_groups: dict[tuple[int, ...], dist.ProcessGroup]
    ) -> None:
        """Give the reduce-scatters their own process group over the shard ranks (see
        ``FSDPModule.set_separate_reduce_scatter_group``), or with ``enable=False`` the
        shard group back. ``new_groups`` (shard ranks -> group) is shared by one call's
        groups, so groups sharding over the same ranks share one new process group."""
        if not enable:
            self.separate_reduce_scatter_group = None
            self.update(shard_group=self.mesh_info.shard_group)
            return
        ranks = tuple(dist.get_process_group_ranks(self.mesh_info.shard_group))
        if ranks not in new_groups:
            # Enabled already: keep that group. Otherwise only this rank set's members
            # create it (HSDP: each replica its own), hence local synchronization.
            new_groups[ranks] = (
                self.separate_reduce_scatter_group
                if self.separate_reduce_scatter_group is not None
                else dist.new_group(
                    list(ranks), use_local_synchronization=True, group_desc="fsdp_reduce_scatter"
                )
            )
        self.separate_reduce_scatter_group = new_groups[ranks]
        self.update(shard_group=self.separate_reduce_scatter_group)

    def set_comm_precision(self, policy: CommPrecisionPolicy | None) -> None:
        self.update(policy=policy)
        self.error_feedback.clear()

    def discard_error_feedback(self) -> None:
        """After a failed iteration: its errors belong to gradients never applied."""
        self.error_feedback.zero()

    def error_feedback_params(self) -> list[FSDPParam]:
        """The params whose reduce-scatter keeps an error-feedback residual under the
        current policy (those it quantizes), in the group's order."""
        settings = self.settings
        policy = settings.policy
        if policy is None or not policy.error_feedback:
            return []
        return [
            p
            for p in self.fsdp_params
            if quantizes_reduction(
                policy,
                p,
                replicate_leg=False,
                strategy=settings.strategy,
                shard_size=settings.shard_size,
            )
        ]

    def describe(self, params: list[FSDPParam]) -> ReductionDescription:
        """The reduction of ``params``' gradients under the current settings: the last
        one if neither changed since (comm_description.py)."""
        described = self._described
        if described is not None and described[0] is self.settings and described[1] == params:
            return described[2]
        description = describe_reduction(self.settings, params)
        self._described = (self.settings, list(params), description)
        return description

    def forget_description(self) -> None:
        """The params' dtypes changed (`FSDPParamGroup.reset_sharded_params`)."""
        self._described = None

    # Runtime #

    def take_grads(self) -> tuple[list[FSDPParam], list[torch.Tensor]]:
        """The group's params with a grad to reduce, and their unsharded grads (taken
        from the params: post-backward reshards before `reduce_scatter` allocates its
        input, as torch's does, so the unsharded params are freed first)."""
        return collect_grads(self.fsdp_params, self.reduce_scatter_unused_params)

    def reduce_scatter(
        self,
        ctx: CommContext,
        fqn: str,
        taken: tuple[list[FSDPParam], list[torch.Tensor]],
        observers: Observers,
        make_room: bool = True,
    ) -> None:
        """Issue one reduce-scatter of the grads `take_grads` took from the group
        (``fqn``); the grads are freed once copied into its input. ``ctx`` finishes it
        (waits, reduces over replicas, lands the sharded grads) when its turn comes.
        ``observers``: the group's (runtime/observer.py), which also see the HSDP
        all-reduce that follows. ``make_room``: whether to wait for the oldest in
        flight first (False for the groups of a call on several meshes but the first
        to reduce)."""
        with_grad, grads = taken
        if not with_grad:
            return
        # Wait for the oldest in flight before this group's buffer exists: at most
        # max_in_flight_reduce_scatters of them at once (see [Note: reduce-scatters in
        # flight]).
        if make_room:
            ctx.make_room_for_reduce_scatter()
        description = self.describe(with_grad)
        watches: Watches = ()
        if observers:
            taken_grads = UnshardedGrads(
                [p.fqn for p in with_grad], grads, description.reduce_dtype
            )
            watches = observe_issue(
                observers, self._describe_reduce_scatter(fqn, ctx.streams, taken_grads)
            )
        residuals = (
            self.error_feedback.residuals(with_grad, description.quantized)
            if description.error_feedback
            else None
        )
        result = issue_reduce_scatter(grads, description, self.reduce_scatter_group, residuals)
        # HSDP: the all-reduce stream reads what compute wrote up to here (the
        # reduce-scatter input, which is its output at shard size 1; earlier partial
        # sums) and waits for this event first: a Work orders only the collective.
        written = ctx.streams.record_compute() if self.mesh_info.is_hsdp else None
        issued = IssuedReduceScatter(
            result, with_grad, description, fqn, observers, watches, written
        )
        ctx.enqueue_reduce_scatter(
            lambda: self._finish(issued, ctx),
            lambda: result.work.wait() if result.work is not None else None,
        )

    def _finish(self, issued: IssuedReduceScatter, ctx: CommContext) -> None:
        if issued.description.all_reduce:
            self._issue_all_reduce(issued, ctx)
            return
        self._wait_reduce_scatter(issued)  # on an accelerator, compute waits
        reduced = finish_any_reduce_scatter(issued.result)  # (sum of padded chunk numels,)
        if not self.mesh_info.is_hsdp:
            self._land(issued.params, reduced, issued.description, ctx.streams)
            return
        for fsdp_param, chunk in zip(
            issued.params, split_reduced(reduced, issued.params), strict=True
        ):
            fsdp_param.accumulate_partial_grad(chunk)

    def _wait_reduce_scatter(self, issued: IssuedReduceScatter) -> None:
        result = issued.result
        if result.work is None and self.mesh_info.shard_size == 1:
            return  # nothing was issued (one rank)
        if issued.watches:
            begin_wait(issued.watches)
        if result.work is not None:
            wait_work(result.work, issued.watches)
        if issued.watches:
            end_wait(issued.watches, result.input_nbytes, "backward")

    def _issue_all_reduce(self, issued: IssuedReduceScatter, ctx: CommContext) -> None:
        """HSDP: once the reduce-scatter is done, issue the all-reduce over replicas on
        its own stream; it is in flight while backward goes on, and the gradients land
        when the CommContext finishes it (the bounded queue, or the end of backward)."""
        streams = ctx.streams
        with streams.on(StreamRole.ALL_REDUCE):
            # The all-reduce stream waits for the reduce-scatter and what compute wrote
            # before it, not for the compute queued since.
            streams.wait_for_event(StreamRole.ALL_REDUCE, issued.written_event)
            self._wait_reduce_scatter(issued)
            reduced = finish_any_reduce_scatter(issued.result)
            pending = self._all_reduce_over_replicas(
                dict(zip(issued.params, split_reduced(reduced, issued.params), strict=True)),
                average=issued.result.ops.average_in_all_reduce,
                policy=issued.description.policy,
                observers=issued.observers,
                fqn=issued.fqn,
                ctx=ctx,
            )
        # Compute frees what the all-reduce stream read: the reduce-scatter's buffers and
        # the partial sums of micro-batches without all-reduce.
        streams.join(StreamRole.ALL_REDUCE)
        # The closure holds the description, not `issued`: that would keep the
        # reduce-scatter's input (and output) alive until the all-reduce lands, two
        # inputs at once.
        description = issued.description
        ctx.enqueue_all_reduce(
            lambda: self._land_all_reduced(pending, description, streams), pending.wait
        )

    def _land_all_reduced(
        self, pending: ReplicaAllReduce, description: ReductionDescription, streams: CommStreams
    ) -> None:
        params, reduced = finish_replica_all_reduce(pending)  # read on the compute stream
        # The all-reduce stream may reuse its buffers once compute has read them.
        streams.wait_for_compute(StreamRole.ALL_REDUCE)
        self._land(params, reduced, description, streams)

    def _land(
        self,
        params: list[FSDPParam],
        reduced: torch.Tensor,
        description: ReductionDescription,
        streams: CommStreams,
    ) -> None:
        event = land_sharded_grads(
            params, reduced, description, self.all_reduce_hook_stream, streams, self.offload
        )
        if event is not None:
            self.offload_event = event

    def wait_for_offloaded_grads(self, streams: CommStreams) -> None:
        """Block the host until this backward's asynchronous grad copies have landed."""
        event, self.offload_event = self.offload_event, None
        streams.wait_on_host(event)

    def _all_reduce_over_replicas(
        self,
        chunks: dict[FSDPParam, torch.Tensor],
        average: bool,
        policy: CommPrecisionPolicy | None,
        observers: Observers,
        fqn: str,
        ctx: CommContext,
    ) -> ReplicaAllReduce:
        """HSDP: issue the reduction of the shard-reduced chunks over the replicate axis
        (one all-reduce, plus the quantized leg's all-to-all if a policy quantizes it),
        adding the partial sums that micro-batches without all-reduce left."""
        params, parts = take_replica_parts(self.fsdp_params, chunks)
        watches: Watches = ()
        if observers:
            watches = observe_issue(observers, self._describe_all_reduce(fqn, ctx.streams, parts))
        is_quantized = [quantizes_reduction(policy, p, replicate_leg=True) for p in params]
        return issue_replica_all_reduce(
            params, parts, is_quantized, self.mesh_info.replicate_group, average, policy, watches
        )

    def _describe_reduce_scatter(
        self, fqn: str, streams: CommStreams, grads: UnshardedGrads
    ) -> Collective:
        """The reduce-scatter of ``grads`` over the shard ranks, for the observers."""
        return Collective(
            "reduce_scatter",
            fqn,
            "backward",
            self.reduce_scatter_group,
            self.mesh_info.shard_size,
            self.mesh_info.device,
            sum(g.numel() for g in grads.grads) * grads.reduce_dtype.itemsize,
            streams,
            grads,
        )

    def _describe_all_reduce(
        self, fqn: str, streams: CommStreams, parts: list[torch.Tensor]
    ) -> Collective:
        """HSDP's all-reduce of ``parts`` over the replicas, for the observers."""
        return Collective(
            "all_reduce",
            fqn,
            "backward",
            self.mesh_info.replicate_group,
            self.mesh_info.replicate_size,
            self.mesh_info.device,
            sum(t.nbytes for t in parts),
            streams,
        )
