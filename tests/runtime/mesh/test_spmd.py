"""dp_mesh_dims: parameters already DTensors on a full (dp, tp) SPMD mesh.

The MLP is distributed on the whole mesh (Replicate on both axes), ``fully_shard``
shards it over the "dp" axis named by ``DataParallelMeshDims``, and inputs are DTensors
sharded on the batch over "dp". Training must match one process on the global batch,
and the collectives must run over the 2 "dp" ranks only.
"""

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

from dtensor_fsdp import CommTrace, DataParallelMeshDims, fully_shard
from tests._harness import run_distributed
from tests._pool import GlooPools

STEPS = 3


def _run(rank: int, world_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 13), nn.ReLU(), nn.Linear(13, 6), nn.ReLU(), nn.Linear(6, 5))
    reference = copy.deepcopy(model)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    distribute_module(model, mesh)  # every parameter Replicate() on both axes
    dims = DataParallelMeshDims(shard="dp")
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh, dp_mesh_dims=dims)
    trace = CommTrace()
    model.set_comm_trace(trace)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    dp = mesh.get_local_rank("dp")
    max_diff = 0.0
    for step in range(STEPS):
        torch.manual_seed(100 + step)
        batch = torch.randn(8, 8)
        local = DTensor.from_local(batch[dp * 4 : (dp + 1) * 4], mesh, [Shard(0), Replicate()])
        model(local).to_local().pow(2).mean().backward()
        reference(batch).pow(2).mean().backward()
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
        for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
            max_diff = max(max_diff, (param.full_tensor() - ref).abs().max().item())
    return {
        "max_diff": max_diff,
        "placements": {n: tuple(p.placements) for n, p in model.named_parameters()},
        "local_shapes": {n: tuple(p.to_local().shape) for n, p in model.named_parameters()},
        "group_sizes": sorted({(e.kind, e.group_size) for e in trace.events}),
    }


@pytest.fixture(scope="module")
def records(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, 4, pool=gloo_pool)


def test_training_matches_the_single_process_reference(records: list[dict[str, Any]]) -> None:
    assert all(record["max_diff"] < 1e-6 for record in records), [r["max_diff"] for r in records]


def test_parameters_shard_over_the_named_axis_only(records: list[dict[str, Any]]) -> None:
    for record in records:
        assert set(record["placements"].values()) == {(Shard(0), Replicate())}
        # 13 rows over the 2 "dp" ranks: 7 and 6, whatever the "tp" coordinate.
        assert record["local_shapes"]["0.weight"] in ((7, 8), (6, 8))
        assert record["group_sizes"] == [("all_gather", 2), ("reduce_scatter", 2)]
