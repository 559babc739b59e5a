"""Predicted forward and backward time of a grouping: ``auto_shard``'s criterion for
how many groups, which of them kept unsharded after forward, and whether to prefetch
in forward.

``Plan.step_s`` is a lower bound per phase (communication overlapping compute
perfectly). Choosing between groupings needs what it leaves out: a collective's fixed
cost, and the order in which all-gathers can start. So this is a small event model of
one step on two resources:

- the **host**, which runs the compute (FLOPs at ``tflops``) and pays each
  collective's fixed cost ``overhead_s`` when it issues it: the launch, the copies
  into and out of the communication buffers, the hooks. Nothing else runs meanwhile,
  so merging two groups saves one fixed cost per collective;
- one **link**, which carries the collectives' bytes (``GroupPlan.comm_s``: wire bytes
  over ``link_gbps``) one after the other in the order issued (one process group:
  gloo runs its collectives in order, NCCL's share the link).

A group's compute waits for its all-gather. Forward: the root's all-gather has nothing
to hide behind; a group's all-gather is issued when the host reaches the group (torch's
default; a host that is not ahead of its device, as on CPU) or, with a forward
prefetch of depth ``d``, when the compute of the group ``d`` before it starts (the
root's for the first ``d``).
Backward: the root's head runs first; a group resharded after forward is gathered
again, issued when the group after it starts its backward (torch's implicit prefetch,
depth 1; the root's pre-backward for the last group), a kept group is not, nor a frozen
one that the backward does not reach unless that prefetch gathers it; each group's
reductions are issued when its backward compute ends, the root's last. The optimizer
step is the same for every grouping and is left out.
"""

from collections.abc import Sequence
from dataclasses import dataclass

from .report import GroupPlan


@dataclass(frozen=True)
class Cost:
    """One group's times in the model, seconds."""

    forward_s: float
    """Forward compute of the modules it owns."""
    backward_s: float
    """Backward compute of the modules it owns."""
    all_gather_s: float
    """One all-gather's time on the link (its bytes; the fixed cost is apart)."""
    reduce_s: float
    """Its reductions' time on the link in one backward."""
    reductions: int
    """Collectives per backward: the reduce-scatter, and the all-reduce with HSDP."""
    gathers: bool
    """Whether it has parameters to all-gather."""
    reached: bool = True
    """Whether the backward reaches it (its output needs grad). Not when its
    parameters are frozen and its input needs no grad (a frozen first block, say): no
    backward compute, no reduction, and no all-gather in backward unless the group
    after it prefetches it."""

    @classmethod
    def of(cls, group: GroupPlan, tflops: float, reached: bool = True) -> "Cost":
        """From a group of a plan whose groups are all-gathered once in forward (and
        again in backward if resharded after forward and gathered there) and reduced
        at most once (not when its parameters are all frozen)."""
        counts = {kind: entry["count"] for kind, entry in group.collectives.items()}
        gathers = counts.get("all_gather", 0) > 0
        all_gather_s = group.comm_s.get("forward", 0.0)
        backward_gather_s = all_gather_s if counts.get("all_gather", 0) > 1 else 0.0
        return cls(
            forward_s=group.forward_flops / (tflops * 1e12),
            backward_s=group.backward_flops / (tflops * 1e12),
            all_gather_s=all_gather_s,
            reduce_s=max(0.0, group.comm_s.get("backward", 0.0) - backward_gather_s),
            reductions=counts.get("reduce_scatter", 0) + counts.get("all_reduce", 0),
            gathers=gathers,
            reached=reached,
        )

    @classmethod
    def merged(cls, costs: Sequence["Cost"]) -> "Cost":
        """The group of several: one all-gather and one reduction carry all their bytes."""
        return cls(
            forward_s=sum(c.forward_s for c in costs),
            backward_s=sum(c.backward_s for c in costs),
            all_gather_s=sum(c.all_gather_s for c in costs),
            reduce_s=sum(c.reduce_s for c in costs),
            reductions=max((c.reductions for c in costs), default=0),
            gathers=any(c.gathers for c in costs),
            reached=any(c.reached for c in costs),
        )


def gathered_again(groups: Sequence[Cost], kept: Sequence[bool]) -> list[bool]:
    """Which groups are all-gathered again in backward: those resharded after forward
    that the backward reaches, or that the group after them (the root, for the last)
    prefetches at its pre-backward, which the backward reaches."""
    last = len(groups) - 1
    return [
        g.gathers and not kept[i] and (g.reached or i == last or groups[i + 1].reached)
        for i, g in enumerate(groups)
    ]


class _Clock:
    """The host's and the link's time."""

    def __init__(self, overhead_s: float) -> None:
        self.overhead_s = overhead_s
        self.host = 0.0
        self.link = 0.0

    def issue(self, link_s: float, count: int = 1) -> float:
        """Issue ``count`` collectives carrying ``link_s`` of bytes; when they end."""
        if count == 0:
            return self.host
        self.host += count * self.overhead_s
        self.link = max(self.link, self.host) + link_s
        return self.link

    def wait(self, until: float) -> None:
        self.host = max(self.host, until)

    def compute(self, seconds: float) -> None:
        self.host += seconds


def step_s(
    root: Cost,
    groups: Sequence[Cost],
    kept: Sequence[bool],
    forward_prefetch: int,
    overhead_s: float,
) -> float:
    """Forward and backward of ``groups`` (forward order) under the root; ``kept[i]``:
    group ``i`` is not resharded after forward; ``forward_prefetch``: the depth (see
    the module docstring)."""
    clock = _Clock(overhead_s)

    def gather(i: int) -> float:
        return clock.issue(groups[i].all_gather_s, int(groups[i].gathers))

    # Forward: when each group's all-gather ends, in issue order (a list: issued in order).
    gathered: list[float] = []

    def gather_up_to(end: int) -> None:
        """Issue the forward all-gathers of groups before ``end`` not issued yet."""
        for i in range(len(gathered), min(end, len(groups))):
            gathered.append(gather(i))

    clock.wait(clock.issue(root.all_gather_s, int(root.gathers)))
    gather_up_to(forward_prefetch)
    for i, group in enumerate(groups):
        gather_up_to(i + 1)
        clock.wait(gathered[i])
        gather_up_to(i + 1 + forward_prefetch)
        clock.compute(group.forward_s)
    clock.compute(root.forward_s)

    # Backward: a resharded group's all-gather is issued at the pre-backward of the one
    # after it (the root's for the last), so it is always issued before it is awaited.
    again = gathered_again(groups, kept)
    regathered: dict[int, float] = {}
    last = len(groups) - 1
    if groups and again[last]:
        regathered[last] = gather(last)
    clock.compute(root.backward_s)
    for i in reversed(range(len(groups))):
        if again[i]:
            clock.wait(regathered.pop(i))
        if i > 0 and again[i - 1]:
            regathered[i - 1] = gather(i - 1)
        clock.compute(groups[i].backward_s)
        clock.issue(groups[i].reduce_s, groups[i].reductions)
    clock.issue(root.reduce_s, root.reductions)
    return max(clock.host, clock.link)
