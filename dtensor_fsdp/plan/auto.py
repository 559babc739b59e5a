"""``auto_shard``: choose the ``fully_shard`` calls under a per-rank memory budget.

The choice is greedy and predicted from one simulated plan, then confirmed by one more:

1. Simulate the finest grouping, fully resharded (``shard_largest_module_list``: one
   group per block of the largest ``nn.ModuleList``, the rest in the root). Its peak is
   the smallest budget this search can meet; below it, ``ValueError``.
2. Merge consecutive blocks into list groups (``fully_shard([...])``, sizes differing
   by at most one): one all-gather and one reduce-scatter cover a group. A larger group
   holds more unsharded bytes at once: the group running, the one prefetched and the
   running group's unsharded gradients, so ``_MERGE_COPIES`` times the growth of the
   largest group is added to the peak. The number of groups shrinks until that leaves
   the budget, or until it would fall below ``_MIN_GROUPS`` (the first group's forward
   all-gather and the last's backward reduce-scatter have no compute to hide behind,
   so a group's size bounds the exposed communication).
3. Keep groups unsharded from forward to backward (``reshard_after_forward=False``),
   from the last one back: the last group's backward comes first, so its all-gather
   would be exposed, and it is freed soonest. A kept group's bytes are added to the
   baseline's timeline from its forward to its backward; groups are kept while the
   predicted peak fits. The root keeps its parameters by torch's rule
   (``reshard_after_forward=None`` on the root).
4. Prefetch: the implicit default (depth 1). Under the plan's time model a phase's
   collectives hide behind its compute already at depth 1 where they can; a deeper
   prefetch only holds one more group's unsharded bytes.
5. Simulate the choice. If its peak exceeds the budget (the prediction was short), the
   kept groups are given up first, then the groups are split in two, and it is
   simulated again (``_MAX_SIMULATIONS`` in all); the fully resharded finest grouping,
   already simulated, always fits.
"""

import dataclasses
import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..fully_shard import fully_shard
from .report import MiB, Plan
from .settings import PlanSettings, largest_module_list
from .simulate import simulate

# Unsharded copies of a group alive at once in backward: its params, the next group's
# (prefetched) and its unsharded grads (see step 2 above).
_MERGE_COPIES = 3
# Groups kept at least, so that all but one all-gather and one reduce-scatter overlap
# another group's compute (step 2 above).
_MIN_GROUPS = 4
# Simulations in all, the baseline's included: each costs seconds on a large model.
_MAX_SIMULATIONS = 4


@dataclass(frozen=True)
class AutoGroup:
    """One ``fully_shard`` call that ``auto_shard`` chose (the root's is implied, last)."""

    fqns: tuple[str, ...]
    """The modules of the call: one is ``fully_shard(module)``, more are
    ``fully_shard([modules])``."""
    reshard_after_forward: bool


@dataclass(frozen=True)
class AutoPlan:
    """``auto_shard``'s choice, its explanation and the simulation that verified it.

    ``apply(model, mesh=..., mp_policy=..., offload_policy=...)`` makes the calls: each
    of ``groups`` in order, then ``fully_shard(model)`` (the root: the modules not in
    a group, e.g. embeddings and norms, with ``reshard_after_forward`` left to torch's
    rule, which keeps the root's parameters from forward to backward).
    """

    budget_bytes: int
    groups: tuple[AutoGroup, ...]
    prefetch: str
    """``"implicit"``: no ``set_modules_to_*_prefetch`` call (torch's default, depth 1)."""
    explanations: tuple[str, ...]
    """Why each choice, one line each, in the order made."""
    plan: Plan
    """The simulation of the chosen calls; ``plan.peak_bytes <= budget_bytes``."""
    baseline: Plan
    """The finest grouping, every group resharded after forward."""
    simulations: int

    def apply(self, model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
        """Make the chosen ``fully_shard`` calls on ``model`` (a copy of the planned
        one: the same module FQNs), forwarding ``fully_shard_kwargs`` (``mesh``,
        ``mp_policy``, ``offload_policy``: the planned ones, for the plan to hold)."""
        return apply_calls(model, self.groups, **fully_shard_kwargs)

    def to_json(self) -> str:
        return json.dumps(
            {
                "budget_bytes": self.budget_bytes,
                "groups": [dataclasses.asdict(g) for g in self.groups],
                "prefetch": self.prefetch,
                "explanations": list(self.explanations),
                "simulations": self.simulations,
                "baseline_peak_bytes": self.baseline.peak_bytes,
                "plan": json.loads(self.plan.to_json()),
            },
            indent=1,
        )

    def __str__(self) -> str:
        calls = [
            f"  fully_shard({_call_target(g.fqns)}, reshard_after_forward={g.reshard_after_forward})"
            for g in self.groups
        ] + ["  fully_shard(model)  # the root"]
        counts = {
            kind: (
                self.plan.collectives.get(kind, {}).get("count", 0),
                self.baseline.collectives.get(kind, {}).get("count", 0),
            )
            for kind in self.baseline.collectives
        }
        return "\n".join(
            [
                (
                    f"auto_shard: budget {self.budget_bytes / MiB:.2f} MiB, predicted peak "
                    f"{self.plan.peak_bytes / MiB:.2f} MiB (one group per block "
                    f"{self.baseline.peak_bytes / MiB:.2f} MiB), {self.simulations} simulations"
                ),
                "collectives per step (chosen vs one group per block): "
                + ", ".join(f"{kind} {a} vs {b}" for kind, (a, b) in counts.items()),
                "calls:",
                *calls,
                "why:",
                *(f"  - {line}" for line in self.explanations),
                "",
                str(self.plan),
            ]
        )


def _call_target(fqns: tuple[str, ...]) -> str:
    """The modules as Python: ``blocks.0`` is ``model.blocks[0]``; a run of siblings
    ``blocks.0`` .. ``blocks.7`` is ``list(model.blocks[0:8])``."""
    names = [re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", f"model.{f}") for f in fqns]
    parent, _, first = fqns[0].rpartition(".")
    if len(fqns) > 1 and first.isdigit():
        end = int(first) + len(fqns)
        if list(fqns) == [f"{parent}.{i}" for i in range(int(first), end)]:
            return f"list({names[0].rpartition('[')[0]}[{first}:{end}])"
    return names[0] if len(names) == 1 else f"[{', '.join(names)}]"


def auto_shard(
    model: nn.Module | Any, *, budget_bytes: int, world_size: int, batch: Any, **settings: Any
) -> AutoPlan:
    """Choose the ``fully_shard`` calls for ``model`` that fit ``budget_bytes`` per rank
    with the fewest collectives: blocks merged into list groups, groups kept unsharded
    from forward to backward, and the prefetch; verified by simulating the choice.

    Args:
        model: as ``plan()``'s (a module, copied to ``meta``, or a factory). Its blocks
            are the children of its largest ``nn.ModuleList``; other modules stay in
            the root's group.
        budget_bytes: per-rank memory budget, in the bytes ``Plan.peak_bytes`` counts.
        world_size: ranks to simulate.
        batch: one rank's example batch, or a factory of it.
        **settings: ``plan()``'s other settings (``loss_fn``, ``mp_policy``,
            ``offload_policy``, ``replicate``, ``optimizer``, ...) but ``shard_fn``,
            which ``auto_shard`` chooses.

    Returns:
        An ``AutoPlan``: ``apply(model, mesh=...)`` makes the calls; ``print()`` and
        ``to_json()`` give the calls, the reasons and the verifying plan.

    Raises:
        ValueError: ``budget_bytes`` is not positive, or below the smallest peak a
            grouping reaches (the message names it); and ``plan()``'s errors.
        TypeError: ``shard_fn`` was passed.
    """
    if "shard_fn" in settings:
        raise TypeError(
            "auto_shard() chooses the fully_shard calls itself: drop shard_fn (to predict "
            "your own calls, use plan(..., shard_fn=...))"
        )
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    base_settings = PlanSettings(model, world_size, batch, **settings)
    blocks = _block_fqns(base_settings)
    calls = _calls(blocks, len(blocks), frozenset())
    baseline = simulate(dataclasses.replace(base_settings, shard_fn=_shard_fn(calls)))
    if baseline.peak_bytes > budget_bytes:
        raise ValueError(
            f"budget_bytes={budget_bytes} ({budget_bytes / MiB:.1f} MiB) is below the "
            f"smallest peak a grouping reaches: {baseline.peak_bytes} bytes "
            f"({baseline.peak_bytes / MiB:.1f} MiB), one group per block, every group "
            f"resharded after forward; pass budget_bytes >= {baseline.peak_bytes}, or "
            "lower the peak otherwise (more ranks, a smaller batch, mixed precision, "
            "activation checkpointing)"
        )
    return _search(base_settings, blocks, baseline, budget_bytes)


def _block_fqns(settings: PlanSettings) -> list[str]:
    """FQNs of the largest ``ModuleList``'s children, in order ([] without one)."""
    model = settings.build_meta_model()
    stack = largest_module_list(model)
    if stack is None:
        return []
    names = {module: name for name, module in model.named_modules()}
    return [names[block] for block in stack]


def apply_calls(
    model: nn.Module, groups: tuple[AutoGroup, ...], **fully_shard_kwargs: Any
) -> nn.Module:
    """``fully_shard`` on each of ``groups`` in order, then on the root."""
    modules = dict(model.named_modules())
    missing = [f for g in groups for f in g.fqns if f not in modules]
    if missing:
        raise ValueError(
            f"apply: {type(model).__name__} has no module {missing[0]!r}: apply the "
            "plan to the model it was made for (or a copy of it)"
        )
    for group in groups:
        targets = [modules[f] for f in group.fqns]
        fully_shard(
            targets[0] if len(targets) == 1 else targets,
            reshard_after_forward=group.reshard_after_forward,
            **fully_shard_kwargs,
        )
    return fully_shard(model, **fully_shard_kwargs)


def _calls(blocks: list[str], n_groups: int, kept: frozenset[int]) -> tuple[AutoGroup, ...]:
    """``blocks`` in ``n_groups`` runs of consecutive blocks, sizes differing by at most
    one (the largest group sets the memory); those indexed in ``kept`` not resharded."""
    size, extra = divmod(len(blocks), n_groups) if blocks else (0, 0)
    calls, start = [], 0
    for i in range(n_groups if blocks else 0):
        end = start + size + (i < extra)
        calls.append(AutoGroup(tuple(blocks[start:end]), i not in kept))
        start = end
    return tuple(calls)


@dataclass(frozen=True)
class _Predictor:
    """The peak of a choice predicted from the baseline plan's per-group figures."""

    baseline: Plan
    block_bytes: dict[str, int]

    def group_bytes(self, group: AutoGroup) -> int:
        return sum(self.block_bytes[f] for f in group.fqns)

    def merge_extra(self, calls: tuple[AutoGroup, ...]) -> int:
        """More unsharded bytes at once: see the module docstring, step 2."""
        largest = max((self.group_bytes(g) for g in calls), default=0)
        return _MERGE_COPIES * (largest - max(self.block_bytes.values(), default=0))

    def peak(self, calls: tuple[AutoGroup, ...]) -> int:
        """The baseline's timeline with each kept group's bytes added from its last
        module's forward to its first module's backward; the baseline's peak above its
        highest timeline point (temporaries inside a module) stays on top."""
        timeline = self.baseline.timeline
        base = max((p.live_bytes for p in timeline), default=0)
        highest = base
        kept = [g for g in calls if not g.reshard_after_forward]
        if kept and not timeline:
            highest += sum(self.group_bytes(g) for g in kept)
        spans = [
            (
                _first(timeline, g.fqns[-1], "post_forward"),
                _first(timeline, g.fqns[0], "post_backward"),
                self.group_bytes(g),
            )
            for g in kept
        ]
        for t, point in enumerate(timeline):
            held = sum(nbytes for start, end, nbytes in spans if start <= t < end)
            highest = max(highest, point.live_bytes + held)
        slack = max(0, self.baseline.peak_bytes - base)
        return max(self.baseline.peak_bytes, highest + slack) + self.merge_extra(calls)


def _first(timeline: list, fqn: str, event: str) -> int:
    return next(
        (i for i, p in enumerate(timeline) if p.fqn == fqn and p.event == event), len(timeline)
    )


def _search(settings: PlanSettings, blocks: list[str], baseline: Plan, budget: int) -> AutoPlan:
    rows = {g.fqn: g for g in baseline.groups}
    predictor = _Predictor(baseline, {f: rows[f].unsharded_bytes for f in blocks})
    why = [_why_blocks(blocks, rows)]
    n_groups = _merge(blocks, predictor, budget, why)
    kept = _keep(blocks, n_groups, predictor, budget, why)
    why.append(
        "root: fully_shard(model) with reshard_after_forward left to torch's rule (None): "
        "the root keeps its parameters from forward to backward, which starts at once"
    )
    why.append(_why_prefetch(baseline))
    simulations = 1
    calls = _calls(blocks, n_groups, kept)
    simulated = baseline
    while n_groups < len(blocks) or kept:
        if simulations == _MAX_SIMULATIONS:
            calls, simulated = _calls(blocks, len(blocks), frozenset()), baseline
            why.append("fell back to one group per block, fully resharded: it fits")
            break
        simulated = simulate(dataclasses.replace(settings, shard_fn=_shard_fn(calls)))
        simulations += 1
        if simulated.peak_bytes <= budget:
            break
        # The prediction was short: give up the longest-held kept group, else split
        # the groups in two.
        if kept:
            kept = kept - {min(kept)}
        else:
            n_groups = min(len(blocks), 2 * n_groups)
        why.append(
            f"simulated peak {simulated.peak_bytes / MiB:.2f} MiB (predicted "
            f"{predictor.peak(calls) / MiB:.2f}) exceeds the budget: now {n_groups} "
            f"groups, {len(kept)} kept"
        )
        calls = _calls(blocks, n_groups, kept)
    why.append(
        f"verified by simulation: peak {simulated.peak_bytes / MiB:.2f} MiB (predicted "
        f"{predictor.peak(calls) / MiB:.2f}) <= budget {budget / MiB:.2f} MiB"
    )
    return AutoPlan(budget, calls, "implicit", tuple(why), simulated, baseline, simulations)


def _merge(blocks: list[str], predictor: _Predictor, budget: int, why: list[str]) -> int:
    """The fewest groups that fit, and not fewer than ``_MIN_GROUPS``."""
    best, stop = len(blocks), "there is one block or none"
    for n_groups in range(len(blocks) - 1, 0, -1):
        if n_groups < _MIN_GROUPS:
            stop = f"{n_groups} groups would be fewer than {_MIN_GROUPS}"
            break
        peak = predictor.peak(_calls(blocks, n_groups, frozenset()))
        if peak > budget:
            stop = f"{n_groups} groups would reach a predicted {peak / MiB:.2f} MiB > budget"
            break
        best = n_groups
    largest = max((predictor.group_bytes(g) for g in _calls(blocks, best, frozenset())), default=0)
    why.append(
        f"merge: {len(blocks)} blocks in {best} fully_shard calls of consecutive blocks "
        f"(one all-gather and one reduce-scatter cover each); largest group "
        f"{largest / MiB:.2f} MiB unsharded; {stop}"
        if blocks
        else "merge: no nn.ModuleList, the model is one group (the root)"
    )
    return best


def _keep(
    blocks: list[str], n_groups: int, predictor: _Predictor, budget: int, why: list[str]
) -> frozenset[int]:
    """Groups not resharded after forward, from the last back, while the peak fits."""
    kept: frozenset[int] = frozenset()
    refused = ""
    for i in reversed(range(n_groups)):
        peak = predictor.peak(_calls(blocks, n_groups, kept | {i}))
        if peak <= budget:
            kept = kept | {i}
        elif not refused:
            refused = f"; group {i} not kept: predicted {peak / MiB:.2f} MiB > budget"
    names = [_calls(blocks, n_groups, kept)[i].fqns[0] for i in sorted(kept)]
    why.append(
        f"reshard_after_forward=False for {len(kept)} of {n_groups} groups "
        f"({', '.join(names) or 'none'}; the last first: its backward comes first, so its "
        "all-gather would be exposed, and it is freed soonest): one all-gather fewer each, "
        f"predicted peak {predictor.peak(_calls(blocks, n_groups, kept)) / MiB:.2f} MiB{refused}"
    )
    return kept


def _why_blocks(blocks: list[str], rows: dict[str, Any]) -> str:
    if not blocks:
        return "blocks: none (no nn.ModuleList)"
    root = rows[""]
    return (
        f"blocks: the {len(blocks)} children of the largest nn.ModuleList "
        f"({blocks[0]} .. {blocks[-1]}); the other modules' {root.params:,} parameters "
        f"({root.unsharded_bytes / MiB:.2f} MiB unsharded: embeddings, norms, head) stay "
        "in the root's group, not a group of their own"
    )


def _why_prefetch(baseline: Plan) -> str:
    phases = ", ".join(
        f"{p} {baseline.comm_s(p) * 1e3:.3f} ms comm vs {baseline.compute_s(p) * 1e3:.3f} ms "
        "compute"
        for p in ("forward", "backward")
    )
    return (
        "prefetch: implicit (torch's default, depth 1, no set_modules_to_*_prefetch): at "
        "depth 1 a phase's collectives already overlap its compute where compute is longer, "
        "and where they are longer (bandwidth-bound) a deeper prefetch cannot shorten them; "
        f"it would hold one more group unsharded ({phases}, baseline)"
    )


def _shard_fn(calls: tuple[AutoGroup, ...]) -> Any:
    return functools.partial(apply_calls, groups=calls)
