"""Muon on a fully-sharded Llama: ours (owner ranks) vs torch.optim.Muon on the DTensors.

    torchrun --nproc-per-node 2 benchmarks/bench_muon.py                 # CPU + gloo, ~2 min
    torchrun --nproc-per-node 4 benchmarks/bench_muon.py
    torchrun --nproc-per-node 2 benchmarks/bench_muon.py --model small   # ~20x slower on CPU

The model is the main job's Llama (``dtensor_fsdp.models.llama``, "tiny" by default:
Newton-Schulz runs in bf16, and bf16 matmuls are ~100x slower than fp32 ones on the
project's CPUs, so "small" takes ~20 s per unsharded Muon step there), fp32, with
``dtensor_fsdp.fully_shard`` on every block and on the root, as ``train.py`` does, and
Muon's recipe (``split_muon_params``): Muon on the blocks' 2-D weights, AdamW on the
rest. Muon's settings are torch's defaults but ``lr=0.02``. Three phases:

1. **Accuracy** (``--accuracy-steps``, 20): the same global batches train three models:
   ours (``dtensor_fsdp.optim.Muon``), torch's (``torch.optim.Muon`` on the sharded
   DTensors) and, on rank 0 only, single-process ``torch.optim.Muon`` on unsharded
   copies, twice: with the gradient of one backward over the global batch, and with
   the gradient summed like the sharded run sums it (one backward per rank's rows,
   added in rank order, divided by W). Reported: the largest ``|param - reference|``
   over the Muon params after the last step, and the final losses.
2. **Collectives**: the c10d and functional collectives of one ``muon.step()`` of ours
   and of torch's, counted by ``CommDebugMode`` (which sees DTensor's too).
3. **Timing** of ``muon.step()`` alone, gradients in place (the forward and backward
   are FSDP's and the same for both), over ``--warmup`` + ``--steps`` rounds; each
   round times, in an order rotated every round: ours; torch's on the DTensors;
   ``torch.optim.Muon`` on unsharded copies of the same matrices on every rank at once
   (the ranks share the machine as in the other two); and the two all-to-alls of our
   plan alone (same split sizes and dtype). A barrier precedes each timed call; a
   call's time is the slowest rank's. The target is ours <= 1.5 x (unsharded / W +
   all-to-all).

Rank 0 prints a table and a final ``BENCH_JSON {...}`` line.
"""

import argparse
import dataclasses
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common.dist import slowest_seconds
from common.workload import shard_blocks_then_root
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_fsdp import fully_shard
from dtensor_fsdp.models.llama import PRESETS, Llama, LlamaConfig, cross_entropy_loss
from dtensor_fsdp.optim import Muon, split_muon_params
from dtensor_fsdp.optim.muon import _shard_layout, newton_schulz_cost
from dtensor_fsdp.optim.owner import plan_owners

MUON_LR = 0.02
ADAMW_LR = 3e-3


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--n-layers", type=int, help="override the preset")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--accuracy-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def build_config(args: argparse.Namespace) -> LlamaConfig:
    overrides: dict[str, Any] = {"max_seq_len": args.seq_len}
    if args.n_layers is not None:
        overrides["n_layers"] = args.n_layers
    return dataclasses.replace(PRESETS[args.model](), **overrides)


def build(config: LlamaConfig, seed: int, *, sharded: bool) -> Llama:
    torch.manual_seed(seed)
    model = Llama(config)
    if sharded:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        shard_blocks_then_root(model, fully_shard, mesh=mesh)
    return model


def optimizers(model: nn.Module, muon_cls: type) -> list[torch.optim.Optimizer]:
    muon_params, other = split_muon_params(model)
    return [muon_cls(muon_params, lr=MUON_LR), torch.optim.AdamW(other, lr=ADAMW_LR)]


def global_batch(step: int, config: LlamaConfig, args: argparse.Namespace) -> torch.Tensor:
    """(W * batch_size, seq_len + 1) tokens of ``step``, the same on every rank."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    rows = args.batch_size * dist.get_world_size()
    return torch.randint(config.vocab_size, (rows, args.seq_len + 1), generator=gen)


def loss_of(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


def step_all(opts: list[torch.optim.Optimizer]) -> None:
    for opt in opts:
        opt.step()
        opt.zero_grad(set_to_none=True)


# Phase 1: accuracy #


def accuracy(config: LlamaConfig, args: argparse.Namespace) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    sharded = {
        "ours": build(config, args.seed, sharded=True),
        "torch": build(config, args.seed, sharded=True),
    }
    sharded_opts = {
        "ours": optimizers(sharded["ours"], Muon),
        "torch": optimizers(sharded["torch"], torch.optim.Muon),
    }
    refs = {name: build(config, args.seed, sharded=False) for name in ("global", "summed")}
    ref_opts = {name: optimizers(model, torch.optim.Muon) for name, model in refs.items()}
    losses: dict[str, float] = {}
    for step in range(args.accuracy_steps):
        tokens = global_batch(step, config, args)
        for name, model in sharded.items():
            loss = loss_of(model, tokens.chunk(world)[rank])
            loss.backward()
            step_all(sharded_opts[name])
            losses[name] = mean_over_ranks(loss)
        if rank == 0:  # the other ranks wait in the next all-gather
            losses["global"] = reference_step(refs["global"], ref_opts["global"], [tokens])
            losses["summed"] = reference_step(
                refs["summed"], ref_opts["summed"], tokens.chunk(world)
            )
    muon_names = {n for n, p in refs["global"].named_parameters() if p.ndim == 2}
    muon_names -= {"tok_embeddings.weight", "output.weight"}
    fulls = {name: full_params(model) for name, model in sharded.items()}
    if rank != 0:
        return {}
    diffs = {
        f"{ours}_vs_{ref}": max_diff(fulls[ours], refs[ref], muon_names)
        for ours in sharded
        for ref in refs
    }
    return {"max_abs_diff": diffs, "final_loss": losses}


def reference_step(model: Llama, opts: list, chunks: list[torch.Tensor]) -> float:
    """One step on ``chunks``' rows; several chunks: one backward each, summed in order."""
    per_chunk, losses = [], []
    for chunk in chunks:
        model.zero_grad(set_to_none=True)
        loss = loss_of(model, chunk)
        loss.backward()
        per_chunk.append([p.grad for p in model.parameters()])
        losses.append(loss.item())
    for index, param in enumerate(model.parameters()):
        total = per_chunk[0][index]
        for grads in per_chunk[1:]:
            total = total + grads[index]
        param.grad = total / len(chunks)
    step_all(opts)
    return sum(losses) / len(losses)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {
        n: p.full_tensor() if isinstance(p, DTensor) else p for n, p in model.named_parameters()
    }


def max_diff(ours: dict[str, torch.Tensor], ref: nn.Module, names: set[str]) -> float:
    ref_params = dict(ref.named_parameters())
    return max((ours[n] - ref_params[n]).abs().max().item() for n in names)


def mean_over_ranks(value: torch.Tensor) -> float:
    total = value.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


# Phases 2 and 3: collectives and timing #


def with_grads(config: LlamaConfig, args: argparse.Namespace) -> list[nn.Parameter]:
    """The Muon params of a sharded model after one backward, with their gradients."""
    model = build(config, args.seed, sharded=True)
    tokens = global_batch(0, config, args).chunk(dist.get_world_size())[dist.get_rank()]
    loss_of(model, tokens).backward()
    return split_muon_params(model)[0]


def count_collectives(step: Callable[[], None]) -> dict[str, int]:
    with CommDebugMode() as comm:
        step()
    return {str(op).split(".")[-1]: n for op, n in comm.get_comm_counts().items() if n}


def unsharded_copies(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Plain full-size params with gradients, one per matrix, on every rank."""
    gen = torch.Generator().manual_seed(1)
    copies = []
    for param in params:
        copy = nn.Parameter(torch.randn(param.shape, generator=gen))
        copy.grad = torch.randn(param.shape, generator=gen)
        copies.append(copy)
    return copies


def all_to_alls(params: list[nn.Parameter]) -> Callable[[], None]:
    """The two all-to-alls of our plan for ``params``, alone (bf16, same splits)."""
    layout = _shard_layout(params[0])
    plan = plan_owners(
        [_shard_layout(p).matrix for p in params],
        [newton_schulz_cost(p.shape, 5) for p in params],
        layout.group_size,
        layout.group_rank,
    )
    send, recv = plan.send_splits(), plan.recv_splits()
    buffers = [torch.empty(sum(splits), dtype=torch.bfloat16) for splits in (send, recv)]

    def run() -> None:
        dist.all_to_all_single(buffers[1], buffers[0], recv, send, group=layout.group)
        dist.all_to_all_single(buffers[0], buffers[1], send, recv, group=layout.group)

    return run


def timing(config: LlamaConfig, args: argparse.Namespace) -> tuple[dict, dict]:
    params = with_grads(config, args)
    ours, theirs = Muon(params, lr=MUON_LR), torch.optim.Muon(params, lr=MUON_LR)
    unsharded = torch.optim.Muon(unsharded_copies(params), lr=MUON_LR)
    variants = {
        "ours": ours.step,
        "torch_dtensor": theirs.step,
        "unsharded": unsharded.step,
        "all_to_all": all_to_alls(params),
    }
    comms = {"ours": count_collectives(ours.step), "torch_dtensor": count_collectives(theirs.step)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for round_index in range(args.warmup + args.steps):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = slowest_seconds(variants[name])
            if round_index >= args.warmup:
                times[name].append(seconds)
    return times, comms


# Report #


def report(
    config: LlamaConfig, args: argparse.Namespace, acc: dict, times: dict, comms: dict
) -> None:
    world = dist.get_world_size()
    median = {name: statistics.median(values) for name, values in times.items()}
    bound = median["unsharded"] / world + median["all_to_all"]
    matrices = split_muon_params(build(config, args.seed, sharded=False))[0]
    print(
        f"{config}\nworld {world} | {len(matrices)} Muon matrices, "
        f"{sum(p.numel() for p in matrices):,} elements | CPU/gloo, fp32 params, bf16 NS"
    )
    print(f"{'muon.step()':<16}{'median ms':>10}{'p10 ms':>9}{'p90 ms':>9}  collectives")
    for name, values in times.items():
        q = (
            statistics.quantiles(values, n=10, method="inclusive")
            if len(values) > 1
            else values * 9
        )
        count = sum(comms.get(name, {}).values()) if name in comms else ""
        print(
            f"{name:<16}{median[name] * 1e3:>10.1f}{q[0] * 1e3:>9.1f}{q[-1] * 1e3:>9.1f}  {count}"
        )
    ratio = median["ours"] / bound
    print(
        f"ours / (unsharded / W + all-to-all) = {ratio:.2f} (target <= 1.5) | "
        f"torch_dtensor / ours = {median['torch_dtensor'] / median['ours']:.2f} | "
        f"ours / unsharded = {median['ours'] / median['unsharded']:.2f}"
    )
    print(f"collectives per step: ours {comms['ours']} | torch_dtensor {comms['torch_dtensor']}")
    for key, value in acc["max_abs_diff"].items():
        print(f"after {args.accuracy_steps} steps, max |param diff| {key}: {value:.3g}")
    print(f"final losses: {acc['final_loss']}")
    result = {
        "world_size": world,
        "model": args.model,
        "median_s": median,
        "ratio_to_target_bound": ratio,
        "collectives": comms,
        "accuracy": acc,
        "args": vars(args),
    }
    print("BENCH_JSON " + json.dumps(result))


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    try:
        config = build_config(args)
        acc = accuracy(config, args)
        times, comms = timing(config, args)
        if dist.get_rank() == 0:
            report(config, args, acc, times, comms)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
