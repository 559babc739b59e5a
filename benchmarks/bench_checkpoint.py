"""What checkpoint verification costs: ``dtensor_fsdp.checkpoint`` against plain DCP.

    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py            # "small" Llama
    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py --n-layers 16 --repeats 5

Model and AdamW state (after one step) of the main job's Llama, sharded on every rank.
Timed, each the median of ``--repeats`` runs on the slowest rank, into a fresh directory
under ``--dir``:

- ``dcp.save`` / ``dcp.load`` of ``get_state_dict``'s state dicts: torch's DCP alone;
- ``save_checkpoint`` / ``load_checkpoint``: the same plus staging, agreement between
  ranks, CRC32 of every file (each rank a share) recorded in and verified against the
  COMPLETE marker, restricted unpickling, and a staged (all-or-nothing) load;
- the CRC32 pass alone over the checkpoint's files, as seconds per GB.

Reported per GB of checkpoint on disk, and as ratios to plain DCP.
"""

import argparse
import dataclasses
import gc
import json
import os
import shutil
import statistics
import tempfile
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common.dist import slowest_seconds
from common.workload import shard_blocks_then_root
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh

from dtensor_fsdp import fully_shard
from dtensor_fsdp.checkpoint import load_checkpoint, save_checkpoint
from dtensor_fsdp.models.llama import PRESETS, Llama, cross_entropy_loss

GB = 1e9


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="small")
    parser.add_argument("--n-layers", type=int, help="override the preset")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where checkpoints go")
    return parser.parse_args()


def build(args: argparse.Namespace) -> tuple[Llama, torch.optim.Optimizer]:
    config = PRESETS[args.model]()
    if args.n_layers is not None:
        config = dataclasses.replace(config, n_layers=args.n_layers)
    torch.manual_seed(0)
    model = Llama(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard_blocks_then_root(model, fully_shard, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()  # AdamW state exists
    optimizer.zero_grad()
    return model, optimizer


def directory_bytes(path: str) -> int:
    return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())


def crc_seconds(path: str) -> float:
    """One full CRC32 pass over every file, on this rank (the slowest rank's time)."""

    def run() -> None:
        for entry in os.scandir(path):
            with open(entry.path, "rb") as f:
                crc = 0
                while chunk := f.read(1 << 22):
                    crc = zlib.crc32(chunk, crc)

    return slowest_seconds(run)


def measure(
    model: Llama, optimizer: torch.optim.Optimizer, root: str, repeats: int
) -> tuple[dict[str, float], float, int]:
    """Median seconds per operation, median CRC32 seconds, checkpoint bytes."""
    times: dict[str, list[float]] = {
        "dcp_save": [],
        "ours_save": [],
        "dcp_load": [],
        "ours_load": [],
    }
    crc: list[float] = []
    size = 0
    for repeat in range(repeats):
        plain = os.path.join(root, f"plain_{repeat}")
        ours = os.path.join(root, f"ours_{repeat}")

        def dcp_save(plain: str = plain) -> None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=plain)

        def dcp_load(plain: str = plain) -> None:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, checkpoint_id=plain)
            set_state_dict(
                model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
            )

        saved: list[str] = []
        times["dcp_save"].append(slowest_seconds(dcp_save))
        times["ours_save"].append(
            slowest_seconds(
                lambda: saved.append(save_checkpoint(ours, 1, model, optimizer, {"step": 1}))  # noqa: B023
            )
        )
        times["dcp_load"].append(slowest_seconds(dcp_load))
        times["ours_load"].append(
            slowest_seconds(lambda: load_checkpoint(saved[0], model, optimizer))  # noqa: B023
        )
        size = directory_bytes(saved[0])
        crc.append(crc_seconds(saved[0]))
    return {k: statistics.median(v) for k, v in times.items()}, statistics.median(crc), size


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    holder = [tempfile.mkdtemp(dir=args.dir) if rank == 0 else None]
    dist.broadcast_object_list(holder)
    root = holder[0]
    try:
        model, optimizer = build(args)
        med, crc, size = measure(model, optimizer, root, args.repeats)
        if rank == 0:
            gb = size / GB
            results = {
                "checkpoint_gb": gb,
                "params": sum(p.numel() for p in model.parameters()),
                "seconds": med,
                "seconds_per_gb": {k: v / gb for k, v in med.items()},
                "save_ratio_to_dcp": med["ours_save"] / med["dcp_save"],
                "load_ratio_to_dcp": med["ours_load"] / med["dcp_load"],
                "crc32_seconds_per_gb_one_rank": crc / gb,
            }
            print(f"checkpoint: {gb * 1e3:.1f} MB on disk, {dist.get_world_size()} ranks")
            for name, seconds in med.items():
                print(f"{name:<10} {seconds * 1e3:9.1f} ms   {seconds / gb:7.2f} s/GB")
            print(
                f"save ours/dcp {results['save_ratio_to_dcp']:.2f}   "
                f"load ours/dcp {results['load_ratio_to_dcp']:.2f}"
            )
            print(f"CRC32 of every file on one rank: {crc / gb:.2f} s/GB")
            print("BENCH_JSON " + json.dumps(results), flush=True)
        del model, optimizer
    finally:
        gc.collect()
        dist.barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
