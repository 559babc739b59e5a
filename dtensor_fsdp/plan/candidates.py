"""``auto_shard``'s candidates: the groupings it considers, each one's peak and step
time predicted from the baseline plan, and the choice among them (the method is in
``auto.py``'s docstring, steps 2 and 3)."""

from dataclasses import dataclass

from .report import MiB, Plan
from .timing import Cost, gathered_again, step_s

# Unsharded copies of a group alive at once in backward: its params, the next group's
# (prefetched) and its unsharded grads; on gloo one more, the receive buffer of ours'
# reduce-scatter by all-to-all, as large as its input.
MERGE_COPIES = {"nccl": 3, "gloo": 4}
# Forward prefetch depths tried: torch's default (none), then one and two calls ahead.
DEPTHS = (0, 1, 2)
# Groups the host runs ahead of the device, per backend: a GPU's host reaches a group's
# pre-forward while the device still computes the one before, so every forward
# all-gather is issued (and its output allocated) that much earlier than the explicit
# depth says: depth d acts as d + 1 there, in time and in memory; a CPU's host does not
# run ahead.
HOST_AHEAD = {"nccl": 1, "gloo": 0}
# Predicted step times this close (relative) are a tie: the model is not that precise.
TIE = 1e-3


@dataclass(frozen=True)
class AutoGroup:
    """One ``fully_shard`` call that ``auto_shard`` chose (the root's is implied, last)."""

    fqns: tuple[str, ...]
    """The modules of the call: one is ``fully_shard(module)``, more are
    ``fully_shard([modules])``."""
    reshard_after_forward: bool


def calls_of(blocks: list[str], n_groups: int, kept: frozenset[int]) -> tuple[AutoGroup, ...]:
    """``blocks`` in ``n_groups`` runs of consecutive blocks, sizes differing by at most
    one (the largest group sets the memory); those indexed in ``kept`` not resharded."""
    size, extra = divmod(len(blocks), n_groups) if blocks else (0, 0)
    calls, start = [], 0
    for i in range(n_groups if blocks else 0):
        end = start + size + (i < extra)
        calls.append(AutoGroup(tuple(blocks[start:end]), i not in kept))
        start = end
    return tuple(calls)


class Predictor:
    """The peak, the step time and the collectives of a grouping, predicted from the
    baseline plan (one group per block, every block resharded after forward)."""

    def __init__(
        self, baseline: Plan, blocks: list[str], tflops: float, overhead_s: float, backend: str
    ) -> None:
        rows = {g.fqn: g for g in baseline.groups}
        self.baseline = baseline
        # Each module's first point of each event on the timeline.
        self.points: dict[tuple[str, str], int] = {}
        for i, point in enumerate(baseline.timeline):
            self.points.setdefault((point.fqn, point.event), i)
        self.block_bytes = {f: rows[f].unsharded_bytes for f in blocks}
        # A block the backward never reached (frozen, its input needing no grad) has no
        # pre-backward on the timeline.
        self.costs = {
            f: Cost.of(rows[f], tflops, reached=(f, "pre_backward") in self.points)
            for f in blocks
        }
        # A root without parameters of its own has no group: nothing to gather or reduce.
        self.root = Cost.of(rows[""], tflops) if "" in rows else Cost(0, 0, 0, 0, 0, False)
        self.overhead_s = overhead_s
        self.merge_copies = MERGE_COPIES[backend]
        self.host_ahead = HOST_AHEAD[backend]

    def group_bytes(self, group: AutoGroup) -> int:
        return sum(self.block_bytes[f] for f in group.fqns)

    def merge_extra(self, calls: tuple[AutoGroup, ...]) -> int:
        """More unsharded bytes at once: ``merge_copies`` times the largest group's
        growth over one block."""
        largest = max((self.group_bytes(g) for g in calls), default=0)
        return self.merge_copies * (largest - max(self.block_bytes.values(), default=0))

    def peak(self, calls: tuple[AutoGroup, ...], forward_prefetch: int) -> int:
        """The baseline's timeline with each kept group's bytes added from its last
        module's forward to its first module's backward, and with forward prefetch
        (the depth the device sees: ``effective_depth``) each group's bytes from the
        forward of the call that prefetches it (the root for the first ones) to its
        own; the baseline's peak above its highest timeline point (temporaries inside
        a module) stays on top."""
        forward_prefetch = self.effective_depth(forward_prefetch)
        timeline = self.baseline.timeline
        base = max((p.live_bytes for p in timeline), default=0)
        spans = [
            (
                self._point(g.fqns[-1], "post_forward"),
                self._point(g.fqns[0], "post_backward"),
                self.group_bytes(g),
            )
            for g in calls
            if not g.reshard_after_forward
        ]
        if forward_prefetch:
            issuers = [""] * forward_prefetch + [g.fqns[0] for g in calls]
            spans += [
                (
                    self._point(issuer, "pre_forward"),
                    self._point(g.fqns[0], "pre_forward"),
                    self.group_bytes(g),
                )
                for issuer, g in zip(issuers, calls)
            ]
        if not timeline:
            highest = base + sum(nbytes for _, _, nbytes in spans)
        else:
            change = [0] * (len(timeline) + 1)
            for start, end, nbytes in spans:
                if start < end:
                    change[start] += nbytes
                    change[end] -= nbytes
            held, highest = 0, base
            for t, point in enumerate(timeline):
                held += change[t]
                highest = max(highest, point.live_bytes + held)
        slack = max(0, self.baseline.peak_bytes - base)
        return max(self.baseline.peak_bytes, highest + slack) + self.merge_extra(calls)

    def _point(self, fqn: str, event: str) -> int:
        return self.points.get((fqn, event), len(self.baseline.timeline))

    def _costs(self, calls: tuple[AutoGroup, ...]) -> list[Cost]:
        return [Cost.merged([self.costs[f] for f in g.fqns]) for g in calls]

    def step_s(self, calls: tuple[AutoGroup, ...], forward_prefetch: int) -> float:
        kept = [not g.reshard_after_forward for g in calls]
        depth = self.effective_depth(forward_prefetch)
        return step_s(self.root, self._costs(calls), kept, depth, self.overhead_s)

    def effective_depth(self, forward_prefetch: int) -> int:
        """The forward prefetch depth the device sees (``HOST_AHEAD``)."""
        return forward_prefetch + self.host_ahead

    def collectives(self, calls: tuple[AutoGroup, ...]) -> int:
        """Per step: each group's all-gather in forward, again in backward unless kept
        (or frozen out of the backward's reach, ``gathered_again``), and its reductions
        (the reduce-scatter, HSDP's all-reduce; none when all frozen); the root's."""
        costs = self._costs(calls)
        again = gathered_again(costs, [not g.reshard_after_forward for g in calls])
        return sum(
            int(cost.gathers) + int(gathered) + cost.reductions
            for cost, gathered in [*zip(costs, again, strict=True), (self.root, False)]
        )


@dataclass(frozen=True)
class Choice:
    """A candidate: the calls, the forward prefetch depth, their predicted peak, step
    time and collectives per step."""

    calls: tuple[AutoGroup, ...]
    forward_prefetch: int
    peak: int
    step_s: float
    collectives: int

    @classmethod
    def of(
        cls, calls: tuple[AutoGroup, ...], forward_prefetch: int, predictor: Predictor
    ) -> "Choice":
        return cls(
            calls,
            forward_prefetch,
            predictor.peak(calls, forward_prefetch),
            predictor.step_s(calls, forward_prefetch),
            predictor.collectives(calls),
        )

    @property
    def kept(self) -> frozenset[int]:
        return frozenset(i for i, g in enumerate(self.calls) if not g.reshard_after_forward)

    def describe(self) -> str:
        sizes = "/".join(str(n) for n in sorted({len(g.fqns) for g in self.calls}))
        return (
            f"{count(len(self.calls), 'group')} of {sizes} block{'s' * (sizes != '1')}, "
            f"{len(self.kept)} kept, forward prefetch {self.forward_prefetch}: "
            f"{self.step_s * 1e3:.3f} ms, {self.peak / MiB:.2f} MiB"
        )


def candidates(blocks: list[str], predictor: Predictor, budget: int) -> list[Choice]:
    """Per number of groups that fits and per forward prefetch depth, the longest run
    of kept groups (from the last back) that fits. Every number is tried: with blocks of
    unequal sizes fewer groups may hold less at once than more."""
    out = []
    for n_groups in range(len(blocks), 0, -1):
        for depth in DEPTHS[: n_groups + 1]:
            if predictor.peak(calls_of(blocks, n_groups, frozenset()), depth) > budget:
                continue
            low, high = 0, n_groups  # kept runs of length low fit; find the longest
            while low < high:
                middle = (low + high + 1) // 2
                if (
                    predictor.peak(calls_of(blocks, n_groups, _last(n_groups, middle)), depth)
                    <= budget
                ):
                    low = middle
                else:
                    high = middle - 1
            out.append(
                Choice.of(calls_of(blocks, n_groups, _last(n_groups, low)), depth, predictor)
            )
    return out


def fastest(choices: list[Choice]) -> Choice | None:
    """The fastest predicted; among those within ``TIE`` of it, fewer collectives, then
    a forward prefetch of depth 1, 2, 0: the model counts FLOPs only, and the work it
    does not count (embeddings, norms, elementwise ops) also hides an all-gather issued
    early; a deeper one holds more unsharded."""
    if not choices:
        return None
    best = min(c.step_s for c in choices)
    tied = [c for c in choices if c.step_s <= best * (1 + TIE)]
    return min(
        tied,
        key=lambda c: (c.collectives, c.forward_prefetch == 0, c.forward_prefetch, c.step_s),
    )


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' * (n != 1)}"


def _last(n_groups: int, run: int) -> frozenset[int]:
    return frozenset(range(n_groups - run, n_groups))
