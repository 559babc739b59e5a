"""``auto_shard``: choose the ``fully_shard`` calls under a per-rank memory budget.

Every grouping it considers is predicted from one simulated plan; the one chosen is
confirmed by simulating it:

1. Simulate the finest grouping, fully resharded (``shard_largest_module_list``: one
   group per block of the largest ``nn.ModuleList``, the rest in the root). Its peak is
   the smallest budget this search can meet; below it, ``ValueError``.
2. Predict (``candidates.py``), for every number of groups that fits, the peak and the
   step time of its variants: consecutive blocks merged into list groups
   (``fully_shard([...])``, sizes differing by at most one: one all-gather and one
   reduce-scatter cover a group); the longest run of groups, from the last back, kept
   unsharded from forward to backward (``reshard_after_forward=False``: one all-gather
   fewer each; the last group's backward comes first and frees it soonest); a forward
   prefetch depth of 0 (torch's default), 1 or 2 (each call issues the next one or two
   calls' all-gathers when its forward starts, the root the first ones'). Memory: a
   larger group holds more unsharded bytes at once, the group running, the one
   prefetched and its unsharded gradients, so ``MERGE_COPIES`` times the growth of the
   largest group is added to the peak; a kept group's bytes are added to the
   baseline's timeline from its forward to its backward, a prefetched group's from the
   forward of the call that prefetches it. Time: the event model of ``timing.py``
   (compute, a fixed host cost per collective, the link), from the baseline's
   per-block FLOPs and bytes.
3. Choose the fastest predicted variant within the budget (on a tie: fewer collectives,
   then a forward prefetch of depth 1, 2, 0). The root keeps its parameters by torch's
   rule (``reshard_after_forward=None`` on the root); backward prefetch stays torch's
   implicit one (depth 1).
4. Simulate the choice. If its peak exceeds the budget (the prediction was short),
   choose again as in 3. with the budget lowered by the prediction's error (simulated
   minus predicted peak), never the same choice twice, and simulate that
   (``_MAX_SIMULATIONS`` in all); the fully resharded finest grouping, already
   simulated, always fits.
"""

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.nn.attention import SDPBackend

from ..api import MixedPrecisionPolicy, OffloadPolicy
from ..fully_shard import fully_shard
from .candidates import AutoGroup, Choice, Predictor, calls_of, candidates, count, fastest
from .report import MiB, Plan
from .settings import (
    LossFn,
    OptimizerFactory,
    PlanSettings,
    default_loss,
    largest_module_list,
)
from .simulate import simulate

__all__ = ["AutoGroup", "AutoPlan", "apply_calls", "auto_shard"]

# Simulations in all, the baseline's included: each costs seconds on a large model.
_MAX_SIMULATIONS = 4
# A collective's fixed cost on the host (timing.py), microseconds, per backend when the
# caller gives none. gloo: a value between two figures measured on a 2-core CPU, 2
# ranks: an all-gather of a few bytes takes 0.3 ms between idle ranks, and each
# collective fewer saved about 2.3 ms of the tiny Llama's step (both blocks kept, one
# group against two: 4.7 ms for an all-gather and a reduce-scatter fewer), the gloo
# threads competing with the compute for the cores. nccl: an assumption, not measured
# on a GPU yet: a launch plus FSDP's copies and hooks on the host.
_OVERHEAD_US = {"nccl": 50.0, "gloo": 1000.0}


@dataclass(frozen=True)
class AutoPlan:
    """``auto_shard``'s choice, its explanation and the simulation that verified it.

    ``apply(model, mesh=..., mp_policy=..., offload_policy=...)`` makes the calls: each
    of ``groups`` in order, then ``fully_shard(model)`` (the root: the modules not in
    a group, e.g. embeddings and norms, with ``reshard_after_forward`` left to torch's
    rule, which keeps the root's parameters from forward to backward), then with
    ``forward_prefetch`` the ``set_modules_to_forward_prefetch`` calls.
    """

    budget_bytes: int
    groups: tuple[AutoGroup, ...]
    forward_prefetch: int
    """Forward prefetch depth: each call prefetches the next ``forward_prefetch`` calls'
    all-gathers when its forward starts (``set_modules_to_forward_prefetch``; the root
    the first ones'); 0 is torch's default, no such call. Backward prefetch is torch's
    implicit one (depth 1)."""
    step_s: float
    """The chosen calls' forward and backward time predicted by ``timing.py``."""
    baseline_step_s: float
    """The same for one group per block, every group resharded after forward."""
    explanations: tuple[str, ...]
    """Why each choice, one line each, in the order made."""
    plan: Plan
    """The simulation of the chosen calls; ``plan.peak_bytes <= budget_bytes``."""
    baseline: Plan
    """The finest grouping, every group resharded after forward."""
    simulations: int

    def apply(self, model: nn.Module, **fully_shard_kwargs: Any) -> nn.Module:
        """Make the chosen ``fully_shard`` and forward prefetch calls on ``model`` (a
        copy of the planned one: the same module FQNs), forwarding
        ``fully_shard_kwargs`` (``mesh``, ``mp_policy``, ``offload_policy``: the planned
        ones, for the plan to hold)."""
        return apply_calls(
            model, self.groups, forward_prefetch=self.forward_prefetch, **fully_shard_kwargs
        )

    def to_json(self) -> str:
        return json.dumps(
            {
                "budget_bytes": self.budget_bytes,
                "groups": [dataclasses.asdict(g) for g in self.groups],
                "forward_prefetch": self.forward_prefetch,
                "step_s": self.step_s,
                "baseline_step_s": self.baseline_step_s,
                "explanations": list(self.explanations),
                "simulations": self.simulations,
                "baseline_peak_bytes": self.baseline.peak_bytes,
                "plan": json.loads(self.plan.to_json()),
            },
            indent=1,
        )

    def __str__(self) -> str:
        calls = [
            f"  fully_shard({_call_target(g.fqns)}, "
            f"reshard_after_forward={g.reshard_after_forward})"
            for g in self.groups
        ] + ["  fully_shard(model)  # the root"]
        if self.forward_prefetch:
            names = ["model"] + [_call_target(g.fqns[:1]) for g in self.groups]
            calls += [
                f"  {name}.set_modules_to_forward_prefetch([{', '.join(targets)}])"
                for name, targets in zip(names, _prefetch_targets(names[1:], self.forward_prefetch))
            ]
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
                    f"{self.baseline.peak_bytes / MiB:.2f} MiB), {self.simulations} simulations; "
                    f"predicted step {self.step_s * 1e3:.3f} ms (one group per block "
                    f"{self.baseline_step_s * 1e3:.3f} ms)"
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
    model: nn.Module | Callable[[], nn.Module],
    *,
    budget_bytes: int,
    world_size: int,
    batch: Any,
    overhead_us: float | None = None,
    loss_fn: LossFn = default_loss,
    replicate: int = 1,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    optimizer: str | OptimizerFactory = "adamw",
    link_gbps: float = 400.0,
    tflops: float = 400.0,
    backend: str = "nccl",
    sdpa_backends: tuple[SDPBackend, ...] | None = None,
) -> AutoPlan:
    """Choose the ``fully_shard`` calls for ``model`` that fit ``budget_bytes`` per rank
    with the shortest predicted step: blocks merged into list groups, groups kept
    unsharded from forward to backward, and the forward prefetch; verified by
    simulating the choice.

    Args:
        model: as ``plan()``'s (a module, copied to ``meta``, or a factory). Its blocks
            are the children of its largest ``nn.ModuleList``; other modules stay in
            the root's group.
        budget_bytes: per-rank memory budget, in the bytes ``Plan.peak_bytes`` counts.
        world_size: ranks to simulate.
        batch: one rank's example batch, or a factory of it.
        overhead_us: a collective's fixed cost on the host, microseconds, in the time
            model (``timing.py``); by default per ``backend``: 50 for ``"nccl"`` (an
            assumption), 1000 for ``"gloo"`` (from measurements on a 2-core CPU). The link's
            bandwidth and the compute's throughput are ``plan()``'s ``link_gbps`` and
            ``tflops``.
        loss_fn, replicate, mp_policy, offload_policy, optimizer, link_gbps, tflops,
            backend, sdpa_backends: as ``plan()``'s (whose ``shard_fn`` is what
            ``auto_shard`` chooses).

    Returns:
        An ``AutoPlan``: ``apply(model, mesh=...)`` makes the calls; ``print()`` and
        ``to_json()`` give the calls, the reasons and the verifying plan.

    Raises:
        ValueError: ``budget_bytes`` is not positive, or below the smallest peak a
            grouping reaches (the message names it); and ``plan()``'s errors.
    """
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    if overhead_us is not None and overhead_us < 0:
        raise ValueError(f"overhead_us must not be negative, got {overhead_us}")
    base_settings = PlanSettings(
        model,
        world_size,
        batch,
        loss_fn=loss_fn,
        replicate=replicate,
        mp_policy=mp_policy,
        offload_policy=offload_policy,
        optimizer=optimizer,
        link_gbps=link_gbps,
        tflops=tflops,
        backend=backend,
        sdpa_backends=sdpa_backends,
    )
    if overhead_us is None:
        overhead_us = _OVERHEAD_US[base_settings.backend]
    blocks = _block_fqns(base_settings)
    calls = calls_of(blocks, len(blocks), frozenset())
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
    return _search(base_settings, blocks, baseline, budget_bytes, overhead_us * 1e-6)


def _block_fqns(settings: PlanSettings) -> list[str]:
    """FQNs of the largest ``ModuleList``'s children, in order ([] without one)."""
    model = settings.build_meta_model()
    stack = largest_module_list(model)
    if stack is None:
        return []
    names = {module: name for name, module in model.named_modules()}
    return [names[block] for block in stack]


def apply_calls(
    model: nn.Module,
    groups: tuple[AutoGroup, ...],
    forward_prefetch: int = 0,
    **fully_shard_kwargs: Any,
) -> nn.Module:
    """``fully_shard`` on each of ``groups`` in order, then on the root; then the root
    and each group prefetch the next ``forward_prefetch`` groups in forward (the first
    module of a list group stands for it)."""
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
    root = fully_shard(model, **fully_shard_kwargs)
    if forward_prefetch:
        firsts = [modules[g.fqns[0]] for g in groups]
        for module, targets in zip([root, *firsts], _prefetch_targets(firsts, forward_prefetch)):
            module.set_modules_to_forward_prefetch(targets)
    return root


def _prefetch_targets(firsts: list, depth: int) -> list[list]:
    """For the root and each group in forward order, the next ``depth`` groups (none
    after the last)."""
    return [firsts[i : i + depth] for i in range(len(firsts))]


def _search(
    settings: PlanSettings, blocks: list[str], baseline: Plan, budget: int, overhead_s: float
) -> AutoPlan:
    predictor = Predictor(baseline, blocks, settings.tflops, overhead_s, settings.backend)
    finest = calls_of(blocks, len(blocks), frozenset())
    fallback = Choice.of(finest, 0, predictor)
    options = candidates(blocks, predictor, budget)
    choice = fastest(options) or fallback
    simulations, error, retries = 1, 0, []
    tried: set[tuple[tuple[AutoGroup, ...], int]] = set()
    verified: Plan | None = None
    while (choice.calls, choice.forward_prefetch) != (finest, 0):
        if simulations == _MAX_SIMULATIONS:
            break
        shard_fn = _shard_fn(choice.calls, choice.forward_prefetch)
        simulated = simulate(dataclasses.replace(settings, shard_fn=shard_fn))
        simulations += 1
        if simulated.peak_bytes <= budget:
            verified = simulated
            break
        # The prediction was short: choose again as if the budget were smaller by the
        # prediction's error (mostly the merged groups' extra copies, alike for the
        # neighbouring choices), never the same choice twice.
        tried.add((choice.calls, choice.forward_prefetch))
        error = max(error, simulated.peak_bytes - choice.peak)
        options = [
            c
            for c in candidates(blocks, predictor, budget - error)
            if (c.calls, c.forward_prefetch) not in tried
        ]
        retries.append(
            f"simulated peak {simulated.peak_bytes / MiB:.2f} MiB exceeds the budget "
            f"({choice.describe()} predicted): choosing again with the budget lowered by "
            f"the prediction's error, {error / MiB:.2f} MiB"
        )
        choice = fastest(options) or fallback
    fell_back = verified is None and bool(retries)
    if verified is None:  # the finest grouping, fully resharded: the baseline, which fits
        if retries:
            retries.append("fell back to one group per block, fully resharded: it fits")
        choice, verified = fallback, baseline
    if fell_back:
        merge, keep, prefetch = (
            "merge: none, one group per block (the fallback: no faster grouping was "
            "verified within the budget, see below)",
            "reshard_after_forward=True for every group (the fallback)",
            "prefetch: implicit (torch's default; the fallback)",
        )
    else:
        merge = _why_merge(blocks, choice, options, fallback, predictor)
        keep, prefetch = _why_keep(choice, error), _why_prefetch(choice, options)
    why = [
        _why_blocks(blocks, baseline),
        merge,
        keep,
        (
            "root: fully_shard(model) with reshard_after_forward left to torch's rule (None): "
            "the root keeps its parameters from forward to backward, which starts at once"
        ),
        prefetch,
        (
            f"time model (timing.py): {settings.tflops:g} TFLOP/s, {settings.link_gbps:g} "
            f"Gbit/s, {overhead_s * 1e6:g} us per collective on the host"
            + (
                ", every forward all-gather issued a group earlier than its prefetch depth "
                "says (a GPU's host runs ahead of its device)"
                if predictor.host_ahead
                else ""
            )
        ),
        *retries,
        (
            f"verified by simulation: peak {verified.peak_bytes / MiB:.2f} MiB (predicted "
            f"{choice.peak / MiB:.2f}) <= budget {budget / MiB:.2f} MiB"
        ),
    ]
    return AutoPlan(
        budget,
        choice.calls,
        choice.forward_prefetch,
        choice.step_s,
        fallback.step_s,
        tuple(why),
        verified,
        baseline,
        simulations,
    )


def _why_merge(
    blocks: list[str],
    best: Choice,
    options: list[Choice],
    fallback: Choice,
    predictor: Predictor,
) -> str:
    if not blocks:
        return "merge: no nn.ModuleList, the model is one group (the root)"
    largest = max(predictor.group_bytes(g) for g in best.calls)
    fewest = min((len(c.calls) for c in options), default=len(blocks))
    others = sorted(
        {len(best.calls) - 1, len(best.calls) + 1, fewest, len(blocks)} - {len(best.calls)}
    )
    alternatives = [
        min((c for c in options if len(c.calls) == n), key=lambda c: c.step_s)
        for n in others
        if any(len(c.calls) == n for c in options)
    ]
    return (
        f"merge: {len(blocks)} blocks in {count(len(best.calls), 'fully_shard call')} of "
        f"consecutive blocks (one all-gather and one reduce-scatter cover each), the "
        f"fastest predicted step of the groupings that fit; largest group "
        f"{largest / MiB:.2f} MiB unsharded; chosen: {best.describe()}"
        + "".join(f"; against {c.describe()}" for c in alternatives)
        + f"; {count(fewest, 'group')} the fewest that fit; one group per block, fully "
        f"resharded: {fallback.step_s * 1e3:.3f} ms"
    )


def _why_keep(best: Choice, error: int) -> str:
    if not best.calls:
        return "reshard_after_forward: no group but the root"
    names = [best.calls[i].fqns[0] for i in sorted(best.kept)]
    room = (
        f"the budget less the prediction's error ({error / MiB:.2f} MiB)" if error else "the budget"
    )
    return (
        f"reshard_after_forward=False for {len(best.kept)} of {len(best.calls)} groups "
        f"({', '.join(names) or 'none'}; the last first: its backward comes first, so its "
        "all-gather would be exposed, and it is freed soonest): one all-gather fewer each, "
        f"the longest such run that fits {room}"
    )


def _why_prefetch(best: Choice, options: list[Choice]) -> str:
    others = [
        c
        for c in options
        if len(c.calls) == len(best.calls) and c.forward_prefetch != best.forward_prefetch
    ]
    head = (
        f"prefetch: forward depth {best.forward_prefetch} (each call issues the next "
        f"{count(best.forward_prefetch, 'call')}' all-gathers when its forward starts, the "
        "root the first ones'), backward implicit (depth 1)"
        if best.forward_prefetch
        else "prefetch: implicit (torch's default: depth 1 in backward, none in forward)"
    )
    return "".join([head, *(f"; against {c.describe()}" for c in others)])


def _why_blocks(blocks: list[str], baseline: Plan) -> str:
    if not blocks:
        return "blocks: none (no nn.ModuleList)"
    root = next((g for g in baseline.groups if g.fqn == ""), None)
    held = (
        f"modules' {root.params:,} parameters ({root.unsharded_bytes / MiB:.2f} MiB "
        "unsharded: embeddings, norms, head)"
        if root is not None
        else "modules (no parameters of their own)"
    )
    return (
        f"blocks: the {len(blocks)} children of the largest nn.ModuleList "
        f"({blocks[0]} .. {blocks[-1]}); the other {held} stay in the root's group, not a "
        "group of their own"
    )


def _shard_fn(calls: tuple[AutoGroup, ...], forward_prefetch: int = 0) -> Any:
    return functools.partial(apply_calls, groups=calls, forward_prefetch=forward_prefetch)
