"""FSDPParamGroup: one ``fully_shard`` call's parameters and their lifecycle verbs.

The class is split by job: its sharded buffer, all-gather layout and settings are
`GroupLayout`'s (group_layout.py: see [Note: re-deriving the sharded state] there), the
streams, waits and observers of its all-gather are `GroupStreams`' (group_streams.py),
and the version and step guards are one `GroupGuards` (group_guards.py) it calls; this
module holds its state and its lifecycle verbs, in the order of state.py's map.
"""

import torch
import torch.nn as nn

from ..api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .all_gather_layout import AllGatherInFlight, AllGatherLayout, PostForwardShard, shard_params
from .collectives import all_gather
from .comm_context import CommContext
from .comm_strategies import DefaultAllGather
from .group_guards import GroupGuards
from .group_layout import GroupLayout
from .group_streams import GroupStreams
from .mesh import MeshInfo
from .observer import CommObserver, Observers
from .param import FSDPParam, ParamToShard, ShardedState
from .param_reset import check_materialized
from .profiler_labels import ProfilerLabels
from .reduction.gradient_reduction import GradientReduction
from .training_state import TrainingState, is_in_backward


class FSDPParamGroup(GroupLayout, GroupStreams):
    """The parameters of one ``fully_shard`` call, communicated together."""

    def __init__(
        self,
        params: list[ParamToShard],
        modules: tuple[nn.Module, ...],
        mesh_info: MeshInfo,
        device: torch.device,
        reshard_after_forward: bool,
        fqn: str,
        mp_policy: MixedPrecisionPolicy,
        offload_policy: OffloadPolicy,
        post_forward_mesh_info: MeshInfo | None = None,
    ) -> None:
        """Shard ``params`` into a new sharded buffer; the modules are not touched yet.

        Args:
            params: each parameter as validated by fully_shard, in registration order.
            modules: the modules passed to ``fully_shard``.
            device: the compute device, or ``meta`` for meta-device params.
            reshard_after_forward: whether to free the unsharded params after forward.
            fqn: the group's name in messages and traces ('' for the root module).
            mp_policy: dtypes of the all-gather, compute and reduction.
            offload_policy: with ``CPUOffloadPolicy`` the sharded buffer (hence the
                sharded params, grads and optimizer state) lives on the CPU.
            post_forward_mesh_info: with ``reshard_after_forward``, reshard to this
                smaller mesh after forward instead of the full one (hpZ, see
                `_reshard_post_forward`).
        """
        self.fqn = fqn
        self.modules = modules
        self.mesh_info = mesh_info
        self.reshard_after_forward = reshard_after_forward
        self.post_forward_mesh_info = post_forward_mesh_info
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.device = device
        self.offload = offload_policy if isinstance(offload_policy, CPUOffloadPolicy) else None
        sharded_buffer, self.fsdp_params = shard_params(
            params, mesh_info, self._sharded_device(device), self._pins_sharded_buffer(), mp_policy
        )
        # Rebuilt, never mutated, by `set_comm_precision`, `set_all_gather_comm` and
        # `reset_sharded_params`.
        self.all_gather_layout = AllGatherLayout.build(
            self.fsdp_params, None, sharded_buffer, DefaultAllGather(), self.offload is not None
        )
        self.sharded_state = ShardedState.SHARDED
        self.training_state = TrainingState.IDLE
        # FSDPModule.set_* knobs (torch's names); the reduction has its own.
        self.unshard_in_backward = True
        # Whether this group's reduce-scatter waits for room in flight: only the
        # first of a call's groups to reduce (the last one) does, as in torch; set by
        # fully_shard. See [Note: reduce-scatters in flight].
        self.waits_for_reduce_scatters = True
        self.reduction = GradientReduction(self.fsdp_params, mesh_info, offload=self.offload)
        self.ctx: CommContext | None = None  # handed down at the root's lazy init
        # What watches this group's collectives and steps (trace, checks: see
        # runtime/observer.py), by the name `set_observer` attached it under; the
        # tuple is what the runtime tests and calls, empty when nothing is attached.
        self._observer_slots: dict[str, CommObserver] = {}
        self.observers: Observers = ()
        # While a profiler runs: this group's ranges (see [Note: profiler labels]).
        self.labels: ProfilerLabels | None = None
        self._in_flight: AllGatherInFlight | None = None  # issued, not yet copied out
        # hpZ between forward and backward; None when fully sharded or unsharded.
        self._post_forward: PostForwardShard | None = None
        self._forwarded_modules: set[int] = set()  # ids of modules whose forward ran
        # The version and step guards (group_guards.py), called at the verbs below.
        self.guards = GroupGuards(self.fsdp_params)
        # Every FSDPParam of the root's tree, set at lazy init: a replacement is checked
        # against them all, so a tie made after fully_shard is refused across groups.
        self.tree_params: list[FSDPParam] | None = None

    # Initialization #

    def to_sharded_modules(self) -> None:
        """The one mutation of ``fully_shard``: register the sharded params."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()

    def lazy_init(self, ctx: CommContext) -> None:
        """Adopt the root's CommContext; re-derive the sharded state from whatever
        happened to the sharded params since ``fully_shard``, and refuse to train on
        params that cannot be (the same checks, types and wording as torch's)."""
        self.reset_sharded_params()
        check_materialized(self.fsdp_params, offload=self.offload is not None)
        self.ctx = ctx
        self.guards.step_guard = ctx.step_guard

    # Runtime #

    def unshard(self, async_op: bool = False) -> None:
        """Issue this group's all-gather, unless it is unsharded or already in flight.

        The all-gather is always issued asynchronously; ``async_op=False`` waits for it
        and copies out right away.
        """
        if self.sharded_state == ShardedState.UNSHARDED or self._in_flight is not None:
            if not async_op:
                self.wait_for_unshard()
            return
        if not self.unshard_in_backward and self._phase() == "backward":
            return  # set_unshard_in_backward(False): prefetches are skipped too
        streams, role = self._streams(), self._all_gather_role()
        # ``param.data = ...`` since the last all-gather: the new sharded buffer is
        # filled on the compute stream.
        post_forward = self._post_forward
        if post_forward is None and self.reset_sharded_params() and role is not None:
            streams.wait_for_compute(role)
        if post_forward is not None and post_forward.written is not None:
            if role is not None:
                streams.wait_for_event(role, post_forward.written)
            self._post_forward = PostForwardShard(post_forward.buffer, written=None)
        if post_forward is None:
            self.guards.gathered()
        if self.labels is not None:
            self.labels.enter("all_gather")
        with streams.on(role):
            source = self._all_gather_source_now()
            watches = self._observe_all_gather(source) if self.observers else ()
            result = all_gather(
                source.input, source.mesh_info.shard_group, self.all_gather_layout.strategy
            )
            # Everything the copy-out reads was written on this stream: the offload's
            # host-to-device copy, the copy-in, a custom all-gather's own kernels (it
            # may return no Work). One event orders them all, at every shard size:
            # with one rank nothing is gathered and the output is the (cast, copied)
            # input, so the cast and copy may still overlap the previous block's
            # compute. torch's FSDP2 instead casts on the compute stream at one rank;
            # both order the same writes before the copy-out.
            event = streams.record_on(role) if role is not None else None
        self._in_flight = AllGatherInFlight(result, source, event, async_op, watches)
        if self.labels is not None:
            self.labels.exit("all_gather")
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self) -> None:
        """Wait for the in-flight all-gather, copy out, register the unsharded params."""
        if self._in_flight is None:
            return
        if self.labels is not None:
            self.labels.enter("all_gather_copy_out")
        in_flight = self._wait_all_gather()
        if self.training_state == TrainingState.FORWARD and self.ctx is not None:
            # The previous forward copy-out's output; see [Note: forward all-gather
            # overlap] (comm_context.py).
            self.ctx.release_kept_all_gather()
        self._post_forward = None  # its contents are in the all-gather output now
        source = in_flight.source
        is_post_forward = source.mesh_info is not self.mesh_info
        self.all_gather_layout.foreach_copy_out(in_flight.result.output, source, is_post_forward)
        self._release_copied_out(in_flight)
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED
        if self.labels is not None:
            self.labels.exit("all_gather_copy_out")

    def reshard(self) -> None:
        """Free the unsharded params and register the sharded ones."""
        # A prefetched all-gather still writes into its output: let it finish first.
        if self._wait_all_gather() is not None:
            self._release_all_gather()
        self._post_forward = None
        if self.sharded_state == ShardedState.SHARDED:
            return
        if self.observers:
            self._record("reshard")
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    def pre_forward(self) -> None:
        if self.labels is not None:
            self.labels.enter("pre_forward")
        if self.training_state != TrainingState.FORWARD:  # not a group's second module
            self._reshard_if_stale()
        self.training_state = TrainingState.FORWARD
        self.unshard()
        if self.labels is not None:
            self.labels.exit("pre_forward")

    def _reshard_if_stale(self) -> None:
        """Reshard a group kept unsharded since an earlier forward or backward (the root
        after a ``no_grad`` forward, ``set_reshard_after_backward(False)``) whose sharded
        params changed since their all-gather (`GroupGuards.is_stale`), so that this
        forward all-gathers the new values (torch's FSDP2 computes with the old ones)."""
        if self.sharded_state == ShardedState.SHARDED and self._post_forward is None:
            return
        if self.guards.is_stale():
            self.reshard()

    def post_forward(self, module: nn.Module) -> None:
        """Once every module of the group has run its forward, reshard per
        ``reshard_after_forward``. The root keeps its unsharded params, also after a
        ``no_grad`` forward, as torch's: the next forward of an evaluation loop or of
        ``generate()`` all-gathers nothing for it."""
        if self.training_state != TrainingState.FORWARD:
            # The end of a registered method (register_fsdp_forward_method) whose own
            # forward calls already ran this post-forward: Hugging Face's generate()
            # around its per-token forwards. The method is done with the params: reshard
            # whatever reshard_after_forward says, as torch's FSDP2 does.
            self.reshard()
            return
        self._forwarded_modules.add(id(module))
        if len(self._forwarded_modules) < len(self.modules):
            return  # a list group: the forward of its other modules has not run yet
        self.complete_forward()

    def is_forward_incomplete(self) -> bool:
        """Whether some but not all of a list group's modules ran their forward (the
        output head of ``fully_shard([norm, output])`` left out of an evaluation, or
        called on its own per chunk of a chunked loss)."""
        return self.training_state == TrainingState.FORWARD and bool(self._forwarded_modules)

    def complete_forward(self) -> None:
        """The group's forward is over: reshard per ``reshard_after_forward``. Also
        called by the root's post-forward for a list group only partly run, as torch's
        ``_force_complete_incomplete_states`` does, so that it is not left unsharded
        (and stale after an optimizer step) until its next forward."""
        if self.labels is not None:
            self.labels.enter("post_forward")
        self._forwarded_modules.clear()
        in_backward = is_in_backward()
        self.guards.forward_done(in_backward)
        # A forward recomputed inside backward (reentrant checkpointing reruns it before
        # this group's pre-backward) keeps the params: its backward comes next, as torch.
        if self.reshard_after_forward and not in_backward:
            if self.post_forward_mesh_info is not None:
                self._reshard_post_forward(self.post_forward_mesh_info)
            else:
                self.reshard()
        self.training_state = TrainingState.IDLE
        if self.labels is not None:
            self.labels.exit("post_forward")

    def _reshard_post_forward(self, post_forward: MeshInfo) -> None:
        """hpZ: keep this rank's 1/k of the padded unsharded params (k = the post-forward
        mesh size, e.g. one node), so backward all-gathers over k ranks, not W.

        The padded unsharded buffer of a param is W padded shards; viewed as (k, W/k
        shards) row j is what rank j of each k-group keeps. Concatenated over params,
        the rows form the backward all-gather input, whose output (k rows) copies out
        exactly like a W-rank one with W/k-times wider columns.
        """
        if self.sharded_state != ShardedState.UNSHARDED:
            return
        extended = [p.fqn for p in self.fsdp_params if p.extension is not None]
        if extended:
            # fully_shard refuses this; a subclass can still arrive later (to_empty,
            # load_state_dict(assign=True)). torch raises the same type here.
            raise NotImplementedError(
                f"{self.fqn or 'root'}: resharding to a smaller mesh after forward is not "
                f"supported for parameters with all-gather extensions: {extended}"
            )
        k, j = post_forward.shard_size, post_forward.shard_rank
        self._post_forward = PostForwardShard(
            self.all_gather_layout.post_forward_buffer(k, j), self._streams().record_compute()
        )
        if self.observers:
            self._record("reshard_post_forward")
        for fsdp_param in self.fsdp_params:
            fsdp_param.to_sharded()
        self.sharded_state = ShardedState.SHARDED

    def pre_backward(self) -> None:
        if self.training_state == TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        if self.labels is not None:
            self.labels.enter("pre_backward")
        if self.observers:
            self._record("pre_backward")
        self.unshard()
        self.guards.check_unchanged_since_forward(self.fqn)
        if self.labels is not None:
            self.labels.exit("pre_backward")

    def post_backward(self) -> None:
        """Reduce-scatter the unsharded grads (unless accumulating) and reshard.

        Runs each time one of the group's post-backward nodes fires, as torch's: a node
        belongs to one forward, and waiting for the nodes of every forward would hold
        the unsharded params and grads until the end of a backward that never runs
        the others (a forward whose output is kept without a backward; two forwards,
        then one backward each), and, if that differs between ranks, issue
        collectives in different orders. Idempotent: a second run in one backward
        reduces only the grads that landed since (none for two forwards summed into one
        loss: autograd sums a param's grads before accumulating them), and the group's
        next pre-backward re-gathers the params first.
        """
        self.training_state = TrainingState.POST_BACKWARD
        labels = self.labels
        if labels is not None:
            labels.enter("post_backward")
        if self.observers:
            self._record("post_backward")
        if not self.requires_gradient_sync:
            for fsdp_param in self.fsdp_params:
                fsdp_param.accumulate_unsharded_grad()
            if self.reshard_after_backward:
                self.reshard()
            if labels is not None:
                labels.exit("post_backward")
            return
        assert self.ctx is not None, f"{self.fqn}: post-backward before lazy init"
        # Torch's order: take the grads, free the unsharded params, then allocate the
        # reduce-scatter input; the peak is params + grads, not params + grads + input.
        taken = self.reduction.take_grads()
        if self.reshard_after_backward:
            self.reshard()
        if labels is not None:
            labels.enter("post_backward_reduce")
        self.reduction.reduce_scatter(
            self.ctx, self.fqn, taken, self.observers, make_room=self.waits_for_reduce_scatters
        )
        if labels is not None:
            labels.exit("post_backward_reduce")
            labels.exit("post_backward")

    def finalize_backward(self) -> None:
        """End of backward (root callback): post-backward for every group whose node did
        not fire, as torch's: its inputs had no grad (a frozen first layer), its forward
        never completed (a list group's module called on its own), or no gradient
        reached it at all. It reduces what the group holds (nothing, for a group no
        gradient reached) and reshards per ``reshard_after_backward``: a group kept
        unsharded since its forward (``reshard_after_forward=False``) must not stay
        registered unsharded, or an in-place update of ``model.parameters()`` would land
        in the unsharded copy and be lost at its next reshard. Then back to IDLE."""
        if self.training_state != TrainingState.POST_BACKWARD:
            self.post_backward()
        # A backward prefetch that no pre-backward consumed (its forward was recomputed
        # after the group's post-backward, say) holds this step's values: the optimizer
        # is about to change them, so the next forward must not use it.
        if self._wait_all_gather() is not None:
            self._release_all_gather()
        self.training_state = TrainingState.IDLE
        self._forwarded_modules.clear()

    def reset_iter_state(self) -> None:
        """Abandon the iteration (after an exception, or the user's call)."""
        self.training_state = TrainingState.IDLE
        self._forwarded_modules.clear()

    def discard_gradients(self) -> None:
        """After an exception: drop every gradient FSDP holds for the failed iteration
        (unsharded grads, no-sync and HSDP partial accumulations), as torch does."""
        for fsdp_param in self.fsdp_params:
            fsdp_param.discard_pending_grads()
        self.reduction.discard_error_feedback()
