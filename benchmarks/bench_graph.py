"""Graph mode (``dtensor_fsdp.compile``) against eager FSDP, torch's FSDP2 and the plain
model, side by side in one run (issue 31).

    python benchmarks/bench_graph.py --quick            # CPU, < 10 min on 2 cores
    python benchmarks/bench_graph.py                    # host-bound model, 32 blocks
    python benchmarks/bench_graph.py --device cuda      # + 8B-shaped and busy models

One process on torch's ``fake`` process group at W=8 (collectives are no-ops: time,
memory and counts only, values are garbage), except the bitwise check, which spawns 2
real gloo ranks. Every model is ``models/llama.py``, ``fully_shard`` on each block, then
on the root. Configurations, built side by side:

- ``plain``: the unsharded model, eager (the reference, ratio 1.0; bf16 by autocast);
- ``ours``: ``dtensor_fsdp.fully_shard``, eager;
- ``graph``: the same, then ``dtensor_fsdp.compile`` (inductor, bucketing on, static
  shapes; ``fullgraph=False`` so that breaks are counted, not raised);
- ``graph+cudagraphs`` (CUDA, host-bound model): the same with ``mode="reduce-overhead"``
  (inductor's CUDA graphs);
- ``torch``: ``torch.distributed.fsdp.fully_shard``, eager, defaults;
- ``torch+compile``: torchtitan's recipe: each block ``.compile(backend="inductor",
  fullgraph=True)``, then torch's ``fully_shard``.

Models: **host-bound** (32 blocks of dim 256, vocab 1024, batch 2 x seq 128, fp32; 8
blocks under ``--quick``), **8B-shaped** (Llama-3-8B shapes, 8 blocks, batch 1 x seq
4096, bf16 mixed precision; CUDA only) and **busy** (16 blocks of dim 2048, vocab 16384,
0.88B parameters, batch 2 x seq 2048, bf16; CUDA only).

A step is forward + loss + backward + AdamW step + ``zero_grad`` (+ a device sync);
``ours`` and ``graph`` step AdamW on the local shards (``step_on_local_shards``, bitwise
the DTensor step), torch's configurations on the DTensors (foreach), as each is best. Per
model and configuration: **first s**, the first steps (compilation); **median ms**, the
median over ``--steps`` rounds, one step of each configuration per round in an order
rotated every round; **x plain**; **AG / RS**: all-gathers / reduce-scatters in one step
after warm-up, counted as the ``c10d::`` collective ops that torch.profiler records (one
counter for every configuration: eager FSDPs call them, and so does each functional
collective of a compiled graph; checked equal to ``tests/_c10d.py``'s ``C10dRecorder``
on ours' eager step. The recorder itself cannot count compiled graphs: under a dispatch
mode dynamo runs the frames eagerly, unbucketed; graph mode has no eager collective, so
its counts come from the graphs alone); on CUDA **peak
MiB**: ``max_memory_allocated`` over one step, less the memory allocated before the
configuration was built (after a cuBLAS warm-up), i.e. the peak it has alone; and on
the busy model **busy**: the union of CUDA kernel intervals of one profiled step
(torch.profiler's device timeline) over the median unprofiled step (the fake group
launches no communication kernels).

**Host time**: the wall time per step of the host-bound model with batch 1 x seq 1,
CPU, fp32, fake group: the same ops, launches and Python as the real step, negligible
arithmetic (but not negligible parameter bytes: copying, reducing and updating 7M fp32
parameters is memory traffic on a CPU, so the same blocks at width 16 follow; the last
line's Y is the former). **Bitwise**: 2 gloo ranks train a small Llama 5 steps in eager
mode and in graph mode with ``backend="aot_eager"`` (bucketing on), fp32 and bf16 mixed precision:
losses and final parameters must be bitwise equal. The last line reads
``graph: breaks=N bitwise=yes|no collectives_graph/eager=X host_graph/eager=Y
overhead_graph/eager=Z`` (N: graph breaks of graph mode's compile, X: all-gathers +
reduce-scatters per step of the host-bound model, graph over eager, Y: host time, graph
over eager, Z: what FSDP adds to the plain model's step on the width-16 blocks, graph
mode's over our eager's: (graph - plain) / (ours - plain)).
"""

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from _graph_configs import (  # same directory
    BUSY,
    EIGHT_B,
    Runner,
    Workload,
    build,
    host_bound,
    llama,
    narrow,
    precision,
)
from common.device import sync, warm_up_cublas
from common.spawn import run_ranks
from common.workload import shard_blocks_then_root
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.profiler import ProfilerActivity, profile

import dtensor_fsdp
from dtensor_fsdp.models.llama import (
    Llama,
    cross_entropy_loss,
    swiglu_hidden_dim,
)
from tests._c10d import KINDS, C10dRecorder, count_of

CONFIGS = ("plain", "ours", "graph", "torch", "torch+compile")
WORLD_SIZE = 8
MiB = 2**20


def step(runner: Runner, tokens: torch.Tensor) -> None:
    device = tokens.device
    with torch.autocast(device.type, torch.bfloat16, enabled=runner.autocast):
        loss = cross_entropy_loss(runner.model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    runner.optimizer.step()
    runner.optimizer.zero_grad()
    sync(device)


@dataclass
class Measured:
    first_s: float = 0.0
    breaks: int = 0
    all_gathers: int = 0
    reduce_scatters: int = 0
    peak_bytes: int | None = None
    median_s: float = 0.0
    busy: float | None = None


def build_and_measure(
    name: str, workload: Workload, mesh: DeviceMesh, tokens: torch.Tensor, warmup: int
) -> tuple[Runner, Measured]:
    """Build, warm up (compile), count the collectives of one step and, on CUDA, the
    peak of one step over the memory this configuration added."""
    cuda = tokens.device.type == "cuda"
    before = torch.cuda.memory_allocated() if cuda else 0
    breaks_before = sum(counters["graph_break"].values())
    start = time.perf_counter()
    runner = build(name, workload, mesh, tokens.device)
    for _ in range(warmup):
        step(runner, tokens)
    measured = Measured(first_s=time.perf_counter() - start)
    measured.breaks = sum(counters["graph_break"].values()) - breaks_before
    kinds = count_collectives(runner, tokens)
    measured.all_gathers = kinds["all_gather"]
    # gloo's reduce-scatter is an all-to-all and a local sum (ours' plan on gloo).
    measured.reduce_scatters = kinds["reduce_scatter"] + kinds["all_to_all"]
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        step(runner, tokens)
        measured.peak_bytes = torch.cuda.max_memory_allocated() - before
    return runner, measured


def count_collectives(runner: Runner, tokens: torch.Tensor) -> Counter:
    """The collectives of one step by kind: the ``c10d::`` ops that torch.profiler
    records. Every collective ends in one (eager FSDP calls them; a compiled graph's
    functional collective calls one underneath), and the profiler, unlike a dispatch
    mode, leaves compiled frames compiled: under ``C10dRecorder`` dynamo runs the
    frames eagerly, so it would count graph mode's uncompiled, unbucketed gathers."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(runner, tokens)
    kinds: Counter = Counter({kind: 0 for kind in KINDS})
    for event in prof.events():
        namespace, _, name = event.name.partition("::")
        # Only c10d's: a functional collective shows as its own op and as the c10d op
        # it calls; counting both would count it twice.
        if namespace == "c10d" and (namespace, name) in C10dRecorder.OPS:
            kinds[C10dRecorder.OPS[(namespace, name)][0]] += 1
    return kinds


def recorder_counts(runner: Runner, tokens: torch.Tensor) -> Counter:
    """The same step's collectives by kind, counted by ``C10dRecorder``: the
    cross-check of `count_collectives` on an eager configuration."""
    recorder = C10dRecorder()
    with recorder:
        step(runner, tokens)
    return Counter({kind: count_of(recorder.records, kind) for kind in KINDS})


def time_interleaved(runners: dict[str, Runner], tokens: torch.Tensor, rounds: int) -> dict:
    """Median step time per configuration, one step each per round, order rotated."""
    names = list(runners)
    if not names:
        return {}
    times: dict[str, list[float]] = {name: [] for name in names}
    for index in range(rounds):
        shift = index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            step(runners[name], tokens)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def kernel_busy_s(runner: Runner, tokens: torch.Tensor) -> float:
    """The union of CUDA kernel intervals (seconds) during one profiled step."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(runner, tokens)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    spans = sorted(
        (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "kernel" and "dur" in e
    )
    total, end = 0.0, float("-inf")
    for lo, hi in spans:  # microseconds; overlapping kernels count once
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total * 1e-6


def run_workload(
    workload: Workload, configs: tuple[str, ...], mesh: DeviceMesh, device: torch.device,
    args: argparse.Namespace, profile_busy: bool = False,
) -> dict[str, Measured]:  # fmt: skip
    """Every configuration of ``workload`` built side by side, measured and timed; a
    configuration that fails is reported and left out."""
    generator = torch.Generator().manual_seed(0)
    shape = (workload.batch, workload.seq + 1)
    tokens = torch.randint(workload.config.vocab_size, shape, generator=generator).to(device)
    runners: dict[str, Runner] = {}
    results: dict[str, Measured] = {}
    for name in configs:
        try:
            runners[name], results[name] = build_and_measure(
                name, workload, mesh, tokens, args.warmup
            )
        except Exception as error:  # noqa: BLE001 - one failed config must not end the run
            print(f"  {name}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:300]}")
    if "ours" in runners:
        profiled = count_collectives(runners["ours"], tokens)
        recorded = recorder_counts(runners["ours"], tokens)
        print(f"  ours eager: profiler counts = C10dRecorder counts: {profiled == recorded}")
    for name, median in time_interleaved(runners, tokens, args.steps).items():
        results[name].median_s = median
    if profile_busy:
        for name in ("ours", "graph", "graph+cudagraphs"):
            if name in runners:
                results[name].busy = kernel_busy_s(runners[name], tokens) / results[name].median_s
    runners.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def print_table(workload: Workload, results: dict[str, Measured]) -> None:
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(workload.config).parameters())
    print(
        f"\n{workload.name}: {n_params / 1e6:.1f}M params, batch {workload.batch} x seq "
        f"{workload.seq}, {'bf16 mixed precision' if workload.bf16 else 'fp32'}, fake W={WORLD_SIZE}"
    )
    header = f"{'config':<14} {'first s':>8} {'median ms':>10} {'x plain':>8} {'AG':>4} {'RS':>4} {'peak MiB':>9} {'busy':>6}"
    print(header + "\n" + "-" * len(header))
    plain = results.get("plain")
    for name, r in results.items():
        ratio = r.median_s / plain.median_s if plain and plain.median_s else float("nan")
        peak = f"{r.peak_bytes / MiB:9.0f}" if r.peak_bytes is not None else f"{'-':>9}"
        busy = f"{r.busy:6.2f}" if r.busy is not None else f"{'-':>6}"
        print(
            f"{name:<14} {r.first_s:8.1f} {r.median_s * 1e3:10.2f} {ratio:8.3f} "
            f"{r.all_gathers:4d} {r.reduce_scatters:4d} {peak} {busy}"
        )
    if "graph" in results:
        print(f"  graph mode: {results['graph'].breaks} graph breaks (fullgraph=False)")
    sys.stdout.flush()


def collectives(result: Measured) -> int:
    return result.all_gathers + result.reduce_scatters


# Bitwise: 2 gloo ranks #

SMALL = llama(64, 2, 4, 2, swiglu_hidden_dim(64), 128, 16)


def bitwise_rank(steps: int) -> dict[str, bool]:
    """On each of 2 gloo ranks: eager vs graph mode (aot_eager, bucketing on), fp32 and
    bf16 mixed precision; per precision, whether losses and parameters are bitwise equal."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    equal = {}
    for label, bf16 in (("fp32", False), ("bf16", True)):
        runs = [train_small(mesh, bf16, graph, steps) for graph in (False, True)]
        (eager_losses, eager_params), (graph_losses, graph_params) = runs
        equal[label] = eager_losses == graph_losses and all(
            torch.equal(eager_params[name], graph_params[name]) for name in eager_params
        )
    return equal


def train_small(
    mesh: DeviceMesh, bf16: bool, graph: bool, steps: int
) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = Llama(SMALL)
    policy = dtensor_fsdp.MixedPrecisionPolicy(**precision(bf16))
    shard_blocks_then_root(model, dtensor_fsdp.fully_shard, mesh=mesh, mp_policy=policy)
    if graph:
        dtensor_fsdp.compile(model, backend="aot_eager", fullgraph=False)
    runner = Runner(model, torch.optim.AdamW(model.parameters(), lr=1e-2), autocast=False)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(steps):
        tokens = torch.randint(SMALL.vocab_size, (2, SMALL.max_seq_len + 1), generator=generator)
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        runner.optimizer.step()
        runner.optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {name: p.full_tensor() for name, p in model.named_parameters()}


def run_bitwise(steps: int) -> bool | None:
    try:
        per_rank = run_ranks(functools.partial(bitwise_rank, steps), world_size=2)
    except RuntimeError as error:
        lines = str(error).splitlines()  # the rank's traceback: its head and its end
        print("\nbitwise: FAILED:\n" + "\n".join(lines[:2] + ["  ..."] + lines[-12:]))
        return False
    verdict = {label: all(r[label] for r in per_rank) for label in per_rank[0]}
    print(f"\nbitwise (2 gloo ranks, {steps} steps, aot_eager, bucketing on): {verdict}")
    return all(verdict.values())


# Main #


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 host-bound blocks, CPU parts")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--steps", type=int, help="timed rounds (default 10 quick, 20)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before measuring")
    parser.add_argument("--host-steps", type=int, default=30, help="timed rounds, host time")
    parser.add_argument(
        "--skip", default="", help="comma-separated parts to skip: table,host,bitwise,8b,busy"
    )
    parser.add_argument("--json", help="also write the figures to this file (the GPU check)")
    args = parser.parse_args()
    args.steps = args.steps or (10 if args.quick else 20)
    args.skip = set(filter(None, args.skip.split(",")))
    return args


def pick_device(choice: str) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def main() -> None:
    args = parse_args()
    device = pick_device(args.device)
    if device.type == "cpu":
        # Compute is not what is measured: one thread keeps the other processes of a
        # shared machine from stalling OpenMP, and garbage (uninitialized) values from
        # slowing fp32 arithmetic down with denormals.
        torch.set_num_threads(1)
        torch.set_flush_denormal(True)
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD_SIZE)
    mesh = init_device_mesh(device.type, (WORLD_SIZE,))
    warm_up_cublas(device)
    print(f"torch {torch.__version__}, device {device}, fake process group W={WORLD_SIZE}")
    layers = 8 if args.quick else 32
    host = host_bound(layers)
    summary: dict[str, object] = {
        "breaks": None, "bitwise": None, "colls": None, "host": None, "overhead": None,
    }  # fmt: skip
    figures: dict[str, dict[str, dict[str, float | None]]] = {}
    # CUDA graphs (inductor's reduce-overhead) only where there is a device to graph.
    extra = ("graph+cudagraphs",) if device.type == "cuda" else ()
    if "table" not in args.skip:
        results = run_workload(host, CONFIGS + extra, mesh, device, args)
        print_table(host, results)
        figures["host-bound"] = as_figures(results)
        if "graph" in results and "ours" in results:
            summary["breaks"] = results["graph"].breaks
            summary["colls"] = collectives(results["graph"]) / max(1, collectives(results["ours"]))
    for workload, part in ((EIGHT_B, "8b"), (BUSY, "busy")):
        if part in args.skip:
            continue
        if device.type != "cuda" or args.quick:
            print(f"\n{workload.name}: skipped (CUDA only, not under --quick)")
            continue
        configs = CONFIGS if part == "8b" else ("plain", "ours", "graph", *extra)
        results = run_workload(workload, configs, mesh, device, args, part == "busy")
        print_table(workload, results)
        figures[part] = as_figures(results)
    if "host" not in args.skip:
        summary["host"], summary["overhead"] = run_host_time(layers, args)
    if "bitwise" not in args.skip:
        summary["bitwise"] = run_bitwise(steps=5)
    dist.destroy_process_group()
    print(last_line(summary))
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"summary": summary, "workloads": figures}, file, indent=1)


def as_figures(results: dict[str, Measured]) -> dict[str, dict[str, float | None]]:
    """Per configuration: the median step in ms and the busy fraction (or None)."""
    return {name: {"median_ms": r.median_s * 1e3, "busy": r.busy} for name, r in results.items()}


def run_host_time(layers: int, args: argparse.Namespace) -> tuple[float | None, float | None]:
    """Host time per step, graph over ours' eager: batch 1 x seq 1, CPU, fp32; first
    the host-bound model itself, then the same blocks at width 16 (the same ops,
    launches and parameter count, 1/256 of the parameter bytes: on a CPU, copying and
    updating 7M parameters is not negligible even for one token). Returns that ratio on
    the host-bound model, and on the width-16 blocks what FSDP adds to the plain
    model's step, graph mode's over our eager's."""
    cpu_mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    timing = argparse.Namespace(warmup=args.warmup, steps=args.host_steps)
    ratios, overhead = [], None
    for workload in (host_bound(layers, batch=1, seq=1), narrow(layers)):
        configs = ("plain", "ours", "graph")
        results = run_workload(workload, configs, cpu_mesh, torch.device("cpu"), timing)
        print_table(workload, results)
        if any(name not in results for name in configs):
            return None, None
        graph, ours, plain = (results[name].median_s for name in configs[::-1])
        ratios.append(graph / ours)
        overhead = (graph - plain) / (ours - plain)
        print(f"  host time per step: graph / ours eager = {ratios[-1]:.2f} (target <= 0.35)")
        print(f"  what FSDP adds to the plain step: graph / ours eager = {overhead:.2f}")
    return ratios[0], overhead


def last_line(summary: dict[str, object]) -> str:
    def fmt(value: object) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    bitwise = {True: "yes", False: "no", None: "n/a"}[summary["bitwise"]]
    breaks = "n/a" if summary["breaks"] is None else summary["breaks"]
    return (
        f"graph: breaks={breaks} bitwise={bitwise} collectives_graph/eager="
        f"{fmt(summary['colls'])} host_graph/eager={fmt(summary['host'])} "
        f"overhead_graph/eager={fmt(summary['overhead'])}"
    )


if __name__ == "__main__":
    main()
