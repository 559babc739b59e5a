"""``Plan``: what a simulated training step predicts for one rank, as figures, a table
(``str(plan)``) and JSON (``plan.to_json()``).

Time model (simple on purpose, a lower bound): each collective sends its ring traffic,
``(n - 1) / n`` of its unsharded buffer for an all-gather or a reduce-scatter over ``n``
ranks and twice that for an all-reduce, over one link of ``link_gbps``; compute is the
phase's FLOPs (``FlopCounterMode``) at ``tflops``. Within a phase (forward, backward)
communication overlaps compute perfectly, so a phase takes ``max(compute, comm)`` and
the communication exposed is the excess. The optimizer step, kernel launches and
latency are left out.
"""

import json
from dataclasses import asdict, dataclass, field

from .recorders import CATEGORIES, TimelinePoint
from .settings import PlanSettings

GiB, MiB = 2**30, 2**20
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def _size(nbytes: float) -> str:
    return f"{nbytes / GiB:.2f} GiB" if nbytes >= GiB else f"{nbytes / MiB:.1f} MiB"


@dataclass(frozen=True)
class GroupPlan:
    """One ``fully_shard`` group's figures for one step of one rank."""

    fqn: str
    """The group's module FQN ('' for the root)."""
    params: int
    """Parameters (elements) it manages."""
    unsharded_bytes: int
    """Its all-gather output: every rank's padded shard, in the parameter dtype."""
    reshard_after_forward: bool | int
    collectives: dict[str, dict[str, int]]
    """``{kind: {"count": n, "bytes": unsharded bytes}}`` per step (ours' trace)."""
    comm_s: dict[str, float]
    """Its collectives' time on the link, per phase (``forward``, ``backward``)."""
    forward_flops: int
    backward_flops: int
    """FLOPs of the modules it owns (not of groups nested in it), this rank's batch."""


@dataclass(frozen=True)
class Plan:
    """Predicted memory, communication and compute of one training step, per rank.

    Every rank holds the same bytes: shards are padded to equal sizes, so rank 0 (the
    one simulated) stands for all. Byte figures are what ``MemTracker`` counts under
    fake tensors: live tensor storage, not allocator caching or fragmentation.
    """

    model: str
    world_size: int
    replicate: int
    optimizer: str
    param_dtype: str
    reduce_dtype: str
    offload: bool
    backend: str
    """The collectives' backend simulated (``PlanSettings.backend``)."""
    link_gbps: float
    tflops: float
    model_params: int
    """Parameters of the whole model (elements)."""
    model_bytes: int
    """Bytes of the whole model's parameters, unsharded, in their original dtypes."""
    sharded_param_bytes: int
    sharded_grad_bytes: int
    optimizer_state_bytes: int
    """This rank's parameter shards, gradient shards and optimizer states after the
    optimizer step (padding included)."""
    peak_bytes: int
    """Predicted peak of live bytes in the step (step 2: step 1's optimizer state
    creation over-counts under fake tensors)."""
    peak_breakdown: dict[str, int]
    """``peak_bytes`` per MemTracker category (they add up to it)."""
    peak_module: str
    """The innermost module running at the peak ('' is the root)."""
    peak_phase: str
    """``forward``, ``backward`` or ``optimizer step``."""
    groups: list[GroupPlan]
    collectives: dict[str, dict[str, int]]
    """``{kind: {"count", "bytes"}}`` per step, counted at the c10d level (all senders)."""
    forward_flops: int
    backward_flops: int
    timeline: list[TimelinePoint]
    """Live bytes at each module's forward and backward boundaries, in step order."""
    planning_s: float
    settings: PlanSettings | None = field(default=None, repr=False, compare=False)
    """What was simulated, for ``replan``; not in the JSON."""

    @property
    def optimizer_bytes_per_param(self) -> float:
        """Optimizer-state bytes per element of this rank's (padded) parameter shards."""
        mean_itemsize = self.model_bytes / self.model_params
        return self.optimizer_state_bytes * mean_itemsize / self.sharded_param_bytes

    def compute_s(self, phase: str) -> float:
        flops = self.forward_flops if phase == "forward" else self.backward_flops
        return flops / (self.tflops * 1e12)

    def comm_s(self, phase: str) -> float:
        return sum(group.comm_s.get(phase, 0.0) for group in self.groups)

    @property
    def step_s(self) -> float:
        """Lower bound on forward + backward time: each phase ``max(compute, comm)``."""
        return sum(max(self.compute_s(p), self.comm_s(p)) for p in ("forward", "backward"))

    @property
    def exposed_comm_s(self) -> float:
        return sum(max(0.0, self.comm_s(p) - self.compute_s(p)) for p in ("forward", "backward"))

    def fits(self, budget_bytes: int) -> bool:
        return self.peak_bytes <= budget_bytes

    def to_json(self) -> str:
        out = asdict(self)
        del out["settings"]
        out["optimizer_bytes_per_param"] = self.optimizer_bytes_per_param
        out["step_s"] = self.step_s
        out["exposed_comm_s"] = self.exposed_comm_s
        return json.dumps(out, indent=1)

    def __str__(self) -> str:
        return "\n".join(self._header() + [""] + self._group_table())

    def _header(self) -> list[str]:
        mesh = (
            f"HSDP {self.replicate}x{self.world_size // self.replicate}"
            if self.replicate > 1
            else "FSDP"
        )
        breakdown = ", ".join(
            f"{name} {_size(self.peak_breakdown[name])}"
            for name in CATEGORIES
            if self.peak_breakdown[name]
        )
        collectives = "; ".join(
            f"{kind} {entry['count']} x, {_size(entry['bytes'])}"
            for kind, entry in self.collectives.items()
        )
        phases = "; ".join(
            f"{p} {self.compute_s(p) * 1e3:.1f} ms compute vs {self.comm_s(p) * 1e3:.1f} ms comm"
            for p in ("forward", "backward")
        )
        return [
            (
                f"plan: {self.model}, {self.model_params / 1e9:.3f}B params "
                f"({_size(self.model_bytes)}) | W={self.world_size} {mesh} | "
                f"{self.optimizer} | param {self.param_dtype}, reduce {self.reduce_dtype} | "
                f"offload {'on' if self.offload else 'off'} | {self.backend} | "
                f"planned in {self.planning_s:.1f} s"
            ),
            (
                f"per rank: sharded params {_size(self.sharded_param_bytes)}, grads "
                f"{_size(self.sharded_grad_bytes)}, optimizer states "
                f"{_size(self.optimizer_state_bytes)} "
                f"({self.optimizer_bytes_per_param:.1f} B/param)"
            ),
            (
                f"predicted peak {_size(self.peak_bytes)} in "
                f"{self.peak_module or '(root)'} ({self.peak_phase}): {breakdown}"
            ),
            f"collectives per step (c10d): {collectives or 'none'}",
            (
                f"at {self.tflops:g} TFLOP/s and {self.link_gbps:g} Gbit/s: {phases}; "
                f"step >= {self.step_s * 1e3:.1f} ms, exposed comm "
                f"{self.exposed_comm_s * 1e3:.1f} ms"
            ),
        ]

    def _group_table(self) -> list[str]:
        header = (
            f"{'group':<16} {'params':>14} {'unsharded MiB':>13} {'reshard':>7} "
            f"{'AG':>4} {'AG MiB':>9} {'RS':>4} {'RS MiB':>9} {'AR':>4} {'AR MiB':>9} "
            f"{'comm ms':>8} {'fwd GFLOP':>10} {'bwd GFLOP':>10}"
        )
        rows = [header, "-" * len(header)]
        for g in self.groups:
            c = {kind: g.collectives.get(kind, {"count": 0, "bytes": 0}) for kind in KINDS}
            rows.append(
                f"{g.fqn or '(root)':<16} {g.params:>14,} {g.unsharded_bytes / MiB:>13.1f} "
                f"{g.reshard_after_forward!s:>7} "
                + " ".join(
                    f"{c[kind]['count']:>4} {c[kind]['bytes'] / MiB:>9.1f}" for kind in KINDS
                )
                + f" {sum(g.comm_s.values()) * 1e3:>8.2f} {g.forward_flops / 1e9:>10.1f}"
                f" {g.backward_flops / 1e9:>10.1f}"
            )
        return rows
