"""Ranks whose control flow diverges, under ``torchrun``, for ``test_divergence.py``.

``--impl ours`` trains with ``dtensor_fsdp.fully_shard`` and its divergence check and
non-finite gradient guard on (``--impl ours_unchecked``: both off, the default);
``--impl ours_default``: the defaults but a short collective watchdog deadline
(``--deadline``); ``--impl torch`` with torch's ``fully_shard``, which has none. Each scenario builds a fresh model (blocks of two Linears, each block and the
root sharded), trains one agreeing step, then diverges on rank 1:

- ``skip_block``: rank 1 skips block 1 in forward (blocks of different sizes);
- ``skip_same_size``: the same, but blocks 1 and 2 have the same size, so the
  all-gathers match in size and the wrong weights would be exchanged silently;
- ``unused_param``: rank 1 leaves block 1's second Linear unused, so its reduce-scatter
  is smaller; ``unused_param_fixed`` does the same with
  ``set_reduce_scatter_unused_params(True)`` and must train;
- ``nan``: rank 1 feeds a NaN input; the gradient guard must name it;
- ``stalls``: rank 1 stops issuing FSDP collectives (it sleeps); the others wait in the
  check until its timeout;
- ``straggler``: rank 1 sleeps past the watchdog's deadline before the step, then
  trains on: the others must warn, and the step completes.

A scenario after which collectives stay pending (a hang the watchdog ended) must come
last: the process group cannot be used again, and the job exits without destroying it.

Each rank writes, per scenario, the exception it raised (type, message), the seconds
from the start of the diverging step to the exception and the warnings it issued, to
``--out``.rank{r}.json.
"""

import argparse
import json
import os
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

DIM = 16
STALL_S = 6.0  # how long the stalling rank sleeps; the check's timeout is shorter
# The check's timeout in the diverging step, which starts at a barrier. The agreeing
# step before it runs with the process group's (20 s): its ranks are apart by however
# long each took to build and lazily initialize, seconds on a loaded machine.
CHECK_TIMEOUT_S = 3.0
DEADLINE_S = 1.0  # the collective watchdog's, for ``--impl ours_default``
STRAGGLE_S = 2.5  # longer than the deadline: the others warn, then go on


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, hidden)
        self.down = nn.Linear(hidden, DIM)
        self.gate = nn.Linear(DIM, DIM)  # the one left unused by ``unused_param``

    def forward(self, x: torch.Tensor, use_gate: bool) -> torch.Tensor:
        h = x + self.down(torch.relu(self.up(x)))
        return h * torch.sigmoid(self.gate(x)) if use_gate else h


class Net(nn.Module):
    def __init__(self, hiddens: list[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(h) for h in hiddens)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor, skip: int | None = None, unused: int | None = None):
        for index, block in enumerate(self.blocks):
            if index != skip:
                x = block(x, use_gate=index != unused)
        return self.head(x).sum()


def build(impl: str, hiddens: list[int], mesh) -> Net:
    if impl.startswith("ours"):
        from dtensor_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = Net(hiddens)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if impl == "ours":
        model.set_divergence_check(True)
        model.set_nonfinite_grad_check(True)
    if impl == "ours_default":
        model.set_collective_watchdog(deadline=DEADLINE_S)
    return model


def run(impl: str, scenario: str, mesh, rank: int) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _run(impl, scenario, mesh, rank)
    result["warnings"] = [str(w.message) for w in caught if "FSDP" in str(w.message)]
    return result


def _run(impl: str, scenario: str, mesh, rank: int) -> dict:
    hiddens = [24, 32, 32] if scenario == "skip_same_size" else [24, 32, 40]
    model = build(impl, hiddens, mesh)
    if scenario == "unused_param_fixed":
        model.set_reduce_scatter_unused_params(True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    diverging = rank == 1
    losses = []
    start = 0.0
    try:
        for step in range(2):
            x = torch.randn(4, DIM, generator=torch.Generator().manual_seed(step * 10 + rank))
            kwargs = {}
            if step == 1 and diverging:
                if scenario in ("skip_block", "skip_same_size"):
                    kwargs["skip"] = 1
                elif scenario.startswith("unused_param"):
                    kwargs["unused"] = 1
                elif scenario == "nan":
                    x[0, 0] = float("nan")
            if step == 1:
                dist.barrier()
                if impl == "ours":
                    model.set_divergence_check(True, timeout=CHECK_TIMEOUT_S)
                start = time.time()
                if scenario == "stalls" and diverging:
                    time.sleep(STALL_S)
                    return {"error": None, "losses": losses}
                if scenario == "straggler" and diverging:
                    time.sleep(STRAGGLE_S)
            loss = model(x, **kwargs)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    except Exception as error:  # noqa: BLE001 (the verdict is what each rank raised)
        return {
            "error": type(error).__name__,
            "message": str(error),
            "seconds": time.time() - start,
        }
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    finite = all(bool(p.isfinite().all()) for p in params)
    return {"error": None, "losses": losses, "finite": finite}


def read_records(out: str, world_size: int = 2) -> list[dict]:
    """What each rank of a launch wrote to ``out`` (``{}`` for a rank that wrote
    nothing: killed by the backend, or hung), by rank."""
    records = []
    for rank in range(world_size):
        path = f"{out}.rank{rank}.json"
        if os.path.exists(path):
            with open(path) as file:
                records.append(json.load(file))
        else:
            records.append({})
    return records


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--impl", choices=("ours", "ours_unchecked", "ours_default", "torch"), required=True
    )
    parser.add_argument("--scenarios", required=True, help="comma-separated, run in order")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # A hang in a real collective ends at this timeout rather than the default 30 min.
    dist.init_process_group("gloo", timeout=timedelta(seconds=20))
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for scenario in args.scenarios.split(","):
        results[scenario] = run(args.impl, scenario, mesh, rank)
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(results, f)
        print(f"rank {rank} {scenario}: {results[scenario]}", flush=True)
    if args.impl == "ours_default" and results[scenario]["error"] is not None:
        os._exit(0)  # collectives stay pending: destroying the group would wait on them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
