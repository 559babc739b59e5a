"""Plans of a long stack of identical blocks from two short simulations.

Simulating a step costs time per module (MemTracker and FlopCounterMode walk the
active modules at every op), so a 70B Llama's 80 blocks take minutes where 2 and 3
blocks take seconds. Every figure of a stack of identical, identically sharded blocks
grows by the same amount per block: sharded bytes, collectives, FLOPs, and the peak
(each block adds its saved activations and its shards, wherever the peak falls). So
``f(n) = f(k + 1) + (n - k - 1) * (f(k + 1) - f(k))`` from plans of ``k`` and ``k + 1``
blocks, once ``k`` is past the stack's ends: the peak falls in the backward of the
second-to-last block, with the last one's gradients in flight, so the first two and
the last two blocks differ from the rest and ``k >= 3`` (measured: the increment is
constant from 3 blocks on). ``tests/plan/test_plan.py`` checks it against a whole
simulation.
"""

import dataclasses
import re

from .report import GroupPlan, Plan

_BYTE_FIELDS = (
    "model_params",
    "model_bytes",
    "sharded_param_bytes",
    "sharded_grad_bytes",
    "optimizer_state_bytes",
    "peak_bytes",
    "forward_flops",
    "backward_flops",
)


def compose(short: Plan, longer: Plan, n_blocks: int, stack: str = "layers") -> Plan:
    """The plan of ``n_blocks`` blocks under ``stack`` (an ``nn.ModuleList`` FQN),
    from ``short`` and ``longer``, plans of the same model with one block fewer and
    ``longer``'s block count (at least 4; see the module docstring).

    The timeline is ``longer``'s; the composed plan has no settings to ``replan``.
    """
    blocks = _block_rows(longer, stack)
    k = len(blocks)
    if len(_block_rows(short, stack)) != k - 1 or k < 4 or n_blocks < k:
        raise ValueError(
            f"compose needs plans of k - 1 and k >= 4 blocks under '{stack}' and "
            f"n_blocks >= k; got {len(_block_rows(short, stack))}, {k} and {n_blocks}"
        )
    extra = n_blocks - k

    def grow(a: float, b: float) -> int:
        return int(b + extra * (b - a))

    figures = {name: grow(getattr(short, name), getattr(longer, name)) for name in _BYTE_FIELDS}
    breakdown = {
        name: grow(short.peak_breakdown[name], value)
        for name, value in longer.peak_breakdown.items()
    }
    collectives = {
        kind: {key: grow(short.collectives[kind][key], value) for key, value in entry.items()}
        for kind, entry in longer.collectives.items()
    }
    return dataclasses.replace(
        longer,
        **figures,
        peak_breakdown=breakdown,
        peak_module=_renumber_last(longer.peak_module, stack, k, n_blocks),
        groups=_grown_groups(longer.groups, stack, k, n_blocks),
        collectives=collectives,
        planning_s=short.planning_s + longer.planning_s,
        settings=None,
    )


def _block_rows(plan: Plan, stack: str) -> list[GroupPlan]:
    return [g for g in plan.groups if re.fullmatch(rf"{re.escape(stack)}\.\d+", g.fqn)]


def _renumber_last(fqn: str, stack: str, k: int, n_blocks: int) -> str:
    """The last two simulated blocks stand for the last two real ones."""
    for j in (k - 2, k - 1):
        block = f"{stack}.{j}"
        if fqn == block or fqn.startswith(block + "."):
            return f"{stack}.{n_blocks - k + j}" + fqn[len(block) :]
    return fqn


def _grown_groups(groups: list[GroupPlan], stack: str, k: int, n_blocks: int) -> list[GroupPlan]:
    """The first blocks and the last two as simulated, the others like block k - 3."""
    rows = {g.fqn: g for g in groups}
    blocks = []
    for j in range(n_blocks):
        source = j if j < k - 3 else k - 3 if j < n_blocks - 2 else j - (n_blocks - k)
        blocks.append(dataclasses.replace(rows[f"{stack}.{source}"], fqn=f"{stack}.{j}"))
    first = next(i for i, g in enumerate(groups) if g.fqn == f"{stack}.0")
    others = [g for g in groups if g.fqn not in {f"{stack}.{j}" for j in range(k)}]
    return others[:first] + blocks + others[first:]
