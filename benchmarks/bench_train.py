"""Time and measure dtensor_fsdp against torch's fully_shard and DDP in one launch.

    torchrun --nproc-per-node 2 benchmarks/bench_train.py                   # CPU + gloo
    torchrun --nproc-per-node 2 benchmarks/bench_train.py --model tiny --steps 10
    torchrun --nproc-per-node 8 benchmarks/bench_train.py --device cuda     # NCCL
    torchrun --nproc-per-node 1 benchmarks/bench_train.py --device cuda \
        --impls ours,torch,unsharded --profile prof/                      # issue 13

The same Llama-style model (fp32, AdamW, same seed, same synthetic batches) is trained
under four implementations:

- ``ours``:  ``dtensor_fsdp.fully_shard`` on each block, then on the root;
- ``torch``: ``torch.distributed.fsdp.fully_shard``, the same grouping;
- ``ddp``:   ``torch.nn.parallel.DistributedDataParallel``;
- ``unsharded``: the plain model, no wrapper and no communication: the compute floor.
  At W > 1 each rank trains its own copy on its own batch (no gradient averaging).

Both FSDPs run torchtitan's settings: ``reshard_after_forward=True`` for every block but
the last, ``False`` for the last (backward needs it first, so resharding it would only
gather it straight back) and the root's default (``None``: kept). No gradient clipping,
so the only collectives in a step are data-parallel ones.

Method, in four phases (the third optional):

1. **Isolation** (memory and collectives), one implementation at a time, with the
   others never built: build the model and optimizer, run step 1 (lazy init, optimizer state
   allocation), measure memory over step 2, then record the collectives of step 3; then
   delete everything before the next implementation.

   *Peak memory* is the peak of live tensor memory during step 2, counted from before
   the model was built, so it includes parameters, gradients, optimizer states, DDP's
   gradient buckets, all-gather buffers and activations. On CUDA it is
   ``torch.cuda.max_memory_allocated`` minus ``memory_allocated`` before the build,
   with cuBLAS warmed up first (``warm_up_cublas``: its workspaces would count against
   whichever impl ran its first matmul). On
   CPU it is ``torch.distributed._tools.mem_tracker.MemTracker`` (a ``TorchDispatchMode``
   that follows every storage created under it through a weakref, and storage resizes),
   entered before the model is built, with its peak restarted at the start of step 2.
   Tensors that C++ code allocates while the mode is active (DDP's buckets) go through
   the dispatcher and are counted; scratch buffers that gloo allocates on its own
   threads are not (nor are they on CUDA's side: NCCL's buffers are outside the
   caching allocator). That leans against ours on gloo: ours reduce-scatters by an
   all-to-all whose receive buffer (as large as the input) is a Python tensor and is
   counted, while what gloo allocates inside torch's ``reduce_scatter_tensor`` (an
   all-reduce of a copy of the input) is not. So the peak is also reported without the
   all-to-all receive buffers (``peak-a2a``: the largest of live bytes after each op
   less the receive buffers alive then; the same as the peak for every other impl).
   RSS is not used: it does not shrink when tensors are freed and it counts the
   interpreter. The profiler's CPU memory events were tried and rejected:
   frees made on gloo's threads are not reported, so their running sum drifts upward.

   *Collectives* of the FSDP variants are recorded at the c10d op level by a
   ``TorchDispatchMode`` (``tests/_c10d.py``'s ``C10dRecorder``, the tests' ruler; the
   same ops ``CommDebugMode`` counts) with
   the unsharded buffer size of each: all-gather output, reduce-scatter or all-to-all
   input. Ours is also read from its ``CommTrace`` and the two are checked to agree.
   DDP's all-reduces are issued by its C++ reducer, outside the dispatcher, so they are
   counted from its bucket layout (``_get_ddp_logging_data()["bucket_sizes"]``): one
   all-reduce per bucket, of all gradients in total.

2. **Timing**: all the models are built, then ``--warmup`` + ``--steps`` rounds run;
   each round runs ``--block`` steps of every implementation, in an order that rotates
   every round (ours/torch/ddp, torch/ddp/ours, ...) so drift and cache effects spread
   evenly. A barrier precedes every timed step; a step's time is the slowest rank's
   (forward, backward, optimizer step, zero_grad; on CUDA up to a device sync).
   Every implementation sees the same batch at its n-th step, so their losses must
   agree; the largest difference from torch's loss is printed as a sanity check.

3. **Profile** (``--profile DIR``, off by default): a few more steps of each
   implementation alone under ``torch.profiler`` (CPU, and CUDA on CUDA); every rank
   exports ``DIR/<impl>_rank<r>.json`` (Chrome trace; ``plot_timeline.py`` draws it) and,
   for ours, its ``CommTrace`` as ``DIR/ours_commtrace_rank<r>.json``.

4. **Report** on rank 0 (``_train_report.py``): a table, the analytic FSDP bytes bound,
   the ratios, and a final ``BENCH_JSON {...}`` line.

"Ring wire bytes" is what each rank sends with a ring algorithm: (W-1)/W of the buffer
for an all-gather, a reduce-scatter or an all-to-all, 2(W-1)/W for an all-reduce. On
gloo, torch's ``reduce_scatter_tensor`` is an all-reduce plus a copy, so torch's real
reduce-scatter traffic there is twice its ring figure (dtensor_fsdp uses an all-to-all
on gloo); the report shows both.

The analytic FSDP bound per step is
``(W-1)/W * sum over groups of param_bytes * (AGs + 1)``, where AGs is 2 for groups
resharded after forward (forward and backward all-gather) and 1 for the root.
"""

import argparse
import dataclasses
import gc
import importlib.util
import itertools
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _train_report import build_results, print_report  # same directory
from common.comms import ring_wire_bytes, summarize
from common.device import sync, warm_up_cublas
from common.dist import init_distributed, leave_process_group, reduce_over_ranks
from common.tensor_memory import ReceiveBuffers, restart_step, total_bytes
from common.workload import group_params, rank_tokens
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, schedule

from tests._c10d import C10dRecorder

try:
    import dtensor_fsdp
    from dtensor_fsdp.models import llama
except ImportError as _error:  # only while the core does not import: bench torch and DDP
    dtensor_fsdp = None
    _OURS_IMPORT_ERROR = repr(_error)
    # The model file is plain PyTorch; load it without the package's __init__.
    _path = os.path.join(os.path.dirname(__file__), "..", "dtensor_fsdp", "models", "llama.py")
    _spec = importlib.util.spec_from_file_location("bench_llama", _path)
    llama = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(llama)

PRESETS, Llama, LlamaConfig = llama.PRESETS, llama.Llama, llama.LlamaConfig
cross_entropy_loss = llama.cross_entropy_loss

IMPLS = ("ours", "torch", "ddp", "unsharded")


# Setup #


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="small")
    parser.add_argument("--n-layers", type=int, help="override the preset")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--block", type=int, default=1, help="steps per impl per round")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated subset")
    parser.add_argument(
        "--forward-prefetch",
        action="store_true",
        help="both FSDPs: each module explicitly prefetches the next block's all-gather in "
        "forward (set_modules_to_forward_prefetch, as torchtitan does)",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--chrome-trace",
        metavar="PATH",
        help="rank 0 writes ours' CommTrace of the counted step here",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="after timing, profile --profile-steps more steps of each impl with "
        "torch.profiler; every rank writes DIR/<impl>_rank<r>.json (Chrome trace) and "
        "DIR/ours_commtrace_rank<r>.json",
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="steps profiled per impl")
    args = parser.parse_args()
    impls = [name for name in args.impls.split(",") if name]
    if not impls or any(name not in IMPLS for name in impls):
        parser.error(f"--impls must be a comma-separated subset of {','.join(IMPLS)}")
    for flag in ("steps", "block", "batch_size", "seq_len", "profile_steps"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    args.impls = impls
    return args


def build_config(args: argparse.Namespace) -> LlamaConfig:
    config = PRESETS[args.model]()
    overrides: dict[str, Any] = {"max_seq_len": args.seq_len}
    if args.n_layers is not None:
        overrides["n_layers"] = args.n_layers
    return dataclasses.replace(config, **overrides)


@dataclasses.dataclass
class Impl:
    """One implementation's model and optimizer, and how many steps it has taken."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    steps_taken: int = 0


def build_impl(
    name: str, config: LlamaConfig, mesh: DeviceMesh, device: torch.device, args: argparse.Namespace
) -> Impl:
    """Same seed for every implementation, so all start from identical weights."""
    torch.manual_seed(args.seed)
    with device:
        model = Llama(config)
    if name == "unsharded":
        pass  # the plain model: each rank trains its own copy, nothing is communicated
    elif name == "ddp":
        device_ids = [device.index] if device.type == "cuda" else None
        model = DistributedDataParallel(model, device_ids=device_ids)
    else:
        shard = dtensor_fsdp.fully_shard if name == "ours" else torch_fully_shard
        for index, block in enumerate(model.layers):
            shard(block, mesh=mesh, reshard_after_forward=index < len(model.layers) - 1)
        shard(model, mesh=mesh)
        if args.forward_prefetch:
            # The root's forward starts with the embedding, then block 0; block i's
            # forward is followed by block i + 1's.
            modules = [model, *model.layers]
            for module, following in itertools.pairwise(modules):
                module.set_modules_to_forward_prefetch([following])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    return Impl(name, model, optimizer)


def batch_for_step(
    step: int, config: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> torch.Tensor:
    """This rank's (batch_size, seq_len + 1) tokens of global step ``step``: the same for
    every implementation, different on every rank."""
    seed = args.seed * 1_000_003 + step
    return rank_tokens(seed, config.vocab_size, args.batch_size, args.seq_len).to(device)


def train_step(
    impl: Impl, config: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> torch.Tensor:
    tokens = batch_for_step(impl.steps_taken, config, args, device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # each (B, T)
    loss = cross_entropy_loss(impl.model(inputs), targets)
    loss.backward()
    impl.optimizer.step()
    impl.optimizer.zero_grad(set_to_none=True)
    impl.steps_taken += 1
    return loss.detach()


# Measurement #


@dataclasses.dataclass
class Isolated:
    """What one implementation measured alone: memory and one step's collectives."""

    live_at_step_bytes: int
    peak_bytes: int
    peak_without_all_to_all_bytes: int
    comms: dict[str, dict[str, float]]
    """kind -> {"count", "nbytes", "wire_bytes"} per step"""
    ddp_bucket_sizes: list[int] | None = None
    trace_summary: dict[str, Any] | None = None


def measure_memory(
    impl_factory: Callable[[], Impl],
    config: LlamaConfig,
    args: argparse.Namespace,
    device: torch.device,
) -> tuple[Impl, int, int, int]:
    """Build the impl, take a warmup step, and measure the next step's live bytes at
    its start, its peak, and its peak without all-to-all receive buffers."""
    if device.type == "cuda":
        warm_up_cublas(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        impl = impl_factory()
        train_step(impl, config, args, device)
        sync(device)
        at_step = torch.cuda.memory_allocated(device) - base
        torch.cuda.reset_peak_memory_stats(device)
        train_step(impl, config, args, device)
        sync(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        return impl, at_step, peak, peak  # NCCL: reduce_scatter_tensor, no all-to-all
    with MemTracker() as tracker:
        impl = impl_factory()
        train_step(impl, config, args, device)
        at_step = total_bytes(tracker.get_tracker_snapshot("current"))
        restart_step(tracker)
        with ReceiveBuffers(tracker) as buffers:
            train_step(impl, config, args, device)
        peak = total_bytes(tracker.get_tracker_snapshot("peak"))
    return impl, at_step, peak, buffers.peak_without_buffers()


def count_comms(
    impl: Impl, config: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> Isolated:
    """One step under the c10d recorder (and ours' CommTrace); DDP from its buckets.
    The unsharded model goes through the recorder too: it must record nothing."""
    world = dist.get_world_size()
    if impl.name == "ddp":
        train_step(impl, config, args, device)
        logging = impl.model._get_ddp_logging_data()
        sizes = [int(s) for s in str(logging.get("bucket_sizes", "")).split(",") if s]
        comms = {
            "all_reduce": {
                "count": len(sizes),
                "nbytes": sum(sizes),
                "wire_bytes": ring_wire_bytes("all_reduce", sum(sizes), world),
            }
        }
        return Isolated(0, 0, 0, comms, ddp_bucket_sizes=sizes)
    trace = dtensor_fsdp.CommTrace() if impl.name == "ours" else None
    if trace is not None:
        impl.model.set_comm_trace(trace)
    with C10dRecorder() as recorder:
        train_step(impl, config, args, device)
    sync(device)
    comms = summarize(recorder.records, world)
    if impl.name == "unsharded" and comms:
        raise AssertionError(f"the unsharded model communicated: {comms}")
    isolated = Isolated(0, 0, 0, comms)
    if trace is not None:
        impl.model.set_comm_trace(None)
        check_trace_matches(trace, recorder.records)
        isolated.trace_summary = trace.summary()
        if args.chrome_trace and dist.get_rank() == 0:
            trace.export_chrome_trace(args.chrome_trace)
    return isolated


def check_trace_matches(trace: Any, records: list[tuple[str, int]]) -> None:
    """Ours' CommTrace must list exactly the collectives the dispatcher saw."""
    kind_of = {"all_to_all": "reduce_scatter"}  # ours reduce-scatters by all-to-all on gloo
    seen = sorted((kind_of.get(kind, kind), nbytes) for kind, nbytes in records)
    traced = sorted((event.kind, event.nbytes) for event in trace.events)
    if seen != traced:
        raise AssertionError(f"CommTrace {traced} != c10d ops {seen}")


def run_isolated(
    name: str, mesh: DeviceMesh, config: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> Isolated:
    impl, at_step, peak, peak_without = measure_memory(
        lambda: build_impl(name, config, mesh, device, args), config, args, device
    )
    isolated = count_comms(impl, config, args, device)
    isolated.live_at_step_bytes, isolated.peak_bytes = at_step, peak
    isolated.peak_without_all_to_all_bytes = peak_without
    del impl
    gc.collect()  # FSDP state <-> module cycles: free this impl before the next one
    return isolated


def time_rounds(
    impls: list[Impl], config: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Interleaved rounds; returns per impl the slowest-rank step times and rank 0 losses."""
    times: dict[str, list[float]] = {impl.name: [] for impl in impls}
    losses: dict[str, list[float]] = {impl.name: [] for impl in impls}
    for round_index in range(args.warmup + args.steps):
        shift = round_index % len(impls)
        for impl in impls[shift:] + impls[:shift]:
            for _ in range(args.block):
                dist.barrier()
                sync(device)
                start = time.perf_counter()
                loss = train_step(impl, config, args, device)
                sync(device)
                elapsed = time.perf_counter() - start
                losses[impl.name].append(loss.item())
                if round_index >= args.warmup:
                    times[impl.name].append(elapsed)
    for name, values in times.items():
        # A step lasts as long as its slowest rank.
        times[name] = reduce_over_ranks(values, dist.ReduceOp.MAX)
    return times, losses


# Profile #


def profile_impls(
    impls: list[Impl], config: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Each impl alone for 1 + ``--profile-steps`` steps under ``torch.profiler``: the
    first is the profiler's warm-up (CUPTI start-up), the others are recorded, each in a
    ``ProfilerStep#n`` range. Every rank exports its traces to ``args.profile``; returns
    ours' CommTrace summary per profiled step (exposed wait time of each collective)."""
    os.makedirs(args.profile, exist_ok=True)
    rank = dist.get_rank()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    summary: dict[str, Any] = {}
    for impl in impls:
        trace = dtensor_fsdp.CommTrace() if impl.name == "ours" else None
        if trace is not None:
            impl.model.set_comm_trace(trace)
        steps = schedule(wait=0, warmup=1, active=args.profile_steps, repeat=1)
        with profile(activities=activities, record_shapes=False, schedule=steps) as prof:
            for step in range(1 + args.profile_steps):
                if step == 1 and trace is not None:
                    trace.clear()  # keep the CommTrace to the recorded steps
                dist.barrier()
                train_step(impl, config, args, device)
                sync(device)  # the step's kernels end inside its ProfilerStep range
                prof.step()
        prof.export_chrome_trace(os.path.join(args.profile, f"{impl.name}_rank{rank}.json"))
        if trace is not None:
            impl.model.set_comm_trace(None)
            trace.export_chrome_trace(os.path.join(args.profile, f"ours_commtrace_rank{rank}.json"))
            summary = trace.summary(steps=args.profile_steps)
    return summary


def print_profile_summary(args: argparse.Namespace, summary: dict[str, Any]) -> None:
    print(f"\nprofiles of {args.profile_steps} steps per impl and rank in {args.profile}/")
    for kind, entry in summary.items():
        print(
            f"  ours {kind}: {entry['count']:.0f} per step, exposed wait "
            f"{entry['exposed_s'] * 1e3:.2f} ms per step (CommTrace)"
        )


# Analysis #


def fsdp_group_bytes(config: LlamaConfig) -> tuple[list[int], int]:
    """(param bytes of each block, param bytes of the root's own params), from a meta model."""
    with torch.device("meta"):
        model = Llama(config)
    *blocks, root = [sum(p.numel() * p.element_size() for p in g) for g in group_params(model)]
    return blocks, root


def analytic_fsdp(config: LlamaConfig, world: int) -> dict[str, float]:
    """The FSDP step under torchtitan's settings: every block all-gathered in forward and
    again in backward except the last (not resharded after forward), the root once, and
    one reduce-scatter per group."""
    blocks, root = fsdp_group_bytes(config)
    param_bytes = sum(blocks) + root
    factor = (world - 1) / world
    return {
        "param_bytes": param_bytes,
        "groups": len(blocks) + 1,
        "all_gathers": 2 * len(blocks),
        "reduce_scatters": len(blocks) + 1,
        "wire_bytes_bound": factor * (3 * sum(blocks) - blocks[-1] + 2 * root),
    }


def main() -> None:
    args = parse_args()
    if dtensor_fsdp is None:
        if "ours" in args.impls and int(os.environ.get("RANK", "0")) == 0:
            print(
                f"bench_train: skipping 'ours': import dtensor_fsdp failed: {_OURS_IMPORT_ERROR}",
                file=sys.stderr,
            )
        args.impls = [name for name in args.impls if name != "ours"]
    device = init_distributed(args.device)
    try:
        config = build_config(args)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        isolated = {name: run_isolated(name, mesh, config, args, device) for name in args.impls}
        impls = [build_impl(name, config, mesh, device, args) for name in args.impls]
        times, losses = time_rounds(impls, config, args, device)
        profiled = profile_impls(impls, config, args, device) if args.profile else None
        if dist.get_rank() == 0:
            run = {
                "world_size": dist.get_world_size(),
                "device": device.type,
                "backend": dist.get_backend(),
                "torch": torch.__version__,
            }
            analytic = analytic_fsdp(config, run["world_size"])
            results = build_results(args, config, run, analytic, isolated, times, losses)
            print_report(results)
            if profiled is not None:
                print_profile_summary(args, profiled)
                results["profile"] = {"dir": args.profile, "ours_comm_per_step": profiled}
            print("BENCH_JSON " + json.dumps(results), flush=True)
        del impls
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
