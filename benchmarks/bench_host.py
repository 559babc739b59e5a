"""Host overhead of FSDP: ours vs torch's ``fully_shard``, Python calls and host time.

    python benchmarks/bench_host.py                            # fake process group, W=2
    python benchmarks/bench_host.py --mixed-precision          # bf16 params, fp32 reduce
    torchrun --nproc-per-node 2 benchmarks/bench_host.py       # gloo, W=2

GPUs are fed by the host: FSDP's per-parameter Python work is what a step costs beyond
the kernels when the model has many small parameters. Two models whose compute is
negligible, so what is measured is FSDP's Python:

- ``linears``: 64 groups of 8 ``Linear(8, 8)`` (``fully_shard`` on each group of 8, then
  on the root), 1024 parameters;
- ``llama``: ``models/llama.py`` with 24 blocks of tiny width (``fully_shard`` on each
  block, then on the root), 9 parameters per block.

A step is ``forward + loss.backward()`` from ``.grad = None`` (so every step lands new
sharded grads, as after ``optimizer.zero_grad()``); no optimizer. Reported per model
and implementation:

- **calls/param**: Python function calls (cProfile's total, primitive and recursive)
  during one step, torch's DTensor and autograd Python included, over the number of
  parameters. Deterministic: the warm-up steps run first, so lazy init is excluded.
- **host ms**: the median wall time of ``--steps`` steps, interleaved ours, torch, ours,
  torch... so that load on the machine hits both alike. On the fake process group no
  collective communicates, so this is all host time; on gloo it includes the wire.
- **plain**: the same model without FSDP (fp32 also under ``--mixed-precision``): the
  model's own Python and compute, which both FSDPs pay; the ``fsdp`` row divides what
  ours adds to it by what torch's adds.
- **cpu ms**: the median CPU time of this thread over the same steps (the forward, the
  backward of CPU tensors and FSDP's hooks all run on it): what the host spent, less
  sensitive than wall time to other processes taking the cores of a shared machine.

Ratios are ours / torch; the targets (issue 20) are calls/param <= 0.7 and host time
<= 0.8. Without torchrun the script builds torch's ``fake`` process group in one
process (``--world-size`` ranks, this process rank 0).
"""

import argparse
import cProfile
import os
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import MixedPrecisionPolicy, fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig

IMPLS = ("ours", "torch", "plain")
MODELS = ("linears", "llama")
TARGET_CALLS = 0.7
TARGET_TIME = 0.8
LLAMA = LlamaConfig(
    vocab_size=64,
    dim=16,
    n_layers=24,
    n_heads=2,
    n_kv_heads=2,
    ffn_hidden_dim=32,
    max_seq_len=8,
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--steps", type=int, default=30, help="timed steps per impl")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2, help="fake process group only")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 params, fp32 reduce")
    args = parser.parse_args()
    args.models = args.models.split(",")
    if any(m not in MODELS for m in args.models):
        parser.error(f"--models must be among {MODELS}")
    return args


def init_group(world_size: int) -> DeviceMesh:
    """gloo under torchrun, else the fake process group in this process."""
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return init_device_mesh("cpu", (dist.get_world_size(),))


def build(model_name: str, impl: str, mesh: DeviceMesh, mixed: bool) -> tuple[nn.Module, Callable]:
    """The sharded model and a function computing its loss on a fixed input."""
    torch.manual_seed(0)
    if model_name == "linears":
        model = nn.Sequential(
            *(nn.Sequential(*(nn.Linear(8, 8) for _ in range(8))) for _ in range(64))
        )
        blocks = list(model)
        x = torch.randn(4, 8)
        loss_fn = lambda: model(x).sum()
    else:
        model = Llama(LLAMA)
        blocks = list(model.layers)
        tokens = torch.randint(0, LLAMA.vocab_size, (2, LLAMA.max_seq_len))
        loss_fn = lambda: model(tokens).float().sum()
    if impl == "plain":
        return model, loss_fn
    shard = fully_shard if impl == "ours" else torch_fully_shard
    policy_type = MixedPrecisionPolicy if impl == "ours" else TorchMixedPrecisionPolicy
    kwargs = {"mesh": mesh}
    if mixed:
        kwargs["mp_policy"] = policy_type(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model, loss_fn


def step(model: nn.Module, loss_fn: Callable) -> None:
    for param in model.parameters():
        param.grad = None
    loss_fn().backward()


def count_calls(model: nn.Module, loss_fn: Callable) -> int:
    """Python calls during one step, torch's included."""
    for param in model.parameters():
        param.grad = None
    profiler = cProfile.Profile()
    profiler.enable()
    loss_fn().backward()
    profiler.disable()
    return pstats.Stats(profiler).total_calls


def main() -> None:
    args = parse_args()
    # The compute is negligible; one intra-op thread keeps other processes on a shared
    # machine from stalling the step in OpenMP's spin-waits.
    torch.set_num_threads(1)
    mesh = init_group(args.world_size)
    rank0 = dist.get_rank() == 0
    backend = dist.get_backend()
    if rank0:
        print(
            f"backend {backend}, W={dist.get_world_size()}, mixed precision "
            f"{'bf16/fp32' if args.mixed_precision else 'off'}, {args.steps} steps per impl"
        )
        print(
            f"{'model':8} {'impl':6} {'params':>6} {'calls/param':>11} {'host ms':>8} {'cpu ms':>8}"
        )
    for model_name in args.models:
        built = {impl: build(model_name, impl, mesh, args.mixed_precision) for impl in IMPLS}
        n_params = sum(1 for _ in built["ours"][0].parameters())
        for impl in IMPLS:
            for _ in range(args.warmup):
                step(*built[impl])
        calls = {impl: count_calls(*built[impl]) / n_params for impl in IMPLS}
        walls: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        cpus: dict[str, list[float]] = {impl: [] for impl in IMPLS}
        for _ in range(args.steps):
            for impl in IMPLS:
                if backend != "fake":
                    dist.barrier()
                start, start_cpu = time.perf_counter(), time.thread_time()
                step(*built[impl])
                walls[impl].append(time.perf_counter() - start)
                cpus[impl].append(time.thread_time() - start_cpu)
        ms = {impl: 1e3 * statistics.median(walls[impl]) for impl in IMPLS}
        cpu_ms = {impl: 1e3 * statistics.median(cpus[impl]) for impl in IMPLS}
        if rank0:
            for impl in IMPLS:
                print(
                    f"{model_name:8} {impl:6} {n_params:6} {calls[impl]:11.1f} "
                    f"{ms[impl]:8.2f} {cpu_ms[impl]:8.2f}"
                )
            print(
                f"{model_name:8} ratio  {'':6} {calls['ours'] / calls['torch']:11.2f} "
                f"{ms['ours'] / ms['torch']:8.2f} {cpu_ms['ours'] / cpu_ms['torch']:8.2f}   "
                f"(targets <= {TARGET_CALLS}, <= {TARGET_TIME})"
            )
            fsdp = {  # what FSDP adds to the plain model's step
                name: (v["ours"] - v["plain"]) / (v["torch"] - v["plain"])
                for name, v in (("calls", calls), ("ms", ms), ("cpu", cpu_ms))
            }
            print(
                f"{model_name:8} fsdp   {'':6} {fsdp['calls']:11.2f} {fsdp['ms']:8.2f} "
                f"{fsdp['cpu']:8.2f}   (ours' additions over the plain model / torch's)"
            )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
