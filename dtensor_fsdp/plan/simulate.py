"""``plan()``: simulate training steps on fake tensors and torch's fake process group,
and turn what they did into a ``Plan``.

Pieces: torch's ``fake`` process group (any world size in one process, collectives
move nothing), ``FakeTensorMode`` (shapes and dtypes, no memory, no arithmetic),
``MemTracker`` (live bytes by category), ``FlopCounterMode`` (FLOPs); ours: the
``fully_shard`` being planned, its ``CommTrace`` (collectives per group and phase) and
a c10d-level count of every collective.
"""

import contextlib
import dataclasses
import enum
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.flop_counter import FlopCounterMode

from ..api import CPUOffloadPolicy, FSDPGroupInfo, MixedPrecisionPolicy, OffloadPolicy
from ..fsdp_module import FSDPModule
from ..observe.trace import CommTrace
from .all_to_all import AllToAllReduceScatter
from .recorders import C10dCounter, PeakTracker
from .report import GroupPlan, Plan
from .settings import (
    LossFn,
    OptimizerFactory,
    PlanSettings,
    ShardFn,
    default_loss,
    shard_largest_module_list,
)

# Step 1 creates the optimizer states, which MemTracker over-counts under fake tensors;
# from step 2 on its figures match real runs. The plan reports step 2.
_STEPS = 2


def plan(
    model: nn.Module | Callable[[], nn.Module],
    *,
    world_size: int,
    batch: Any,
    loss_fn: LossFn = default_loss,
    replicate: int = 1,
    shard_fn: ShardFn = shard_largest_module_list,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    optimizer: str | OptimizerFactory = "adamw",
    link_gbps: float = 400.0,
    tflops: float = 400.0,
    backend: str = "nccl",
    sdpa_backends: tuple[SDPBackend, ...] | None = None,
) -> Plan:
    """Simulate training steps of ``model`` sharded over ``world_size`` ranks, in this
    process and without allocating its memory, and predict one rank's memory,
    collectives and compute. The arguments are ``PlanSettings``' fields.

    Args:
        model: an ``nn.Module`` (on ``meta`` or real; a ``meta`` copy is planned, the
            module is left as it is) or a factory returning one (called under
            ``torch.device("meta")``).
        world_size: ranks to simulate.
        batch: one rank's example batch, or a factory of it (called under fake
            tensors, so a large batch costs no memory).
        loss_fn: ``loss_fn(model, batch)`` runs the forward and returns the scalar
            loss; by default ``model(batch).sum()``.
        replicate: HSDP's replicas (the mesh is ``(replicate, world_size //
            replicate)``); 1 is FSDP.
        shard_fn: ``shard_fn(model, mesh=, mp_policy=, offload_policy=)`` makes the
            ``fully_shard`` calls, forwarding those keyword arguments; by default
            ``shard_largest_module_list``: each child of the largest ``ModuleList``,
            then the root.
        mp_policy: ``fully_shard``'s mixed precision.
        offload_policy: ``fully_shard``'s offload policy.
        optimizer: ``"sgd"``, ``"sgd_momentum"``, ``"adam"``, ``"adamw"``, or a factory
            ``params -> torch.optim.Optimizer``.
        link_gbps: per-rank network bandwidth, Gbit/s, for the communication times.
        tflops: achieved compute throughput per rank, TFLOP/s, for the compute times.
        backend: the job's collectives: ``"nccl"`` or ``"gloo"`` (ours reduce-scatters
            there by an all-to-all plus a local sum, whose receive buffer counts in
            the peak).
        sdpa_backends: the attention kernels to simulate (as ``sdpa_kernel`` takes
            them); ``None``: the CPU's choice. On CUDA, fp32 grouped-query attention
            runs the math kernel: plan it with ``(SDPBackend.MATH,)``.

    Returns:
        A ``Plan`` (see ``report.py`` for its time model).

    Raises:
        ValueError: bad settings (no batch, a ``replicate`` that does not divide
            ``world_size``, an unknown optimizer or backend).
        TypeError: ``model`` is not a module or factory; ``shard_fn`` left the root
            without ``fully_shard``.
        NotImplementedError: ``backend="gloo"`` with a ``fully_shard`` call whose
            params are on several meshes.
        RuntimeError: a default process group is already initialized.
    """
    return simulate(
        PlanSettings(
            model,
            world_size,
            batch,
            loss_fn=loss_fn,
            replicate=replicate,
            shard_fn=shard_fn,
            mp_policy=mp_policy,
            offload_policy=offload_policy,
            optimizer=optimizer,
            link_gbps=link_gbps,
            tflops=tflops,
            backend=backend,
            sdpa_backends=sdpa_backends,
        )
    )


class _Keep(enum.Enum):
    """``replan``'s default: the setting ``previous`` was simulated with."""

    KEEP = "keep"


_KEEP = _Keep.KEEP


def replan(
    previous: Plan,
    *,
    model: nn.Module | Callable[[], nn.Module] | _Keep = _KEEP,
    world_size: int | _Keep = _KEEP,
    batch: Any = _KEEP,
    loss_fn: LossFn | _Keep = _KEEP,
    replicate: int | _Keep = _KEEP,
    shard_fn: ShardFn | _Keep = _KEEP,
    mp_policy: MixedPrecisionPolicy | _Keep = _KEEP,
    offload_policy: OffloadPolicy | _Keep = _KEEP,
    optimizer: str | OptimizerFactory | _Keep = _KEEP,
    link_gbps: float | _Keep = _KEEP,
    tflops: float | _Keep = _KEEP,
    backend: str | _Keep = _KEEP,
    sdpa_backends: tuple[SDPBackend, ...] | None | _Keep = _KEEP,
) -> Plan:
    """``previous``'s simulation again with the settings passed changed (``plan()``'s
    arguments; the others are kept), e.g. ``replan(p, mp_policy=MixedPrecisionPolicy(
    param_dtype=torch.bfloat16))``.

    Raises:
        ValueError: ``previous`` has no settings (a ``compose``d plan); and ``plan()``'s
            errors.
    """
    if previous.settings is None:
        raise ValueError(
            "replan() needs the settings a plan was simulated with, and a composed plan "
            "has none: replan the plans it was composed from, then compose them again"
        )
    changes = {
        "model": model,
        "world_size": world_size,
        "batch": batch,
        "loss_fn": loss_fn,
        "replicate": replicate,
        "shard_fn": shard_fn,
        "mp_policy": mp_policy,
        "offload_policy": offload_policy,
        "optimizer": optimizer,
        "link_gbps": link_gbps,
        "tflops": tflops,
        "backend": backend,
        "sdpa_backends": sdpa_backends,
    }
    kept = {name: value for name, value in changes.items() if value is not _KEEP}
    return simulate(dataclasses.replace(previous.settings, **kept))


def simulate(settings: PlanSettings) -> Plan:
    if dist.is_initialized():
        raise RuntimeError(
            "plan() needs its own fake process group, but a default process group is "
            "already initialized (this is a real job): call plan() before "
            "init_process_group(), or run `python -m dtensor_fsdp.plan` in a separate process"
        )
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=settings.world_size)
    try:
        with warnings.catch_warnings():
            # Our sharding compares data pointers, which fake tensors warn about.
            warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")
            return _simulate_on_fake_group(settings, start)
    finally:
        dist.destroy_process_group()


def _mesh(settings: PlanSettings) -> DeviceMesh:
    if settings.replicate == 1:
        return init_device_mesh("cpu", (settings.world_size,))
    return init_device_mesh(
        "cpu", (settings.replicate, settings.shard_size), mesh_dim_names=("replicate", "shard")
    )


@dataclasses.dataclass
class _StepRecords:
    """What the recorders saw of the last simulated step."""

    tracker: PeakTracker
    collectives: C10dCounter
    trace: CommTrace
    forward_flops: dict[str, int]  # FlopCounterMode's module name -> FLOPs, inclusive
    backward_flops: dict[str, int]
    sharded: dict[str, int]  # after the optimizer step, see _sharded_bytes


def _simulate_on_fake_group(settings: PlanSettings, start: float) -> Plan:
    model = settings.build_meta_model()
    model_name = type(model).__name__  # before fully_shard renames the class
    model_params = sum(p.numel() for p in model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    mesh = _mesh(settings)  # outside FakeTensorMode: the mesh holds real rank tensors
    with FakeTensorMode(allow_non_fake_inputs=True):
        settings.shard_fn(
            model, mesh=mesh, mp_policy=settings.mp_policy, offload_policy=settings.offload_policy
        )
        if not isinstance(model, FSDPModule):
            raise TypeError(
                f"shard_fn left the root {type(model).__name__} without fully_shard: "
                "call fully_shard(model, ...) last, as the default shard_fn does"
            )
        step = _run_steps(model, settings)
    groups = [_group_plan(info, model, step, settings) for info in model.describe_groups()]
    breakdown = step.tracker.peak_breakdown()
    return Plan(
        model=model_name,
        world_size=settings.world_size,
        replicate=settings.replicate,
        optimizer=settings.optimizer_name,
        param_dtype=str(settings.mp_policy.param_dtype or "unchanged").removeprefix("torch."),
        reduce_dtype=str(settings.mp_policy.reduce_dtype or "unchanged").removeprefix("torch."),
        offload=isinstance(settings.offload_policy, CPUOffloadPolicy),
        backend=settings.backend,
        link_gbps=settings.link_gbps,
        tflops=settings.tflops,
        model_params=model_params,
        model_bytes=model_bytes,
        sharded_param_bytes=step.sharded["params"],
        sharded_grad_bytes=step.sharded["grads"],
        optimizer_state_bytes=step.sharded["optimizer"],
        peak_bytes=sum(breakdown.values()),
        peak_breakdown=breakdown,
        peak_module=step.tracker.peak_module,
        peak_phase=step.tracker.peak_phase,
        groups=groups,
        collectives=step.collectives.totals(),
        forward_flops=step.forward_flops.get("Global", 0),
        backward_flops=step.backward_flops.get("Global", 0),
        timeline=list(step.tracker.timeline),
        planning_s=time.perf_counter() - start,
        settings=settings,
    )


def _run_steps(model: FSDPModule, settings: PlanSettings) -> _StepRecords:
    """Materialize the sharded model on fake tensors and train ``_STEPS`` steps; the
    memory and collective records are the last step's. The batch is made inside, so it
    is counted (as MemTracker's activations), as a real job holds it too.

    FLOPs are counted in the first step only: ``FlopCounterMode``'s module hooks keep
    tensors alive in backward (measured: on real tensors the tiny Llama's step-2 peak
    is 4.4% higher under it), and every step does the same arithmetic."""
    trace = CommTrace()
    model.set_comm_trace(trace)
    counter = C10dCounter()
    tracker = PeakTracker(type(model).__name__)
    if settings.backend == "gloo":
        _reduce_scatter_as_on_gloo(model)
    kernels = (
        sdpa_kernel(list(settings.sdpa_backends))
        if settings.sdpa_backends is not None
        else contextlib.nullcontext()
    )
    with tracker, kernels:
        model.to_empty(device="cpu")
        optimizer = settings.make_optimizer(model.parameters())
        batch = settings.batch() if callable(settings.batch) else settings.batch
        flops = FlopCounterMode(display=False)
        forward: dict[str, int] = {}
        for step in range(_STEPS):
            tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
            tracker.restart_peak()
            trace.clear()
            counter.records.clear()
            with counter, flops if step == 0 else contextlib.nullcontext():
                loss = settings.loss_fn(model, batch)
                if step == 0:
                    forward = {k: sum(v.values()) for k, v in flops.flop_counts.items()}
                loss.backward()
                del loss
                optimizer.step()
            sharded = _sharded_bytes(tracker)
            optimizer.zero_grad()
    total = {k: sum(v.values()) for k, v in flops.get_flop_counts().items()}
    backward = {k: total[k] - forward.get(k, 0) for k in total}
    return _StepRecords(tracker, counter, trace, forward, backward, sharded)


def _reduce_scatter_as_on_gloo(model: FSDPModule) -> None:
    """Every ``fully_shard`` call reduce-scatters by an all-to-all, as ours does on gloo."""
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module.describe_groups(recurse=False)
        if len(groups) > 1:
            # One custom collective serves one process group (torch's check).
            raise NotImplementedError(
                f"plan(backend='gloo') cannot simulate gloo's reduce-scatter for the "
                f"fully_shard call on {type(module).__name__}: its params are on several "
                "meshes (shard_placement_fn); plan it with backend='nccl'"
            )
        module.set_custom_reduce_scatter(AllToAllReduceScatter())


def _sharded_bytes(tracker: PeakTracker) -> dict[str, int]:
    """Parameter shards, gradient shards and optimizer states live after the optimizer
    step, by MemTracker's categories (nothing is unsharded then)."""
    return {
        "params": tracker.live_bytes("Parameter"),
        "grads": tracker.live_bytes("Gradient"),
        "optimizer": tracker.live_bytes("Optstate"),
    }


def _owned_flops(group: FSDPGroupInfo, model: nn.Module, flops: dict[str, int]) -> int:
    """FLOPs of ``group``'s modules without those of other groups nested in them.
    ``flops`` is inclusive, keyed like FlopCounterMode ("Llama.layers.0")."""
    names = {module: name for name, module in model.named_modules()}
    root = type(model).__name__

    def counted(module: nn.Module) -> int:
        name = names[module]
        return flops.get(f"{root}.{name}" if name else root, 0)

    owned = 0
    for module in group.modules:
        owned += counted(module)
        for sub in module.modules():
            if sub is not module and isinstance(sub, FSDPModule) and _is_outermost(sub, module):
                owned -= counted(sub)
    return owned


def _is_outermost(sub: nn.Module, top: nn.Module) -> bool:
    """Whether no FSDP module lies strictly between ``top`` and ``sub``."""
    for child in top.children():
        if child is sub:
            return True
        if any(m is sub for m in child.modules()):
            return not isinstance(child, FSDPModule) and _is_outermost(sub, child)
    return False


def _group_plan(
    group: FSDPGroupInfo, model: nn.Module, step: _StepRecords, settings: PlanSettings
) -> GroupPlan:
    collectives: dict[str, dict[str, int]] = {}
    comm_s: dict[str, float] = {}
    for event in step.trace.events:
        if event.fqn != group.fqn:
            continue
        entry = collectives.setdefault(event.kind, {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += event.nbytes
        seconds = event.wire_bytes * 8 / (settings.link_gbps * 1e9)
        comm_s[event.phase] = comm_s.get(event.phase, 0.0) + seconds
    return GroupPlan(
        fqn=group.fqn,
        params=group.numel,
        unsharded_bytes=group.unsharded_nbytes,
        reshard_after_forward=bool(group.reshard_after_forward),
        collectives=collectives,
        comm_s=comm_s,
        forward_flops=_owned_flops(group, model, step.forward_flops),
        backward_flops=_owned_flops(group, model, step.backward_flops),
    )
