"""A rank that diverges or dies inside a compiled graph-mode step, under ``torchrun``,
for ``test_graph_watchdog.py``. dtensor_fsdp's defaults (the collective watchdog on,
gloo's default timeout) but the watchdog's deadline, ``--deadline`` (60 s by default, as
the library's); graph mode with the ``aot_eager`` backend.

The model is ``tests/observe/_divergence_job.py``'s (blocks of different sizes, each
and the root sharded). One agreeing step, then on rank 1:

- ``skip_block``: its forward skips block 1 (its compiled graph gathers block 2 where
  rank 0's gathers block 1: gloo kills the rank that receives more than it expects);
- ``dies``: it exits before its second step, while rank 0 runs it.

Each rank writes what it raised (type, message) and the seconds from the start of the
second step to ``--out``.rank{r}.json.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import dtensor_fsdp
from tests.observe._divergence_job import DIM, build


def run(scenario: str, rank: int, deadline_s: float) -> dict:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build("ours_graph", [24, 32, 40], mesh)
    model.set_collective_watchdog(deadline=deadline_s)
    dtensor_fsdp.compile(model, backend="aot_eager")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0.0
    try:
        for step in range(2):
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step * 10 + rank))
            kwargs = {}
            if step == 1:
                dist.barrier()
                start = time.time()
                if rank == 1 and scenario == "dies":
                    os._exit(1)
                if rank == 1 and scenario == "skip_block":
                    kwargs["skip"] = 1
            model(x, **kwargs).backward()
            optimizer.step()
            optimizer.zero_grad()
    except Exception as error:  # noqa: BLE001 (the verdict is what each rank raised)
        return {"error": type(error).__name__, "message": str(error), "seconds": time.time() - start}
    return {"error": None, "seconds": time.time() - start}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--scenario", choices=("skip_block", "dies"), required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--deadline", type=float, default=60.0, help="the watchdog's, s")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = run(args.scenario, rank, args.deadline)
    with open(f"{args.out}.rank{rank}.json", "w") as file:
        json.dump(result, file)
    print(f"rank {rank} {args.scenario}: {result}", flush=True)
    os._exit(0)  # collectives may stay pending: destroying the group would wait on them


if __name__ == "__main__":
    main()
