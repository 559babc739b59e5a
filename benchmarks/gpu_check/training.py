"""The training runs the GPU check's rows are made of, on one rank of a row.

A *setting* is one way to train the repo's Llama (``dtensor_fsdp/models/llama.py``): ours
(``dtensor_fsdp.fully_shard``), torch's (``torch.distributed.fsdp.fully_shard``) or the
plain model, with torchtitan's grouping (each block, then the root; the last block
kept unsharded from forward into backward) and the row's options. ``run_alone`` trains
one setting with nothing else built (values and peak memory); ``time_side_by_side``
builds several and times their steps interleaved, then profiles one step of some.

Every setting starts from the same seed and sees the same tokens at step n. FSDP runs
train on this rank's rows of the global batch; the plain model's correctness run trains
on the whole global batch (the single-process reference), its timing run on this rank's
rows (the step's compute floor).
"""

import dataclasses
import gc
import itertools
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from common.device import sync
from common.tensor_memory import reset_peak, total_bytes
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile, schedule

import dtensor_fsdp
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss, swiglu_hidden_dim

SEED = 0
LR = 1e-3
WEIGHT_DECAY = 0.1


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Llama and its batch; ``batch_size`` sequences per data-parallel rank."""

    dim: int
    n_layers: int
    vocab_size: int
    seq_len: int
    batch_size: int
    n_heads: int = 8
    n_kv_heads: int = 4

    def config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            ffn_hidden_dim=swiglu_hidden_dim(self.dim), max_seq_len=self.seq_len,
        )  # fmt: skip


# "large": the W=1 NCCL rows, whose step times mean something (86M parameters, 8 x 512
# tokens); "small": the rest (16M, 4 x 256 tokens per rank: gloo on CUDA is host-copy
# bound). CPU tensors: one tiny model, for the logic.
SHAPES = {
    "cuda": {
        "large": Shape(1024, 6, 8192, 512, 8, n_heads=16, n_kv_heads=8),
        "small": Shape(512, 4, 4096, 256, 4),
    },
    "cpu": {
        "large": Shape(64, 2, 256, 32, 2, n_heads=4, n_kv_heads=2),
        "small": Shape(64, 2, 256, 32, 2, n_heads=4, n_kv_heads=2),
    },
}


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way to train the model."""

    impl: str  # "ours", "torch" or "plain"
    bf16: bool = False  # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    offload: bool = False  # CPUOffloadPolicy(pin_memory=True on CUDA)
    reshard_after_forward: bool | int = True  # every block but the last (kept: False)
    prefetch: bool = False  # explicit forward and backward prefetch of the next block
    compile: bool = False  # each block .compile(backend="inductor", fullgraph=True) first
    comm_precision: dict[str, Any] | None = None  # ours: CommPrecisionPolicy fields


@dataclasses.dataclass(frozen=True)
class Rank:
    """This rank of a row: its device, the FSDP mesh, and its rows of the global batch."""

    device: torch.device
    mesh: DeviceMesh
    artifacts: str

    @property
    def dp_rank(self) -> int:
        return dist.get_rank()  # the mesh is row-major: replicate-major for HSDP

    @property
    def dp_size(self) -> int:
        return dist.get_world_size()


def make_rank(device: torch.device, artifacts: str, replicate: int = 1) -> Rank:
    world = dist.get_world_size()
    if replicate == 1:
        mesh = init_device_mesh(device.type, (world,))
    else:
        shape = (replicate, world // replicate)
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=("replicate", "shard"))
    return Rank(device, mesh, artifacts)


def build(setting: Setting, shape: Shape, rank: Rank) -> nn.Module:
    """The model of ``setting``, from ``SEED``; FSDP: each block, then the root."""
    torch.manual_seed(SEED)
    with rank.device:
        model = Llama(shape.config())
    if setting.compile:
        for block in model.layers:
            block.compile(backend="inductor", fullgraph=True)  # as train.py --compile
    if setting.impl == "plain":  # bf16: the compute floor of a bf16 step (timing only)
        return model.to(torch.bfloat16) if setting.bf16 else model
    shard, kwargs = _fsdp(setting, rank.device)
    last = len(model.layers) - 1
    for index, block in enumerate(model.layers):
        keep = index == last  # backward needs it first: resharding it would only regather
        raf = False if keep else setting.reshard_after_forward
        shard(block, mesh=rank.mesh, reshard_after_forward=raf, **kwargs)
    shard(model, mesh=rank.mesh, **kwargs)
    if setting.prefetch:
        for module, following in itertools.pairwise([model, *model.layers]):
            module.set_modules_to_forward_prefetch([following])
        for module, preceding in itertools.pairwise(list(model.layers)[::-1]):
            module.set_modules_to_backward_prefetch([preceding])
    if setting.comm_precision is not None:
        assert setting.impl == "ours", "torch's fully_shard has no quantized communication"
        model.set_comm_precision(dtensor_fsdp.CommPrecisionPolicy(**setting.comm_precision))
    return model


def _fsdp(setting: Setting, device: torch.device) -> tuple[Any, dict[str, Any]]:
    """The setting's ``fully_shard`` and its policies, each FSDP with its own classes.
    Offloaded shards are pinned on CUDA (torch's pin_memory needs an accelerator)."""
    ours = setting.impl == "ours"
    mp_cls = dtensor_fsdp.MixedPrecisionPolicy if ours else TorchMixedPrecisionPolicy
    kwargs: dict[str, Any] = {}
    if setting.bf16:
        kwargs["mp_policy"] = mp_cls(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if setting.offload:
        offload_cls = dtensor_fsdp.CPUOffloadPolicy if ours else TorchCPUOffloadPolicy
        kwargs["offload_policy"] = offload_cls(pin_memory=device.type == "cuda")
    return (dtensor_fsdp.fully_shard if ours else torch_fully_shard), kwargs


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)


def tokens_for(step: int, shape: Shape, rank: Rank, whole: bool = False) -> torch.Tensor:
    """Step ``step``'s (rows, seq_len + 1) tokens: this rank's rows, or ``whole`` batch."""
    generator = torch.Generator().manual_seed(1000 + step)
    rows = shape.batch_size * rank.dp_size
    tokens = torch.randint(shape.vocab_size, (rows, shape.seq_len + 1), generator=generator)
    return (tokens if whole else tokens.chunk(rank.dp_size)[rank.dp_rank]).to(rank.device)


@contextmanager
def attention(deterministic: bool) -> Iterator[None]:
    """SDPA's math kernel where values are compared: flash and memory-efficient
    backward accumulate with atomics on CUDA, so two identical bf16 runs differ in the
    last bits (seen on an H200); the default kernels where time is measured."""
    with sdpa_kernel(SDPBackend.MATH) if deterministic else nullcontext():
        yield


def forward_backward(model: nn.Module, tokens: torch.Tensor, deterministic: bool) -> torch.Tensor:
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # each (B, T)
    with attention(deterministic):
        loss = cross_entropy_loss(model(inputs), targets)
        loss.backward()
    return loss.detach()


class PeakMeter:
    """Peak memory of one step, counted from before the model was built: CUDA's caching
    allocator (``max_memory_allocated``), or on CPU ``MemTracker`` as in bench_train.py."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tracker = MemTracker() if device.type == "cpu" else None
        self.base = 0

    def __enter__(self) -> "PeakMeter":
        if self.tracker is not None:
            self.tracker.__enter__()
        else:
            sync(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.tracker is not None:
            self.tracker.__exit__(*exc)

    def step_begins(self, measured: bool) -> None:
        if self.tracker is not None:
            self.tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
            if measured:
                reset_peak(self.tracker)
        elif measured:
            sync(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        if self.tracker is not None:
            return total_bytes(self.tracker.get_tracker_snapshot("peak"))
        sync(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def device_memory(device: torch.device) -> tuple[int, int, int] | None:
    """(allocated, reserved, segments ever allocated) on CUDA, after a sync; else None."""
    if device.type != "cuda":
        return None
    sync(device)
    stats = torch.cuda.memory_stats(device)
    return (
        stats["allocated_bytes.all.current"],
        stats["reserved_bytes.all.current"],
        stats["segment.all.allocated"],  # cudaMalloc calls so far: a new one is growth
    )


# How a local shard is cut from the full tensor: (dim, chunks, index) per sharded mesh axis.
Chunking = tuple[tuple[int, int, int], ...]


@dataclasses.dataclass
class Record:
    """What one setting did when trained alone; tensors are CPU copies, by FQN."""

    losses: list[float] = dataclasses.field(default_factory=list)
    first_grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """After step 1's backward (FSDP: local shards)."""
    last_grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """After the last step's backward."""
    params: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    """After the last step."""
    chunking: dict[str, Chunking] = dataclasses.field(default_factory=dict)
    """FSDP: how each param's local shard is cut from the full one."""
    peak_bytes: int | None = None
    """Over step 2, counted from before the build."""
    offload_problems: list[str] = dataclasses.field(default_factory=list)
    """CPU offload: what is not where CPUOffloadPolicy puts it."""
    grads_pinned: bool | None = None
    """CPU offload on CUDA: whether the last sharded grads are in pinned memory."""
    graph_breaks: int | None = None
    """Compile: dynamo's graph breaks."""


def chunking_of(param: torch.Tensor) -> Chunking:
    if not isinstance(param, DTensor):
        return ()
    mesh, coordinate = param.device_mesh, param.device_mesh.get_coordinate()
    assert coordinate is not None, "this rank holds a shard of every sharded param"
    return tuple(
        (placement.dim, mesh.size(axis), coordinate[axis])
        for axis, placement in enumerate(param.placements)
        if placement.is_shard()
    )


def local_part(full: torch.Tensor, chunking: Chunking) -> torch.Tensor:
    """This rank's shard of ``full`` (``torch.chunk`` along each sharded dim, as
    ``Shard`` splits; a rank past the last chunk holds an empty one)."""
    for dim, chunks, index in chunking:
        parts = full.chunk(chunks, dim=dim)
        full = parts[index] if index < len(parts) else full.narrow(dim, 0, 0)
    return full


def local_copies(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """CPU copies of each tensor (a DTensor's local shard), by name."""
    out = {}
    for name, tensor in tensors.items():
        if tensor is not None:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            out[name] = local.detach().to("cpu", copy=True)
    return out


def run_alone(setting: Setting, shape: Shape, rank: Rank, steps: int, measure_peak: bool) -> Record:
    """Train ``setting`` for ``steps`` steps with nothing else built; the peak is step 2's."""
    if setting.compile:
        torch._dynamo.reset()  # each setting compiles its blocks afresh and counts its breaks
        torch._dynamo.utils.counters.clear()
    meter = PeakMeter(rank.device) if measure_peak else None
    record = Record()
    with meter or nullcontext():
        model = build(setting, shape, rank)
        optimizer = optimizer_for(model)
        record.chunking = {name: chunking_of(p) for name, p in model.named_parameters()}
        if setting.offload:
            record.offload_problems += offload_problems(model, optimizer, rank, "after fully_shard")
        whole = setting.impl == "plain"
        for step in range(steps):
            tokens = tokens_for(step, shape, rank, whole)
            if meter is not None:
                meter.step_begins(measured=step == 1)
            record.losses.append(forward_backward(model, tokens, deterministic=True).item())
            grads = {name: p.grad for name, p in model.named_parameters()}
            if step == 0:
                record.first_grads = local_copies(grads)
            if step == steps - 1:
                record.last_grads = local_copies(grads)
                if setting.offload and rank.device.type == "cuda":
                    record.grads_pinned = all(_local(g).is_pinned() for g in grads.values())
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if meter is not None and step == 1:
                record.peak_bytes = meter.peak()
        if setting.offload:
            record.offload_problems += offload_problems(
                model, optimizer, rank, f"after {steps} steps"
            )
        record.params = local_copies(dict(model.named_parameters()))
    if setting.compile:
        record.graph_breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    del model, optimizer
    free_memory(rank.device)
    return record


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def offload_problems(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank: Rank, when: str
) -> list[str]:
    """Sharded params, their grads and the optimizer states that are not on the CPU
    (CPUOffloadPolicy keeps them there), or, on CUDA, params not pinned (pin_memory=True
    pins them; on a CPU device there is nothing to pin for)."""
    problems = []
    for name, param in model.named_parameters():
        tensors = {"param": param, "grad": param.grad, **optimizer.state.get(param, {})}
        for what, tensor in tensors.items():
            # Adam's step counts are 0-dim: torch keeps them on the CPU anyway.
            if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
                device = _local(tensor).device
                if device.type != "cpu":
                    problems.append(f"{when}: {name} {what} on {device}")
        if rank.device.type == "cuda" and not _local(param).is_pinned():
            problems.append(f"{when}: {name} param not pinned")
    return problems


def free_memory(device: torch.device) -> None:
    gc.collect()  # FSDP's module <-> state cycles: free this setting before the next
    if device.type == "cuda":
        torch.cuda.empty_cache()


def warm_up(shape: Shape, rank: Rank, bf16: bool = False) -> None:
    """On CUDA, a training step of the plain model with the math and with the default
    attention kernels, before anything is measured: cuBLAS keeps a workspace per stream
    (32 MiB) in the caching allocator from a process's first matmul on it, and whatever
    else a kernel sets up once would also be paid by the first setting measured, in its
    peak."""
    if rank.device.type != "cuda":
        return
    model = build(Setting("plain", bf16=bf16), shape, rank)
    optimizer = optimizer_for(model)
    for deterministic in (True, False):
        forward_backward(model, tokens_for(0, shape, rank), deterministic)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    del model, optimizer
    free_memory(rank.device)


@dataclasses.dataclass
class _Trainee:
    setting: Setting
    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps_taken: int = 0

    def step(self, shape: Shape, rank: Rank) -> None:
        tokens = tokens_for(self.steps_taken, shape, rank)  # plain: this rank's rows too
        forward_backward(self.model, tokens, deterministic=False)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1


def time_side_by_side(
    settings: dict[str, Setting], shape: Shape, rank: Rank, rounds: int, warmup: int,
    profiled: tuple[str, ...] = (), row: str = "",
) -> tuple[dict[str, float], list[str]]:  # fmt: skip
    """Median step time (the slowest rank's) of each setting, by label, from interleaved
    rounds in a rotating order; then one profiled step of each label in ``profiled``
    (rank 0 writes the trace). Returns the medians and the trace files written."""
    trainees = {}
    for label, setting in settings.items():
        model = build(setting, shape, rank)
        trainees[label] = _Trainee(setting, model, optimizer_for(model))
    labels = list(trainees)
    times: dict[str, list[float]] = {label: [] for label in labels}
    for index in range(warmup + rounds):
        shift = index % len(labels)
        for label in labels[shift:] + labels[:shift]:
            dist.barrier()
            sync(rank.device)
            start = time.perf_counter()
            trainees[label].step(shape, rank)
            sync(rank.device)
            if index >= warmup:
                times[label].append(time.perf_counter() - start)
    medians = {}
    for label, values in times.items():
        slowest = torch.tensor(values, dtype=torch.float64, device=rank.device)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
        medians[label] = statistics.median(slowest.tolist())
    files = [_profile(trainees[label], shape, rank, f"{row}_{label}") for label in profiled]
    del trainees
    free_memory(rank.device)
    return medians, [f for f in files if f]


def _profile(trainee: _Trainee, shape: Shape, rank: Rank, name: str) -> str | None:
    """One step under torch.profiler after one warm-up step (CUPTI's start-up), on rank
    0 (the others run the same steps); the Chrome trace's path, or None."""
    activities = [ProfilerActivity.CPU]
    if rank.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    steps = schedule(wait=0, warmup=1, active=1, repeat=1)
    recording = dist.get_rank() == 0
    with profile(activities=activities, schedule=steps) if recording else nullcontext() as prof:
        for _ in range(2):
            dist.barrier()
            trainee.step(shape, rank)
            sync(rank.device)  # the step's kernels end inside its ProfilerStep range
            if prof is not None:
                prof.step()
    if not recording:
        return None
    path = os.path.join(rank.artifacts, f"{name}_rank0.json")
    prof.export_chrome_trace(path)
    return path
