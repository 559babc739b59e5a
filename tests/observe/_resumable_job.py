"""A minimal resumable trainer for ``test_faults.py``, run under ``torchrun``.

It trains a small Llama with ``fully_shard`` and AdamW, checkpoints with
``dtensor_fsdp.checkpoint`` every ``--ckpt-every`` steps and, at start, resumes from the
latest complete checkpoint in ``--dir``. Each rank draws its rows from its own
generator, which persists across steps: its state is per-rank (``rank_extra``), so a
resume that failed to restore it would change the losses. Rank 0 writes the losses of
the steps this attempt ran, the step it resumed from and a checksum of the final
parameters to ``--out``.

Faults, injected on the first attempt only (``TORCHELASTIC_RESTART_COUNT`` is 0):

- ``--raise-at-step S``: rank 1 raises in the middle of step S (after its forward).
- ``--exit-after-checkpoint K``: rank 1 ``os._exit(1)``s right after step K's checkpoint.
- ``--die-mid-save K``: at step K every rank writes DCP's files into the staging
  directory ``step_K.tmp`` (exactly what ``save_checkpoint`` does first), then rank 1
  dies before the barrier that precedes the ``COMPLETE`` marker, as a kill in the
  middle of ``save_checkpoint`` would.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import init_device_mesh

from dtensor_fsdp import fully_shard
from dtensor_fsdp.checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)
ROWS_PER_RANK = 2


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", required=True, help="checkpoint directory")
    parser.add_argument("--out", required=True, help="rank 0 writes its results here (JSON)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--ckpt-every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raise-at-step", type=int)
    parser.add_argument("--exit-after-checkpoint", type=int)
    parser.add_argument("--die-mid-save", type=int)
    return parser.parse_args()


def rank_generator(seed: int, rank: int) -> torch.Generator:
    """This rank's data generator at step 0. A resume on another world size re-derives
    it from here (the global data position is the step, so nothing else is needed)."""
    return torch.Generator().manual_seed(seed * 1000 + rank)


def is_first_attempt() -> bool:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0


def die_mid_save(args: argparse.Namespace, step: int, model: Llama, optimizer) -> None:
    """Write DCP's files into the staging directory, then die without a marker."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    staging = checkpoint_path(args.dir, step) + ".tmp"
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=staging)
    if dist.get_rank() == 1:
        os._exit(1)
    dist.barrier()  # rank 0 waits here, as in save_checkpoint, until torchrun stops it


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model = Llama(CONFIG)
    for block in model.layers:
        fully_shard(block, mesh=init_device_mesh("cpu", (world_size,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    generator = rank_generator(args.seed, rank)
    start, resumed_from = 0, None
    latest = latest_checkpoint(args.dir)
    if latest is not None:
        loaded = load_checkpoint(latest, model, optimizer)
        start, resumed_from = loaded.extra["data_position"], latest
        torch.set_rng_state(loaded.extra["torch_rng"])
        if loaded.rank_extra is not None:
            generator.set_state(loaded.rank_extra["generator"])
        else:  # another world size: replay this rank's draws up to the data position
            for _ in range(start):
                draw(generator)
        print(f"rank {rank}: resumed from {latest} at step {start}", flush=True)
    losses = []
    for step in range(start, args.steps):
        tokens = draw(generator)
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        if args.raise_at_step == step and rank == 1 and is_first_attempt():
            raise RuntimeError(f"injected failure on rank 1 at step {step}")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
        done = step + 1
        if args.die_mid_save == done and is_first_attempt():
            die_mid_save(args, done, model, optimizer)
        if done % args.ckpt_every == 0:
            save_checkpoint(
                args.dir,
                done,
                model,
                optimizer,
                extra={"data_position": done, "torch_rng": torch.get_rng_state()},
                rank_extra={"generator": generator.get_state()},
            )
            if args.exit_after_checkpoint == done and rank == 1 and is_first_attempt():
                os._exit(1)
    checksum = [p.full_tensor().double().sum().item() for p in model.parameters()]
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "start": start,
                    "resumed_from": resumed_from,
                    "checksum": checksum,
                },
                f,
            )
    dist.destroy_process_group()


def draw(generator: torch.Generator) -> torch.Tensor:
    """This rank's rows for one step: (ROWS_PER_RANK, T + 1) tokens."""
    return torch.randint(
        0, CONFIG.vocab_size, (ROWS_PER_RANK, CONFIG.max_seq_len + 1), generator=generator
    )


if __name__ == "__main__":
    main()
