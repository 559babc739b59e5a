"""Shard Llama 7B / 70B shapes at W = 8, 64, 1024 in one process, and predict memory;
with ``--step``, train them on fake tensors and measure it, ours against torch's.

    python3 benchmarks/scale_sim.py                     # dtensor_fsdp
    python3 benchmarks/scale_sim.py --impl torch        # torch's fully_shard, same report
    python3 benchmarks/scale_sim.py --models llama_7b --world-sizes 8,16
    python3 benchmarks/scale_sim.py --step --models llama_7b --world-sizes 8,1024

No GPU, no real ranks, no parameter memory: the model is built on the ``meta`` device and
sharded over torch's ``fake`` process group, which accepts any world size and does no
communication. Each world size gets a fresh group (destroyed and re-initialized), built
twice: as rank 0 and as the last rank, so both ends of ``torch.chunk``'s split are
checked. ``fully_shard`` goes on each ``TransformerBlock``, then on the root, as in
``train.py``; the root keeps ``reshard_after_forward=None`` (False for the root).

Checked (assert) for every parameter: the DTensor's global shape is the original shape,
and its local shape on rank r is ``torch.chunk(param, W, dim=0)[r]``'s (empty past the
last chunk: e.g. 32000 vocabulary rows over 1024 ranks make 1000 chunks of 32), and the
local sizes over all ranks add up to the parameter's size.

Reported per (model, W), for one rank (rank 0, which holds the most):

- groups: ``fully_shard`` groups (blocks + root) and parameters per block / root;
- sharded MiB: sum of ``p.to_local()`` bytes on rank 0 (meta tensors have real shapes);
- AG buf MiB: the largest group's unsharded bytes, padded to W equal shards: the
  all-gather output, i.e. the transient buffer a forward or backward needs;
- collectives per step: all-gathers = 2 per group resharded after forward + 1 for the
  root; reduce-scatters = one per group;
- wire MiB: per-rank ring traffic per step, (W-1)/W * (3 * block bytes + 2 * root bytes);
- pred GiB: per-rank memory for fp32 AdamW training without activations =
  sharded params + sharded grads + 2 sharded optimizer states (exp_avg, exp_avg_sq)
  + 2 x the largest all-gather buffer (the current group and the prefetched next one);
- pred+root: the same with the root's unsharded parameters counted for the whole step
  (the root is not resharded after forward) plus 2 x the largest *block* buffer; closer
  to the real peak when the root (embeddings + output) is the largest group.

``--step`` replaces the prediction by a measurement, for both FSDPs in one run: the
model is sharded on ``meta``, materialized under ``FakeTensorMode`` (shapes and dtypes,
no memory, no arithmetic) and trained for two fp32 AdamW steps on ``--seq-len`` tokens,
one sequence, on the fake process group (both FSDPs issue ``reduce_scatter_tensor``
there). ``MemTracker`` counts the live tensor bytes of rank 0 from before the params
are materialized; the peak is step 2's (its first optimizer step over-counts under fake
tensors), restarted at the step's start: params, grads, optimizer states, activations,
all-gather and reduce-scatter buffers, as each FSDP allocates them.
"""

import argparse
import math
import sys
import time

import torch
import torch.distributed as dist
from common.tensor_memory import restart_step, total_bytes
from common.workload import group_params, shard_blocks_then_root
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtensor_fsdp.models.llama import PRESETS, Llama, cross_entropy_loss

GiB, MiB = 2**30, 2**20


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impl", choices=("ours", "torch"), default="ours")
    parser.add_argument("--models", default="llama_7b,llama_70b")
    parser.add_argument("--world-sizes", default="8,64,1024")
    parser.add_argument(
        "--step", action="store_true", help="measure a fake-tensor training step, both FSDPs"
    )
    parser.add_argument("--seq-len", type=int, default=256, help="--step: tokens per step")
    args = parser.parse_args()
    args.models = args.models.split(",")
    args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    if any(name not in PRESETS for name in args.models):
        parser.error(f"--models must be among {sorted(PRESETS)}")
    if any(w < 1 for w in args.world_sizes):
        parser.error("--world-sizes must be positive")
    return args


def fully_shard_fn(impl: str):
    if impl == "torch":
        from torch.distributed.fsdp import fully_shard
    else:
        from dtensor_fsdp import fully_shard
    return fully_shard


def chunk_shapes(shape: torch.Size, world: int) -> list[torch.Size]:
    """Every rank's dim-0 chunk shape under torch.chunk; ranks past the last chunk get 0 rows."""
    chunks = [c.shape for c in torch.empty(shape, device="meta").chunk(world, dim=0)]
    return chunks + [torch.Size((0, *shape[1:]))] * (world - len(chunks))


def padded_unsharded_bytes(params: list[nn.Parameter], world: int) -> int:
    """All-gather output of one group: W shards, each padded to ceil(dim0 / W) rows."""
    per_rank = sum(math.ceil(p.shape[0] / world) * p[0].numel() * p.element_size() for p in params)
    return world * per_rank


def shard_model(model_name: str, world: int, rank: int, impl: str) -> tuple[Llama, dict]:
    """Build on meta, record the original shapes, shard blocks then root; rank ``rank``."""
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = Llama(PRESETS[model_name]())
    global_shapes = {name: p.shape for name, p in model.named_parameters()}
    groups = group_params(model)  # each block's, then the root's
    info = {
        "block_params": sum(p.numel() for p in groups[0]),
        "root_params": sum(p.numel() for p in groups[-1]),
        "n_blocks": len(groups) - 1,
        "block_bytes": sum(p.numel() * p.element_size() for g in groups[:-1] for p in g),
        "root_bytes": sum(p.numel() * p.element_size() for p in groups[-1]),
        "ag_buffer_bytes": max(padded_unsharded_bytes(g, world) for g in groups),
        "block_buffer_bytes": max(padded_unsharded_bytes(g, world) for g in groups[:-1]),
        "root_buffer_bytes": padded_unsharded_bytes(groups[-1], world),
        "global_shapes": global_shapes,
    }
    shard_blocks_then_root(model, fully_shard_fn(impl), mesh=mesh)
    return model, info


def check_and_measure(model: Llama, info: dict, world: int, rank: int) -> int:
    """Assert the sharding invariants; return this rank's sharded bytes."""
    sharded_bytes = 0
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"{name} is not a DTensor"
        global_shape = info["global_shapes"][name]
        assert param.shape == global_shape, f"{name}: global {param.shape} != {global_shape}"
        expected = chunk_shapes(global_shape, world)
        assert sum(s.numel() for s in expected) == global_shape.numel(), name
        local = param.to_local()
        assert local.shape == expected[rank], (
            f"{name} on rank {rank}/{world}: local {tuple(local.shape)} != "
            f"torch.chunk {tuple(expected[rank])}"
        )
        sharded_bytes += local.numel() * local.element_size()
    return sharded_bytes


def simulate(model_name: str, world: int, impl: str) -> dict:
    """One (model, W): shard as rank 0 and as the last rank, check both, predict memory."""
    sharded = {}
    for rank in sorted({0, world - 1}):
        model, info = shard_model(model_name, world, rank, impl)
        sharded[rank] = check_and_measure(model, info, world, rank)
        del model
        dist.destroy_process_group()
    total_bytes = info["block_bytes"] + info["root_bytes"]
    if world == 1:
        assert sharded[0] == total_bytes
    # Rank 0 holds ceil-sized chunks of every parameter: at least 1/W of the model.
    assert sharded[0] * world >= total_bytes, (sharded[0], world, total_bytes)
    n_groups = info["n_blocks"] + 1
    factor = (world - 1) / world
    predicted = 4 * sharded[0] + 2 * info["ag_buffer_bytes"]
    # The root is not resharded after forward: its unsharded params stay from its
    # forward to its backward, while blocks are gathered one (plus one prefetched) at a time.
    predicted_root_kept = (
        4 * sharded[0] + info["root_buffer_bytes"] + 2 * info["block_buffer_bytes"]
    )
    return {
        "model": model_name,
        "world": world,
        "groups": n_groups,
        "block_params": info["block_params"],
        "root_params": info["root_params"],
        "total_params": total_bytes // 4,
        "sharded_bytes_rank0": sharded[0],
        "sharded_bytes_last": sharded[world - 1],
        "ag_buffer_bytes": info["ag_buffer_bytes"],
        "all_gathers": 2 * info["n_blocks"] + 1,
        "reduce_scatters": n_groups,
        "wire_bytes": factor * (3 * info["block_bytes"] + 2 * info["root_bytes"]),
        "predicted_bytes": predicted,
        "predicted_root_kept_bytes": predicted_root_kept,
    }


def step_peak(model_name: str, world: int, impl: str, seq_len: int) -> tuple[int, int]:
    """(live bytes at step 2's start, step 2's peak) of rank 0 on fake tensors."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        fully_shard = fully_shard_fn(impl)
        with FakeTensorMode(allow_non_fake_inputs=True):
            with torch.device("meta"):
                model = Llama(PRESETS[model_name]())
            shard_blocks_then_root(model, fully_shard, mesh=mesh)
            with MemTracker() as tracker:
                model.to_empty(device="cpu")
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                tokens = torch.randint(0, model.config.vocab_size, (1, seq_len + 1))  # (1, T+1)
                for step in range(2):
                    restart_step(tracker)
                    at_start = total_bytes(tracker.get_tracker_snapshot("current"))
                    logits = model(tokens[:, :-1])  # (1, T, vocab_size)
                    cross_entropy_loss(logits, tokens[:, 1:]).backward()
                    del logits
                    optimizer.step()
                    optimizer.zero_grad()
                    print(f"  {model_name} W={world} {impl}: step {step + 1} done", file=sys.stderr)
                peak = total_bytes(tracker.get_tracker_snapshot("peak"))
        return at_start, peak
    finally:
        dist.destroy_process_group()


def print_step_table(models: list[str], worlds: list[int], seq_len: int) -> None:
    """Each (model, W): torch's step, then ours' (one process, so the same machine state)."""
    print(f"fake-tensor step 2 | fp32 | AdamW | 1 x {seq_len} tokens | rank 0 | MemTracker")
    header = (
        f"{'model':<10} {'W':>5} {'torch live GiB':>15} {'torch peak GiB':>15} "
        f"{'ours live GiB':>14} {'ours peak GiB':>14} {'peak ours/torch':>16}"
    )
    print(header + "\n" + "-" * len(header))
    for model_name in models:
        for world in worlds:
            theirs = step_peak(model_name, world, "torch", seq_len)
            ours = step_peak(model_name, world, "ours", seq_len)
            print(
                f"{model_name:<10} {world:>5} {theirs[0] / GiB:>15.3f} {theirs[1] / GiB:>15.3f} "
                f"{ours[0] / GiB:>14.3f} {ours[1] / GiB:>14.3f} {ours[1] / theirs[1]:>16.4f}",
                flush=True,
            )


def print_table(rows: list[dict], impl: str) -> None:
    print(f"fully_shard impl: {impl} | fp32 | AdamW | blocks + root (root not resharded)")
    header = (
        f"{'model':<10} {'W':>5} {'groups':>6} {'params/block':>13} {'params/root':>12} "
        f"{'sharded MiB':>12} {'(last rank)':>11} {'AG buf MiB':>11} {'AG/step':>8} "
        f"{'RS/step':>8} {'wire GiB':>9} {'pred GiB':>9} {'pred+root':>9}"
    )
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['model']:<10} {r['world']:>5} {r['groups']:>6} {r['block_params']:>13,} "
            f"{r['root_params']:>12,} {r['sharded_bytes_rank0'] / MiB:>12.1f} "
            f"{r['sharded_bytes_last'] / MiB:>11.1f} {r['ag_buffer_bytes'] / MiB:>11.1f} "
            f"{r['all_gathers']:>8} {r['reduce_scatters']:>8} {r['wire_bytes'] / GiB:>9.2f} "
            f"{r['predicted_bytes'] / GiB:>9.2f} {r['predicted_root_kept_bytes'] / GiB:>9.2f}"
        )
    print(
        "pred GiB = 4 x sharded (params, grads, exp_avg, exp_avg_sq) + 2 x AG buf "
        "(current + prefetched group); activations excluded\n"
        "pred+root = 4 x sharded + root's unsharded params (kept from forward to backward) "
        "+ 2 x largest block's AG buf"
    )


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    if args.step:
        print_step_table(args.models, args.world_sizes, args.seq_len)
        print(f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
        return
    rows = [simulate(m, w, args.impl) for m in args.models for w in args.world_sizes]
    print_table(rows, args.impl)
    print(f"all invariants hold | {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
