"""Train a small Llama with dtensor_fsdp on synthetic data.

Launch with torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE:

    torchrun --nproc-per-node 2 train.py                 # CPU + gloo
    torchrun --nproc-per-node 8 train.py --device cuda   # one GPU per rank + NCCL

Every transformer block is its own ``fully_shard`` unit and the root holds the
embeddings, final norm and output projection, as in torchtitan.

Data: a deterministic stream of noisy arithmetic sequences (see
``synthetic_batch``). Every rank draws the same global batch of
``batch_size * world_size`` rows and keeps the contiguous block of rows
``[rank * batch_size, (rank + 1) * batch_size)``, so a single process training
on the whole global batch sees exactly the same data.
"""

import argparse
import dataclasses
import gc
import os
import resource
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard
from dtensor_fsdp.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    cross_entropy_loss,
    swiglu_hidden_dim,
)

# Chance that a token is replaced by a uniform random one; it sets the loss floor
# and keeps the task from being solved exactly in a handful of steps.
NOISE_PROB = 0.1
MAX_STRIDE = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dim", type=int, help="override the preset (ffn width follows)")
    parser.add_argument("--n-layers", type=int, help="override the preset")
    parser.add_argument("--n-heads", type=int, help="override the preset")
    parser.add_argument("--n-kv-heads", type=int, help="override the preset")
    parser.add_argument("--vocab-size", type=int, help="override the preset")
    parser.add_argument("--seq-len", type=int, help="training length (sets max_seq_len)")
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping threshold")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default="true")
    return parser.parse_args()


def build_config(args: argparse.Namespace) -> LlamaConfig:
    """The preset named by --model with any shape flags applied on top."""
    config = PRESETS[args.model]()
    overrides = {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "max_seq_len": args.seq_len,
    }
    overrides = {name: value for name, value in overrides.items() if value is not None}
    if args.dim is not None:
        overrides["ffn_hidden_dim"] = swiglu_hidden_dim(args.dim)
    if args.tie_embeddings:
        overrides["tie_embeddings"] = True
    return dataclasses.replace(config, **overrides)


def init_distributed(device_arg: str) -> tuple[torch.device, DeviceMesh]:
    """Join torchrun's process group (NCCL on CUDA, gloo on CPU) and build a 1-D mesh."""
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    return device, mesh


def build_model(config: LlamaConfig, mesh: DeviceMesh, device: torch.device,
                seed: int, reshard_after_forward: bool) -> Llama:
    """Build identically on every rank (same seed), then shard each block and the root."""
    torch.manual_seed(seed)
    with device:
        model = Llama(config)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def synthetic_batch(
    generator: torch.Generator, rows: int, seq_len: int, vocab_size: int
) -> torch.Tensor:
    """(rows, seq_len + 1) tokens: x[t] = (start + stride * t) mod vocab, with noise.

    Start and stride are drawn per row, so the model must infer the stride from
    context: learnable (the loss drops fast), but not by memorizing one sequence.
    """
    start = torch.randint(vocab_size, (rows, 1), generator=generator)
    stride = torch.randint(1, MAX_STRIDE + 1, (rows, 1), generator=generator)
    positions = torch.arange(seq_len + 1)  # (seq_len + 1,)
    tokens = (start + stride * positions) % vocab_size  # (rows, seq_len + 1)
    noise = torch.randint(vocab_size, tokens.shape, generator=generator)
    is_noisy = torch.rand(tokens.shape, generator=generator) < NOISE_PROB
    return torch.where(is_noisy, noise, tokens)


def local_rows(global_batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous block of rows; (global_rows / world_size, seq_len + 1)."""
    return global_batch.chunk(world_size)[rank]


def train_step(model: Llama, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               max_norm: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward/backward/step on this rank's tokens; returns (local loss, grad norm)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # each (B, T)
    loss = cross_entropy_loss(model(inputs), targets)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    # The norm of DTensor grads is a DTensor; full_tensor() makes it a plain value.
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    return loss.detach(), grad_norm


def mean_over_ranks(value: torch.Tensor) -> float:
    """Average a scalar over ranks; SUM then divide, since gloo has no AVG."""
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / dist.get_world_size()


def peak_memory_mib(device: torch.device) -> float:
    """This rank's peak allocated CUDA memory, or its peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def train(args: argparse.Namespace, device: torch.device, mesh: DeviceMesh) -> None:
    config = build_config(args)
    seq_len = config.max_seq_len
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = build_model(config, mesh, device, args.seed, args.reshard_after_forward == "true")
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
    generator = torch.Generator().manual_seed(args.seed)
    global_rows = args.batch_size * world_size
    tokens_per_step = global_rows * seq_len
    if rank == 0:
        n_params = sum(p.numel() for p in model.parameters())
        print(f"{config}\nparams {n_params:,} | world {world_size} | device {device} | "
              f"global batch {global_rows} x {seq_len} tokens", flush=True)

    throughputs, loss = [], float("nan")
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        global_batch = synthetic_batch(generator, global_rows, seq_len, config.vocab_size)
        tokens = local_rows(global_batch, rank, world_size).to(device)
        local_loss, grad_norm = train_step(model, optimizer, tokens, args.max_norm)
        loss = mean_over_ranks(local_loss)  # .item() also waits for the device
        throughputs.append(tokens_per_step / (time.perf_counter() - start))
        if rank == 0:
            print(f"step {step:4d} | loss {loss:.4f} | grad_norm {grad_norm.item():.3f} | "
                  f"tok/s {throughputs[-1]:,.0f} | peak_mem {peak_memory_mib(device):,.0f} MiB",
                  flush=True)

    if rank == 0:
        # Step 1 pays for lazy init and allocator warm-up, so it is left out.
        steady = throughputs[1:] or throughputs
        print(f"done | steps {args.steps} | final loss {loss:.4f} | "
              f"mean tok/s {sum(steady) / len(steady):,.0f} (excl. step 1) | "
              f"peak_mem {peak_memory_mib(device):,.0f} MiB", flush=True)


def main() -> None:
    args = parse_args()
    device, mesh = init_distributed(args.device)
    try:
        train(args, device, mesh)
    finally:
        # A DeviceMesh holds its ProcessGroup (DeviceMesh._pg_registry), and FSDP's
        # module <-> state reference cycles keep the mesh alive until the cyclic GC
        # runs. If that is at interpreter shutdown, gloo's teardown aborts ("terminate
        # called without an active exception"), so collect now, then destroy explicitly.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
