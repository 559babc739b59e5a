"""Quantized communication combined with CPU offload, hpZ and ``Shard(dim != 0)``.

Each combination is compared with the same policy without it, in one W=4 spawn:

- CPU offload only moves the shards to the host and back: the encoded bytes are made
  from the same fp32 values, so losses and local grads must be bitwise equal.
- hpZ (``reshard_after_forward=2``) keeps, after forward, 1/2 of the *decoded*
  unsharded weights and re-gathers them exactly for backward; without hpZ backward
  re-encodes the same fp32 shards, and encoding is deterministic, so backward sees the
  same weights: bitwise equal again.
- ``Shard(1)`` puts other elements in each block, so the quantization error differs:
  the loss must stay close to the exact ``Shard(1)`` run (int8: per-element error at
  most absmax/254 of its block; 2% of the loss leaves a wide margin, as in
  test_comm_precision.py).
"""

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from dtensor_fsdp import CommPrecisionPolicy, CPUOffloadPolicy, fully_shard
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

WORLD_SIZE = 4
STEPS = 3
INT8 = CommPrecisionPolicy(all_gather="int8", reduce_scatter="int8", block_size=64)


def _train(rank: int, mesh: Any, policy: CommPrecisionPolicy | None, **shard_kwargs: Any) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    for index in (0, 2):
        fully_shard(model[index], mesh=mesh, **shard_kwargs)
    fully_shard(
        model, mesh=mesh, **{k: v for k, v in shard_kwargs.items() if k != "reshard_after_forward"}
    )
    model.set_comm_precision(policy)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    for step in range(STEPS):
        torch.manual_seed(100 + 10 * step + rank)
        loss = model(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
    return {"losses": losses, "grads": grads}


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    offload = {"offload_policy": CPUOffloadPolicy(pin_memory=False)}
    shard_1 = {"shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else Shard(0)}
    return run_scenarios(
        {
            "int8": lambda: _train(rank, mesh, INT8),
            "int8_offload": lambda: _train(rank, mesh, INT8, **offload),
            "int8_hpz": lambda: _train(rank, mesh, INT8, reshard_after_forward=2),
            "exact_shard_1": lambda: _train(rank, mesh, None, **shard_1),
            "int8_shard_1": lambda: _train(rank, mesh, INT8, **shard_1),
        }
    )


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=180, pool=gloo_pool)


@pytest.mark.parametrize("variant", ["int8_offload", "int8_hpz"])
def test_combination_is_bitwise_the_plain_quantized_run(run, variant):
    for rank, (base, other) in enumerate(
        zip(scenario_records(run, "int8"), scenario_records(run, variant), strict=True)
    ):
        assert other["losses"] == base["losses"], f"rank {rank}"
        for step, (got, want) in enumerate(zip(other["grads"], base["grads"], strict=True)):
            for name in want:
                assert torch.equal(got[name], want[name]), f"rank {rank} step {step} {name}"


def test_shard_dim_1_quantized_stays_close_to_exact(run):
    for rank, (exact, quantized) in enumerate(
        zip(
            scenario_records(run, "exact_shard_1"),
            scenario_records(run, "int8_shard_1"),
            strict=True,
        )
    ):
        assert quantized["losses"] != exact["losses"], f"rank {rank}: nothing was quantized"
        for got, want in zip(quantized["losses"], exact["losses"], strict=True):
            assert got == pytest.approx(want, rel=0.02), f"rank {rank}"
