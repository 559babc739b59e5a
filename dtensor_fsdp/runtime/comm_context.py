"""CommContext: when FSDP communicates, for one root and every group under it.

One CommContext is created at the root's lazy init and handed to every group in its
tree. It owns the cross-group decisions:

- the post-forward order of this iteration, from which backward prefetch is derived
  (backward runs the groups in reverse, so while group i computes its backward, group
  i-1's all-gather is already in flight);
- the queue of in-flight reduce-scatters, bounded so that overlap with the following
  groups' backward never holds more than ``max_in_flight_reduce_scatters`` reduce-scatter
  input buffers at once, the one being issued included (torch's ``max_input_buffers``,
  default 1: see [Note: reduce-scatters in flight]); and HSDP's all-reduces over the
  replicate axis, issued as each reduce-scatter finishes and waited only when the bound
  or the end of backward needs their gradients (torch's FSDP2 runs them on their own
  stream);
- whether this backward's final callback has been queued;
- the streams (`CommStreams`, streams.py) the groups issue their collectives on: side
  streams on an accelerator, none on the host; and in forward the last copied-out
  all-gather output, kept until the next copy-out (see [Note: forward all-gather
  overlap]).

Collectives themselves are issued by the groups (param_group.py) through
collectives.py; this module only decides which group, and when.
"""

from collections import deque
from collections.abc import Callable
from typing import Protocol

from .profiler_labels import ProfilerLabels
from .step_guard import StepGuard
from .streams import CommStreams, StreamRole


class Prefetchable(Protocol):
    """What the CommContext needs of a group: its name, the modules of its
    ``fully_shard`` call (shared by the call's groups) and an async unshard."""

    fqn: str
    modules: tuple[object, ...]
    labels: ProfilerLabels | None  # while a profiler runs

    def unshard(self, async_op: bool = False) -> None: ...


# [Note: reduce-scatters in flight]
# A group's reduce-scatter input (its gradients, copied into one (W, shard) buffer; on
# gloo also the all-to-all's receive buffer of the same size) lives until the
# reduce-scatter is waited. With k in flight, a group's reduce-scatter may overlap the
# backward of the next k groups, and the oldest is waited *before* the next group's
# buffer is allocated, so at most k buffers exist at once: torch's FSDP2
# (``max_input_buffers``) bounds the same buffers the same way. The default is torch's,
# 1: the previous group's
# reduce-scatter overlaps this group's backward compute and is waited before this
# group's is issued. A second slot costs one group's buffer and pays off only when one
# reduce-scatter outlasts the next group's whole backward (benchmarks/bench_inflight.py
# measured no gain on CPU/gloo; see benchmarks/README.md). The groups of one
# fully_shard call on several meshes count as one, as in torch: only the first of them
# to reduce (the last group) waits, so a MoE block's dense reduce-scatter is issued
# while its experts' one is in flight, and a call has all of its buffers alive at once.


# [Note: forward all-gather overlap]
# An all-gather's output is allocated on the all-gather stream and read by the copy-out
# on the compute stream; the caching allocator may hand its memory to the next
# allocation on the all-gather stream as soon as it is freed, so the all-gather stream
# must wait for the copy-out before the output is freed. Waiting right after each
# copy-out would order all-gather i+1 after copy-out i, which the host queues behind
# block i-1's compute. So in forward, as torch's FSDP2 (``comm_ctx.all_gather_state``),
# an implicit unshard's output is kept alive with its copy-out's event: group i+1's
# all-gather is issued (and may run) while copy-out i and block i's compute are
# pending, and before group i+1's copy-out the all-gather stream waits for that event
# and only then is output i freed. The cost is one more all-gather output alive: at
# most two (the kept one and the one in flight). Explicit (async) prefetches, backward
# and one rank (nothing gathered) wait right after the copy-out; the root's
# post-forward and `reset` release the last one. On the host (no streams) nothing is
# kept: the output is freed once the copy-out has run, as before.


class CommContext:
    """Shared per-root scheduling state. See the module docstring."""

    def __init__(
        self, max_in_flight_reduce_scatters: int = 1, streams: CommStreams | None = None
    ) -> None:
        if max_in_flight_reduce_scatters < 1:
            raise ValueError("max_in_flight_reduce_scatters must be >= 1")
        self.max_in_flight_reduce_scatters = max_in_flight_reduce_scatters
        self.streams = streams if streams is not None else CommStreams()
        self.post_forward_order: list[Prefetchable] = []
        # Per group (by id), its positions in post_forward_order, one per forward use,
        # popped by its pre-backwards (last use first), as torch's
        # ``_post_forward_indices``: see `_implicit_backward_targets`.
        self._post_forward_indices: dict[int, list[int]] = {}
        self.is_in_forward = False  # between the root's pre- and post-forward
        self.is_backward_callback_queued = False
        # A backward's grads must land before it returns even when no pre-backward
        # queued the callback above: see [Note: partly run list groups] (state.py).
        self.is_landing_callback_queued = False
        # One entry per issued reduce-scatter: (finish: wait and land its sharded grads,
        # abandon: wait only, after an exception).
        self._pending_reduce_scatters: deque[tuple[Callable[[], None], Callable[[], None]]] = (
            deque()
        )
        # HSDP: the same for the replicate-axis all-reduces issued once a group's
        # reduce-scatter finished; bounded by the same number.
        self._pending_all_reduces: deque[tuple[Callable[[], None], Callable[[], None]]] = deque()
        # The last forward copy-out's all-gather output and the event after that
        # copy-out; see [Note: forward all-gather overlap].
        self._kept_all_gather: tuple[object, object] | None = None
        # The groups awaiting their backward, watched for an optimizer step: see
        # [Note: optimizer step between forward and backward] (step_guard.py).
        self.step_guard = StepGuard()

    # Forward #

    def begin_forward(self, post_optim_event: object | None = None) -> None:
        """The root's forward starts a new iteration: forget the last forward's order;
        this forward's all-gathers read what the optimizer wrote (all of the compute
        stream's work so far, or just ``set_post_optim_event``'s event)."""
        self.post_forward_order.clear()
        self._post_forward_indices.clear()
        self.is_in_forward = True
        if post_optim_event is not None:
            self.streams.wait_for_event(StreamRole.ALL_GATHER, post_optim_event)
        else:
            self.streams.wait_for_compute(StreamRole.ALL_GATHER)

    def end_forward(self) -> None:
        self.is_in_forward = False
        self.release_kept_all_gather()

    def keep_all_gather(self, output: object, copy_out_event: object) -> None:
        """Keep a forward all-gather's ``output`` alive until the next copy-out: the
        all-gather stream waits for ``copy_out_event`` only then (see [Note: forward
        all-gather overlap]). That copy-out released the one kept before."""
        assert self._kept_all_gather is None
        self._kept_all_gather = (output, copy_out_event)

    def release_kept_all_gather(self) -> None:
        """The all-gather stream waits for the kept output's copy-out; then free it."""
        if self._kept_all_gather is not None:
            self.streams.wait_for_event(StreamRole.ALL_GATHER, self._kept_all_gather[1])
            self._kept_all_gather = None

    def record_post_forward(self, groups: list[Prefetchable]) -> None:
        """A call's forward ended (a list call's: its last module's, or completed at the
        root's post-forward): its groups join the forward order, once per use."""
        for group in groups:
            self._post_forward_indices.setdefault(id(group), []).append(
                len(self.post_forward_order)
            )
            self.post_forward_order.append(group)

    def prefetch_forward(self, targets: list[Prefetchable]) -> None:
        """Explicit forward prefetch: issue the targets' all-gathers without waiting."""
        _prefetch(targets, "forward")

    # Backward #

    def prefetch_backward(
        self, groups: list[Prefetchable], explicit: list[Prefetchable] | None
    ) -> None:
        """Issue the all-gathers of the groups whose backward comes next, once the
        backward of ``groups`` (one ``fully_shard`` call's) started.

        With ``explicit`` (``set_modules_to_backward_prefetch``) those groups; otherwise
        the call that ran just before in this iteration's forward (see
        `_implicit_backward_targets`).
        """
        targets = explicit if explicit is not None else self._implicit_backward_targets(groups)
        _prefetch(targets, "backward")

    def _implicit_backward_targets(self, groups: list[Prefetchable]) -> list[Prefetchable]:
        """One group: the group recorded just before the forward whose backward this
        is. Several (one call on several meshes), as torch's: from the second group's
        forward, back past the call's own groups, every group of the call met first, in
        reverse forward order (the order their backward runs). See
        `_backward_position` for which forward."""
        order = self.post_forward_order
        # Every group of the call pops its own position, as each of torch's does.
        positions = [self._backward_position(g) for g in groups]
        anchor, last = (groups[0], positions[0]) if len(groups) == 1 else (groups[1], positions[1])
        if last is None:
            return []
        if len(groups) == 1:
            return [order[last - 1]] if last > 0 else []
        targets: list[Prefetchable] = []
        for target in reversed(order[:last]):
            if target.modules is anchor.modules:
                continue
            if targets and target.modules is not targets[0].modules:
                break
            targets.append(target)
        return targets

    def _backward_position(self, group: Prefetchable) -> int | None:
        """Where in this iteration's forward order the forward of ``group`` whose
        backward starts now ran: its positions are popped, last use first, as torch's
        ``_post_forward_indices``. A module used twice in one forward runs post-backward
        after each use's backward (`FSDPParamGroup.post_backward`), so the earlier use's
        backward must prefetch what ran before *that* use, not again what ran before
        the later one, whose backward is over.

        With its positions used up, or cleared by a later forward of the root (two
        forwards, then the backward of their sum: torch keeps both forwards' orders,
        ours the last one's), its last position stands for them; None if it ran no
        forward this iteration."""
        indices = self._post_forward_indices.get(id(group))
        if indices:
            return indices.pop()
        order = self.post_forward_order
        return next((i for i in range(len(order) - 1, -1, -1) if order[i] is group), None)

    def make_room_for_reduce_scatter(self) -> None:
        """Before a group allocates its reduce-scatter input: finish the oldest
        in-flight ones until one more fits the bound. See [Note: reduce-scatters in
        flight]."""
        while len(self._pending_reduce_scatters) >= self.max_in_flight_reduce_scatters:
            self._pending_reduce_scatters.popleft()[0]()

    def enqueue_reduce_scatter(
        self, finish: Callable[[], None], abandon: Callable[[], None]
    ) -> None:
        """Track a reduce-scatter issued after ``make_room_for_reduce_scatter`` (by
        its call's first group to reduce, for a call on several meshes)."""
        self._pending_reduce_scatters.append((finish, abandon))

    def enqueue_all_reduce(self, finish: Callable[[], None], abandon: Callable[[], None]) -> None:
        """Track an issued HSDP all-reduce; finish the oldest ones beyond the bound."""
        self._pending_all_reduces.append((finish, abandon))
        while len(self._pending_all_reduces) > self.max_in_flight_reduce_scatters:
            self._pending_all_reduces.popleft()[0]()

    def wait_for_reduce_scatters(self) -> None:
        """Finish every in-flight reduction, oldest first: the reduce-scatters (which
        may issue all-reduces), then the all-reduces."""
        while self._pending_reduce_scatters:
            self._pending_reduce_scatters.popleft()[0]()
        while self._pending_all_reduces:
            self._pending_all_reduces.popleft()[0]()

    def abandon_reduce_scatters(self) -> None:
        """After an exception: wait for the in-flight reductions (their buffers must
        outlive the collectives) but drop their results: a failed step's gradients must
        not land on the next step's."""
        for pending in (self._pending_reduce_scatters, self._pending_all_reduces):
            while pending:
                pending.popleft()[1]()

    def reset(self) -> None:
        """Drop per-iteration state (end of backward, or after an exception)."""
        self.post_forward_order.clear()
        self._post_forward_indices.clear()
        self.is_in_forward = False
        self.is_backward_callback_queued = False
        self.is_landing_callback_queued = False
        self.release_kept_all_gather()
        self.step_guard.clear()


def _prefetch(targets: list[Prefetchable], direction: str) -> None:
    """Issue the targets' all-gathers without waiting, each under its ``direction``
    prefetch label while a profiler runs."""
    for target in targets:
        if target.labels is not None:
            target.labels.enter_prefetch(direction)
        target.unshard(async_op=True)
        if target.labels is not None:
            target.labels.exit(f"{direction}_prefetch")
