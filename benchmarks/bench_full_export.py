"""What a full safetensors export holds in memory on rank 0: ours vs torch's route.

    MALLOC_MMAP_THRESHOLD_=1048576 torchrun --nproc-per-node 2 benchmarks/bench_full_export.py

A stack of ``--n-layers`` bias-free ``Linear(dim, dim)`` layers (fp32), one
``fully_shard`` group per layer and one at the root, so the full model is
``n_layers`` times its largest tensor. Modes, each exporting the same model to
``--out``:

- ``ours``: ``save_full_state_dict(model, path)`` on our ``fully_shard``;
- ``torch``: torch's ``fully_shard``, ``get_model_state_dict(full_state_dict=True,
  cpu_offload=True)`` and ``safetensors.torch.save_file`` on rank 0 (torch has no
  streamed export: this is its route to one file).

Columns, in MiB, the peaks on rank 0 above where the export started: ``rss``, the
resident set (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; Linux
only); ``python``, Python objects alone (``tracemalloc``: e.g. a ``bytes`` copy of a
tensor). ``s``: the export's wall time. ``MALLOC_MMAP_THRESHOLD_`` makes glibc map every
block of 1 MiB or more on its own and unmap it when freed, so the resident set follows
the live tensors; without it glibc keeps freed blocks for reuse and the figures drift
with what ran before. (The profiler's memory events are no measure here: they count
the file that ``safetensors.safe_open`` maps, at its full size, as an allocation.)
"""

import argparse
import json
import os
import shutil
import tempfile

import safetensors.torch
import torch.distributed as dist
from common.rss import MIB, linear_stack, measure
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard, save_full_state_dict


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layers", type=int, default=32)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument(
        "--out", default=None, help="directory to keep the files in (default: a temp dir, removed)"
    )
    return parser.parse_args()


def _torch_export(model: nn.Module, path: str) -> None:
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        safetensors.torch.save_file(full, path, metadata={"format": "pt"})
    dist.barrier()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    out = [(args.out or tempfile.mkdtemp()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(out)  # rank 0's temp dir, for every rank
    largest = args.dim * args.dim * 4 / MIB
    rows = {}
    for mode, shard, export in (
        ("ours", fully_shard, save_full_state_dict),
        ("torch", torch_fully_shard, _torch_export),
    ):
        model = linear_stack(args.n_layers, args.dim, shard)
        path = os.path.join(out[0], f"{mode}.safetensors")
        rows[mode] = measure(lambda model=model, path=path: export(model, path))
        del model
    if dist.get_rank() == 0:
        print(
            f"model {args.n_layers * largest:.0f} MiB, largest tensor {largest:.0f} MiB, "
            f"W={dist.get_world_size()}; peaks on rank 0 above the start, MiB"
        )
        print(f"{'mode':<6} {'rss':>8} {'python':>8} {'s':>6}")
        for mode, row in rows.items():
            print(f"{mode:<6} {row['rss']:>8.1f} {row['python']:>8.1f} {row['s']:>6.2f}")
        results = {"model_mib": args.n_layers * largest, "largest_mib": largest, **rows}
        print("BENCH_JSON " + json.dumps(results), flush=True)
    dist.barrier()
    if dist.get_rank() == 0 and args.out is None:
        shutil.rmtree(out[0])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
