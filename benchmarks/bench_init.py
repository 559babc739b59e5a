"""What meta-device init costs in memory and time: eager vs ``init_unsharded``.

    torchrun --nproc-per-node 2 benchmarks/bench_init.py                 # 3 depths
    torchrun --nproc-per-node 2 benchmarks/bench_init.py --n-layers 8 --dim 1024

The main job's Llama at a few depths, brought to the values of ``init_weights()`` from
one seed on every rank (W=2, gloo, fp32). Each mode has a *prepare* step (the model
before init) and an *init* step:

- ``eager``: the unsharded model built on the CPU; init: ``init_weights()``;
- ``torch_full_sd``: torch's ``fully_shard`` on ``meta`` + ``to_empty``; init: an eager
  model built and its full state dict loaded with ``set_model_state_dict`` (torch has
  no ``init_unsharded``: this is its way to the eager values);
- ours on ``meta`` + ``to_empty``; init: ``init_weights()`` inside ``init_unsharded``:
  ``whole`` (``max_unsharded_bytes=<huge>``: every full parameter at once, as before
  the bound), ``bounded`` (the default: the largest group's full bytes), ``per_param``
  (``max_unsharded_bytes=0``: one parameter at a time); ``*_2pass`` add a GPT-2-style
  second pass over every block (re-touching evicted parameters: all-gathers).

Columns, as fractions of the model's full parameter bytes: ``total``, the peak the CPU
allocator held on rank 0 from before prepare to the end of init (the model included:
an eager model is 1.0, a sharded one 1/W); ``init``, the peak above where the init
step started. Both come from the profiler's memory events, which also see allocations
inside ``__torch_dispatch__`` (MemTracker's dispatch mode does not). ``init s``: the
init step, median of ``--repeats`` on the slowest rank, without the profiler.
``gathers``: re-materializations of evicted parameters.
"""

import argparse
import dataclasses
import gc
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from common.dist import slowest_seconds
from common.workload import shard_blocks_then_root
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile

from dtensor_fsdp import fully_shard, init_unsharded
from dtensor_fsdp.models.llama import Llama, LlamaConfig, swiglu_hidden_dim

MODES = ("eager", "torch_full_sd", "whole", "bounded", "per_param", "whole_2pass", "bounded_2pass")
BUDGETS = {"whole": 1 << 62, "bounded": None, "per_param": 0}
SEED = 1


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5)
    return parser.parse_args()


def config_for(args: argparse.Namespace, n_layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab_size,
        dim=args.dim,
        n_layers=n_layers,
        n_heads=8,
        n_kv_heads=8,
        ffn_hidden_dim=swiglu_hidden_dim(args.dim),
        max_seq_len=128,
    )


def sharded_meta(config: LlamaConfig, mesh: DeviceMesh, shard: Callable) -> Llama:
    with torch.device("meta"):
        model = Llama(config)
    shard_blocks_then_root(model, shard, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def second_pass(model: Llama) -> None:
    """GPT-2's scaled residual projections drawn again after the whole model, and a
    rescale that reads what the first pass wrote: re-touches every block."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("wo.weight", "w2.weight")):
                torch.nn.init.normal_(p, std=0.01)
            elif name.endswith("wq.weight"):
                p.mul_(0.5)


def prepare(mode: str, config: LlamaConfig, mesh: DeviceMesh) -> Llama:
    """The model before the init step: eager (its constructor initializes it once
    already), or sharded on ``meta`` and ``to_empty``-ed."""
    torch.manual_seed(0)
    if mode == "eager":
        return Llama(config)
    return sharded_meta(config, mesh, torch_fully_shard if mode == "torch_full_sd" else fully_shard)


def init(mode: str, model: Llama) -> dict:
    """The init step: bring ``model`` to ``init_weights()``'s values from ``SEED``."""
    torch.manual_seed(SEED)
    if mode == "eager":
        model.init_weights()
        return {}
    if mode == "torch_full_sd":  # an eager model's full state dict, loaded into the shards
        full = Llama(model.config).state_dict()
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))
        return {}
    with init_unsharded(model, max_unsharded_bytes=BUDGETS[mode.removesuffix("_2pass")]) as cache:
        model.init_weights()
        if mode.endswith("_2pass"):
            second_pass(model)
    return {"all_gathers": cache.all_gathers, "materialized_peak_bytes": cache.peak_bytes}


def peak_allocated(fn: Callable[[], Any]) -> tuple[Any, int]:
    """``fn()`` and the peak bytes the CPU allocator held during it above the start."""
    # Collected now, older garbage cannot be freed inside the window (a free of a block
    # allocated before it would count as negative bytes).
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            result = fn()
    finally:
        gc.enable()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        live += event.nbytes()
        peak = max(peak, live)
    return result, peak


def measure_mode(mode: str, config: LlamaConfig, mesh: DeviceMesh, repeats: int) -> dict:
    (model, reported), total = peak_allocated(
        lambda: (m := prepare(mode, config, mesh), init(mode, m))
    )
    del model
    model = prepare(mode, config, mesh)
    _, init_peak = peak_allocated(lambda: init(mode, model))
    seconds = []
    for _ in range(repeats):
        model = prepare(mode, config, mesh)
        seconds.append(slowest_seconds(lambda model=model: init(mode, model)))
    return {
        "total_peak": total,
        "init_peak": init_peak,
        "init_seconds": statistics.median(seconds),
        **reported,
    }


def measure(config: LlamaConfig, mesh: DeviceMesh, repeats: int) -> dict:
    with torch.device("meta"):
        meta = Llama(config)
    full_bytes = sum(p.numel() * p.element_size() for p in meta.parameters())
    groups = [sum(p.numel() * p.element_size() for p in b.parameters()) for b in meta.layers]
    return {
        "config": dataclasses.asdict(config),
        "params": full_bytes // 4,
        "full_bytes": full_bytes,
        "largest_group_fraction": max([full_bytes - sum(groups), *groups]) / full_bytes,
        "modes": {mode: measure_mode(mode, config, mesh, repeats) for mode in MODES},
    }


def report(rows: list[dict], world_size: int) -> None:
    print(f"W={world_size}; peaks on rank 0 as a fraction of the model's full parameter bytes")
    print(
        f"{'layers':>6} {'params':>7} {'group':>6}  {'mode':<14} {'total':>6} {'init':>6} "
        f"{'init s':>7} {'gathers':>8}"
    )
    for row in rows:
        full = row["full_bytes"]
        for mode, v in row["modes"].items():
            print(
                f"{row['config']['n_layers']:>6} {row['params'] / 1e6:>6.1f}M "
                f"{row['largest_group_fraction']:>6.2f}  {mode:<14} {v['total_peak'] / full:>6.2f} "
                f"{v['init_peak'] / full:>6.2f} {v['init_seconds']:>7.2f} {v.get('all_gathers', '-'):>8}"
            )


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)  # two ranks on two cores
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = [measure(config_for(args, n), mesh, args.repeats) for n in args.n_layers]
    if dist.get_rank() == 0:
        report(rows, mesh.size())
        print("BENCH_JSON " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
