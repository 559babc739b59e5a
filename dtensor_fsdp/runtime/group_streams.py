"""GroupStreams: where a group's all-gather meets the streams and the observers: the
stream it is issued on, its source, its (observed) wait, the release of its buffers,
and the phase and lifecycle steps the observers see (`FSDPParamGroup`'s helpers; its
lifecycle verbs are in param_group.py).
"""

import torch

from .all_gather_layout import AllGatherInFlight, AllGatherLayout, AllGatherSource, PostForwardShard
from .comm_context import CommContext
from .mesh import MeshInfo
from .observer import (
    Collective,
    CommObserver,
    Observers,
    Watches,
    begin_wait,
    check_collective,
    end_wait,
    wait_work,
    watch_collective,
)
from .streams import CommStreams, StreamRole
from .training_state import TrainingState


class GroupStreams:
    """The communication helpers of `FSDPParamGroup` (which declares every attribute in
    its ``__init__``)."""

    fqn: str
    mesh_info: MeshInfo
    post_forward_mesh_info: MeshInfo | None
    device: torch.device
    all_gather_layout: AllGatherLayout
    training_state: TrainingState
    ctx: CommContext | None
    observers: Observers
    _observer_slots: dict[str, CommObserver]
    _in_flight: AllGatherInFlight | None
    _post_forward: PostForwardShard | None

    # Communication helpers #

    def _all_gather_source_now(self) -> AllGatherSource:
        layout = self.all_gather_layout
        if self._post_forward is not None:
            assert self.post_forward_mesh_info is not None
            return layout.post_forward_source(
                self._post_forward, self.mesh_info, self.post_forward_mesh_info
            )
        # CPU offload: one host-to-device copy of the whole group's shards (on the
        # all-gather stream on an accelerator, so it overlaps compute).
        sharded = layout.sharded_buffer.to(self.device, non_blocking=True)
        return layout.sharded_source(sharded, self.mesh_info)

    def _wait_all_gather(self) -> AllGatherInFlight | None:
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is None:
            return None
        result, source = in_flight.result, in_flight.source
        # The all-gather stream's writes (see `unshard`), whatever Work exists.
        self._streams().wait_for_event(None, in_flight.event)
        if source.mesh_info.shard_size == 1:
            return in_flight  # nothing was issued (one rank)
        watches = in_flight.watches
        if watches:
            begin_wait(watches)
        if result.work is not None:
            wait_work(result.work, watches)  # on an accelerator, the compute stream waits
        if watches:
            end_wait(watches, result.output.numel(), self._phase())  # uint8 output
        return in_flight

    def _release_all_gather(self) -> None:
        """An all-gather waited but not copied out (dropped): the all-gather stream
        waits for the compute stream before its next allocations may reuse the
        buffers. The caller drops its references right after."""
        self._streams().wait_for_compute(StreamRole.ALL_GATHER)

    def _release_copied_out(self, in_flight: AllGatherInFlight) -> None:
        """The copy-out of ``in_flight`` is queued: the all-gather stream waits for it
        before the output is freed, at the next copy-out for a forward implicit
        unshard over more than one rank, else now. See [Note: forward all-gather
        overlap] (comm_context.py); the host has no stream to overlap and frees it at
        once. The caller drops its references right after."""
        streams = self._streams()
        copy_out_event = streams.record_compute()
        if (
            streams.has_streams
            and self.training_state == TrainingState.FORWARD
            and not in_flight.is_async
            and in_flight.source.mesh_info.shard_size > 1
            and self.ctx is not None
        ):
            self.ctx.keep_all_gather(in_flight.result.output, copy_out_event)
        else:
            streams.wait_for_event(StreamRole.ALL_GATHER, copy_out_event)

    # Streams #

    def _streams(self) -> CommStreams:
        return self.ctx.streams if self.ctx is not None else CommStreams()

    def _all_gather_role(self) -> StreamRole | None:
        """FSDP's own all-gathers (forward, backward and their prefetches) run on the
        all-gather stream; a user's ``unshard()`` on the current one, as in torch."""
        return StreamRole.ALL_GATHER if self._phase() in ("forward", "backward") else None

    # Observers #

    def _phase(self) -> str:
        if self.training_state == TrainingState.FORWARD:
            return "forward"
        if self.training_state in (TrainingState.PRE_BACKWARD, TrainingState.POST_BACKWARD):
            return "backward"
        if self.ctx is not None and self.ctx.is_backward_callback_queued:
            return "backward"  # prefetched for a backward that has not reached us yet
        if self.ctx is not None and self.ctx.is_in_forward:
            return "forward"  # prefetched for a forward that has not reached us yet
        return "explicit"

    def set_observer(self, name: str, observer: CommObserver | None) -> None:
        """Attach ``observer`` under ``name`` (``"trace"``, ``"check"``: the setter's
        own name), replacing the one attached there; ``None`` detaches it."""
        self._observer_slots.pop(name, None)
        if observer is not None:
            self._observer_slots[name] = observer
        self.observers = tuple(self._observer_slots.values())

    def _record(self, step: str) -> None:
        """Lifecycle ``step`` to the observers; callers test ``self.observers`` first,
        so that a group without any pays no call."""
        phase = self._phase()
        for observer in self.observers:
            observer.lifecycle(step, self.fqn, phase)

    def _observe_all_gather(self, source: AllGatherSource) -> Watches:
        """The all-gather of ``source`` to the observers: their checks (which may
        raise: nothing is issued then), the ``unshard`` step, then their watches, on
        the stream it is issued from."""
        collective = Collective(
            "all_gather",
            self.fqn,
            self._phase(),
            source.mesh_info.shard_group,
            source.mesh_info.shard_size,
            source.mesh_info.device,
            source.input.nbytes,
            self._streams(),
        )
        check_collective(self.observers, collective)
        self._record("unshard")
        return watch_collective(self.observers, collective)
