"""Time the optimizer step and gradient clipping of a sharded model: torch.optim and
torch.nn.utils.clip_grad_norm_ over the DTensors vs dtensor_fsdp.optim on local tensors.

    torchrun --nproc-per-node 2 benchmarks/bench_optim.py               # CPU + gloo
    torchrun --nproc-per-node 4 benchmarks/bench_optim.py
    torchrun --nproc-per-node 2 benchmarks/bench_optim.py --layers 4 --steps 10
    torchrun --nproc-per-node 8 benchmarks/bench_optim.py --device cuda  # NCCL

The model is the main job's Llama (``train.py``; ``--model small``: 39 params at 4
layers, 219 at 24) with ``dtensor_fsdp.fully_shard`` on every block and on the root.
For each layer count in ``--layers``, in one launch:

1. **Optimizer step** (per variant of ``--variants``: ``foreach`` = AdamW(foreach=True)
   as train.py builds it, ``default`` = AdamW() whose default is the for-loop on CPU,
   ``fused`` = AdamW(fused=True)): after one forward/backward, three copies of the
   sharded params with the same grads are stepped in turn, ``--warmup`` + ``--steps``
   rounds: ``dtensor`` (torch.optim on the DTensors), ``local``
   (``step_on_local_shards``) and ``flat`` (the same AdamW over one plain buffer per
   ``fully_shard`` group, of the group's local numel, with random grads: a measurement
   of the flat-buffer alternative, which dtensor_fsdp does not build). Afterwards the
   ``dtensor`` and ``local`` copies must be bitwise equal (``bitwise``).
2. **Clipping**: ``torch.nn.utils.clip_grad_norm_`` vs ``dtensor_fsdp.optim.clip_grad_norm_``
   on the model's DTensor grads, in turn, in two regimes: ``fires`` (``max_norm`` just
   below the norm: both scale every grad) and ``quiet`` (``max_norm`` = 1e9: torch
   multiplies by 1.0, ours skips that on the CPU); ``norm rel diff`` is the relative
   difference of the two norms on the same grads.
3. **Training step** (forward + backward + clip + AdamW(foreach=True) step + zero_grad,
   as train.py): ``before`` (torch's clip, torch.optim on the DTensors) and ``after``
   (dtensor_fsdp.optim's clip and local-shard step) trained side by side on the same
   batches; ``loss diff`` is the largest difference of their losses (the norms differ
   in the last bits, so the runs are not bitwise equal). A third model, torch's clip
   with the local-shard step, must end bitwise equal to ``before`` (``bitwise``).

Every timed call is preceded by a barrier; its time is the slowest rank's; the figure
is the median over the timed rounds, each round running the sides in a rotated order. Rank 0 prints a table and ``BENCH_OPTIM_JSON {...}``.
On a shared CPU, other processes inflate every figure; the ratios come from
interleaved rounds, so drift affects both sides alike.
"""

import argparse
import dataclasses
import gc
import json
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from common.dist import init_distributed, leave_process_group, reduce_over_ranks, slowest_seconds
from common.workload import group_params, rank_tokens, shard_blocks_then_root
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import dtensor_fsdp
from dtensor_fsdp.models.llama import PRESETS, Llama, LlamaConfig, cross_entropy_loss
from dtensor_fsdp.optim import clip_grad_norm_, step_on_local_shards

VARIANTS = {"foreach": {"foreach": True}, "default": {}, "fused": {"fused": True}}
HUGE_NORM = 1e9  # clipping at this norm scales by exactly 1.0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="small")
    parser.add_argument("--layers", default="4,24", help="comma-separated layer counts")
    parser.add_argument(
        "--variants", default="foreach,default", help=f"subset of {','.join(VARIANTS)}"
    )
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args()
    args.layers = [int(n) for n in args.layers.split(",") if n]
    args.variants = [v for v in args.variants.split(",") if v]
    if any(v not in VARIANTS for v in args.variants):
        parser.error(f"--variants must be a subset of {','.join(VARIANTS)}")
    return args


def build_model(config: LlamaConfig, mesh: DeviceMesh, device: torch.device) -> Llama:
    torch.manual_seed(0)
    with device:
        model = Llama(config)
    return shard_blocks_then_root(model, dtensor_fsdp.fully_shard, mesh=mesh)


def tokens_for(step: int, config: LlamaConfig, args: argparse.Namespace, device: torch.device):
    tokens = rank_tokens(1000 + step, config.vocab_size, args.batch_size, args.seq_len)
    return tokens.to(device)  # (B, T + 1)


def rotated(items: dict, round_: int) -> list:
    """``items``' (name, value) pairs, starting at the ``round_``-th: each runs first
    equally often, so order effects (caches, drift) fall on every side alike."""
    pairs = list(items.items())
    shift = round_ % len(pairs)
    return pairs[shift:] + pairs[:shift]


def median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


# Part 1: the optimizer step #


def param_copies(model: nn.Module) -> list[nn.Parameter]:
    """The model's sharded params as new DTensor Parameters (own storage) with copies of
    their grads: an optimizer stepping them costs what stepping the model costs."""
    copies = []
    for p in model.parameters():
        local = p.to_local().detach().clone()
        copy = nn.Parameter(
            DTensor.from_local(
                local,
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        )
        grad = p.grad.to_local().detach().clone()
        copy.grad = DTensor.from_local(
            grad, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )
        copies.append(copy)
    return copies


def flat_buffers(model: Llama) -> list[torch.Tensor]:
    """One plain fp32 buffer per fully_shard group (each block, then the root's own
    params), of the group's local numel, with random grads."""
    buffers = []
    for group in group_params(model):
        numel = sum(p.to_local().numel() for p in group)
        buffer = torch.zeros(numel, device=group[0].device)
        buffer.grad = torch.randn_like(buffer)
        buffers.append(buffer)
    return buffers


def bench_step(model: Llama, variant: str, args: argparse.Namespace, device: torch.device) -> dict:
    kwargs = VARIANTS[variant]
    on_dtensors, on_locals = param_copies(model), param_copies(model)
    optimizers = {
        "dtensor": torch.optim.AdamW(on_dtensors, lr=args.lr, **kwargs),
        "local": torch.optim.AdamW(on_locals, lr=args.lr, **kwargs),
        "flat": torch.optim.AdamW(flat_buffers(model), lr=args.lr, **kwargs),
    }
    step_on_local_shards(optimizers["local"])
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for round_ in range(args.warmup + args.steps):
        for name, optimizer in rotated(optimizers, round_):
            seconds = slowest_seconds(optimizer.step, device)
            if round_ >= args.warmup:
                times[name].append(seconds)
    bitwise = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(on_dtensors, on_locals, strict=True)
    )
    ms = {name: median_ms(values) for name, values in times.items()}
    return {
        **{f"{name}_ms": value for name, value in ms.items()},
        "local_speedup": ms["dtensor"] / ms["local"],
        "flat_vs_local": ms["local"] / ms["flat"],
        "bitwise": bitwise and all_ranks(bitwise),
    }


def all_ranks(flag: bool) -> bool:
    return reduce_over_ranks([float(flag)], dist.ReduceOp.MIN)[0] == 1.0


# Part 2: clipping #


def bench_clip(model: Llama, args: argparse.Namespace, device: torch.device) -> dict:
    """Two regimes: ``fires`` (max_norm just below the norm: every call scales the
    grads, by a coefficient a hair under 1, so they barely shrink over the rounds) and
    ``quiet`` (max_norm 1e9: torch multiplies by 1.0, ours skips that on the CPU)."""
    params = list(model.parameters())
    norm = torch.nn.utils.clip_grad_norm_(params, HUGE_NORM).full_tensor().item()
    ours_norm = clip_grad_norm_(params, HUGE_NORM).full_tensor().item()
    result = {"norm": norm, "norm_rel_diff": abs(ours_norm - norm) / norm}
    for regime, max_norm in (("fires", 0.999 * norm), ("quiet", HUGE_NORM)):
        clippers = {
            "torch": lambda m=max_norm: torch.nn.utils.clip_grad_norm_(params, m),
            "ours": lambda m=max_norm: clip_grad_norm_(params, m),
        }
        times: dict[str, list[float]] = {name: [] for name in clippers}
        for round_ in range(args.warmup + args.steps):
            for name, clip in rotated(clippers, round_):
                seconds = slowest_seconds(clip, device)
                if round_ >= args.warmup:
                    times[name].append(seconds)
        ms = {name: median_ms(values) for name, values in times.items()}
        result[regime] = {
            "torch_ms": ms["torch"],
            "ours_ms": ms["ours"],
            "speedup": ms["torch"] / ms["ours"],
        }
    return result


# Part 3: the training step #


@dataclasses.dataclass
class Run:
    model: Llama
    optimizer: torch.optim.Optimizer
    clip: Callable[..., torch.Tensor]
    losses: list[float] = dataclasses.field(default_factory=list)


def train_step(run: Run, step: int, config: LlamaConfig, args, device) -> None:
    tokens = tokens_for(step, config, args, device)
    loss = cross_entropy_loss(run.model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    run.clip(run.model.parameters(), 1.0)
    run.optimizer.step()
    run.optimizer.zero_grad()
    run.losses.append(loss.item())


def bench_train(config: LlamaConfig, mesh: DeviceMesh, args, device) -> dict:
    runs = {}
    for name, local, clip in (
        ("before", False, torch.nn.utils.clip_grad_norm_),
        ("after", True, clip_grad_norm_),
        ("local_torch_clip", True, torch.nn.utils.clip_grad_norm_),
    ):
        model = build_model(config, mesh, device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
        if local:
            step_on_local_shards(optimizer)
        runs[name] = Run(model, optimizer, clip)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for step in range(args.warmup + args.steps):
        for name, run in rotated(runs, step):
            seconds = slowest_seconds(
                lambda run=run, step=step: train_step(run, step, config, args, device), device
            )
            if step >= args.warmup:
                times[name].append(seconds)
    bitwise = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(
            runs["before"].model.parameters(),
            runs["local_torch_clip"].model.parameters(),
            strict=True,
        )
    )
    ms = {name: median_ms(values) for name, values in times.items()}
    return {
        "before_ms": ms["before"],
        "after_ms": ms["after"],
        "speedup": ms["before"] / ms["after"],
        "loss_diff": max(
            abs(a - b) for a, b in zip(runs["before"].losses, runs["after"].losses, strict=True)
        ),
        "bitwise": all_ranks(bitwise),
    }


# Report #


def print_report(results: dict) -> None:
    head = results["setup"]
    print(
        f"\nbench_optim | world {head['world_size']} | {head['model']} | device {head['device']} | "
        f"{head['steps']} timed rounds after {head['warmup']} (median ms, slowest rank)"
    )
    print(
        f"\n{'layers':>6} {'params':>6} {'variant':>8} {'dtensor':>9} {'local':>9} {'flat':>9} "
        f"{'dtensor/local':>13} {'local/flat':>10} {'bitwise':>8}"
    )
    for entry in results["step"]:
        print(
            f"{entry['layers']:>6} {entry['params']:>6} {entry['variant']:>8} "
            f"{entry['dtensor_ms']:>9.2f} {entry['local_ms']:>9.2f} {entry['flat_ms']:>9.2f} "
            f"{entry['local_speedup']:>12.2f}x {entry['flat_vs_local']:>9.2f}x {entry['bitwise']!s:>8}"
        )
    print(
        f"\n{'layers':>6} {'regime':>6} {'clip torch':>10} {'clip ours':>10} "
        f"{'torch/ours':>10} {'norm rel diff':>13}"
    )
    for entry in results["clip"]:
        for regime in ("fires", "quiet"):
            timing = entry[regime]
            print(
                f"{entry['layers']:>6} {regime:>6} {timing['torch_ms']:>10.2f} "
                f"{timing['ours_ms']:>10.2f} {timing['speedup']:>9.2f}x "
                f"{entry['norm_rel_diff']:>13.2e}"
            )
    print(
        f"\n{'layers':>6} {'step before':>11} {'step after':>10} {'before/after':>12} "
        f"{'loss diff':>10} {'bitwise':>8}"
    )
    for entry in results["train"]:
        print(
            f"{entry['layers']:>6} {entry['before_ms']:>11.1f} {entry['after_ms']:>10.1f} "
            f"{entry['speedup']:>11.2f}x {entry['loss_diff']:>10.2e} {entry['bitwise']!s:>8}"
        )


def main() -> None:
    args = parse_args()
    device = init_distributed(args.device)
    try:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        results = {
            "setup": {
                "world_size": dist.get_world_size(),
                "model": args.model,
                "device": str(device),
                "steps": args.steps,
                "warmup": args.warmup,
                "seq_len": args.seq_len,
                "batch_size": args.batch_size,
            },
            "step": [],
            "clip": [],
            "train": [],
        }
        for layers in args.layers:
            config = dataclasses.replace(
                PRESETS[args.model](), n_layers=layers, max_seq_len=args.seq_len
            )
            model = build_model(config, mesh, device)
            tokens = tokens_for(0, config, args, device)
            cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
            params = len(list(model.parameters()))
            for variant in args.variants:
                entry = bench_step(model, variant, args, device)
                results["step"].append(
                    {"layers": layers, "params": params, "variant": variant, **entry}
                )
            results["clip"].append({"layers": layers, **bench_clip(model, args, device)})
            del model
            gc.collect()
            results["train"].append({"layers": layers, **bench_train(config, mesh, args, device)})
            gc.collect()
        if dist.get_rank() == 0:
            print_report(results)
            print("BENCH_OPTIM_JSON " + json.dumps(results), flush=True)
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
