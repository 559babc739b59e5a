"""Each forward's post-backward runs in that forward's backward, on torch's
``fully_shard`` and ours, 2 gloo ranks: a group is resharded and its grads
reduce-scattered right after its own backward, whatever other forwards' graphs are
alive.

Scenarios (4 blocks of ``Linear(256, 256)`` + the root's head):

- ``kept``: a grad-mode forward whose output stays alive without a backward (kept for
  logging), then training steps;
- ``one_backward_each``: two forwards, then one backward for each;
- ``summed``: two forwards summed into one loss, one backward;
- ``reused``: a block used twice in one forward (blocks 0, 1, 0, 2, 3): post-backward
  runs after each use's backward, and the earlier use's backward prefetches the block
  before *that* use (none), not again the one before the later use (block 1, reduced
  and resharded by then: an all-gather nobody reads);
- ``kept_on_rank0`` (its own spawn, under a deadline): every rank runs the forward,
  only rank 0 keeps its output. A
  post-backward that waited for the kept forward's nodes would run at the end of
  backward on rank 0 only, so the ranks would issue collectives in different orders
  and block each other until the backend's timeout; the deadline turns that into a
  failure in seconds.

Per backward: the c10d collectives (kind and bytes, in issue order; gloo's reduce-scatter
is an all-to-all for ours, so both are read as reductions) equal torch's, and the local
grads bitwise (same arithmetic: one reduce-scatter of the same sums).
"""

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard as ours_fully_shard
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

DIM, BLOCKS, STEPS = 256, 4, 2
# Two steps of a healthy run take well under a second per rank; the hang this guards
# against lasts until gloo's timeout (30 minutes by default).
DEADLINE_S = 90.0

IMPLS = {"ours": ours_fully_shard, "torch": torch_fully_shard}


class Net(nn.Module):
    def __init__(self, order: tuple[int, ...]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(BLOCKS)
        )
        self.head = nn.Linear(DIM, DIM)
        self.order = order  # the blocks the forward runs, by index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in self.order:
            x = self.blocks[i](x)
        return self.head(x)


def _build(shard: Any, order: tuple[int, ...] = tuple(range(BLOCKS))) -> Net:
    torch.manual_seed(0)
    model = Net(order)
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    torch.manual_seed(1 + torch.distributed.get_rank())
    return model


def _backward(loss: torch.Tensor) -> list[tuple[str, int]]:
    with C10dRecorder() as recorder:
        loss.backward()
    return [
        ("reduce_scatter" if kind == "all_to_all" else kind, nbytes)
        for kind, nbytes in recorder.records
    ]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.to_local().clone() for name, p in model.named_parameters()}


def _steps(model: Net) -> dict[str, list]:
    """``STEPS`` forwards and backwards: each backward's collectives, and the grads."""
    collectives, grads = [], []
    for _ in range(STEPS):
        collectives.append(_backward(model(torch.randn(4, DIM)).sum()))
        grads.append(_grads(model))
        model.zero_grad()
    return {"collectives": collectives, "grads": grads}


def _kept(shard: Any, keep: bool = True) -> dict[str, list]:
    model = _build(shard)
    kept = model(torch.randn(4, DIM))  # every rank runs it: forward all-gathers
    if not keep:
        del kept  # its graph, and its post-backward nodes, go with it
        kept = None
    record = _steps(model)
    del kept
    return record


def _reused(shard: Any) -> dict[str, list]:
    return _steps(_build(shard, order=(0, 1, 0, 2, 3)))


def _one_backward_each(shard: Any) -> dict[str, list]:
    model = _build(shard)
    first = model(torch.randn(4, DIM)).sum()
    second = model(torch.randn(4, DIM)).sum()
    return {"collectives": [_backward(first), _backward(second)], "grads": [_grads(model)]}


def _summed(shard: Any) -> dict[str, list]:
    model = _build(shard)
    loss = model(torch.randn(4, DIM)).sum() + model(torch.randn(4, DIM)).sum()
    return {"collectives": [_backward(loss)], "grads": [_grads(model)]}


SCENARIOS = {
    "kept": _kept,
    "one_backward_each": _one_backward_each,
    "summed": _summed,
    "reused": _reused,
}


def _run(rank: int, world_size: int) -> dict[str, tuple[str, Any]]:
    return run_scenarios(
        {
            f"{name}-{impl}": (lambda fn=fn, shard=shard: fn(shard))
            for name, fn in SCENARIOS.items()
            for impl, shard in IMPLS.items()
        }
    )


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(_run, 2, pool=gloo_pool)


def _assert_like_torch(ours: dict[str, list], theirs: dict[str, list], where: str) -> None:
    assert len(ours["collectives"]) == len(theirs["collectives"])
    for index, (mine, torchs) in enumerate(zip(ours["collectives"], theirs["collectives"])):
        assert mine == torchs, (
            f"{where}, backward {index}: c10d collectives (ours, torch):\n{mine}\n{torchs}"
        )
    for mine, torchs in zip(ours["grads"], theirs["grads"], strict=True):
        for name, grad in mine.items():
            assert torch.equal(grad, torchs[name]), f"{where}: grad {name}"


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_post_backward_like_torch(run: list[dict[str, tuple[str, Any]]], name: str) -> None:
    ours, theirs = scenario_records(run, f"{name}-ours"), scenario_records(run, f"{name}-torch")
    for rank, (mine, torchs) in enumerate(zip(ours, theirs)):
        _assert_like_torch(mine, torchs, f"{name}, rank {rank}")


def test_kept_output_reshards_each_block_in_its_backward(
    run: list[dict[str, tuple[str, Any]]],
) -> None:
    """The property behind the sequence: with a forward's output kept alive, each
    block's grads are reduced before the all-gather of the block that runs its backward
    two blocks later, not all at the end of backward."""
    for record in scenario_records(run, "kept-ours"):
        kinds = [kind for kind, _ in record["collectives"][0]]
        first_reduction = kinds.index("reduce_scatter")
        assert "all_gather" in kinds[first_reduction:], kinds


def _kept_on_rank0(rank: int, world_size: int) -> dict[str, Any]:
    return {impl: _kept(shard, keep=rank == 0) for impl, shard in IMPLS.items()}


def test_output_kept_on_one_rank_does_not_hang(gloo_pool: GlooPools) -> None:
    ranks = run_distributed(_kept_on_rank0, 2, timeout=DEADLINE_S, pool=gloo_pool)
    for rank, record in enumerate(ranks):
        _assert_like_torch(record["ours"], record["torch"], f"kept on rank 0, rank {rank}")
    assert ranks[0]["ours"]["collectives"] == ranks[1]["ours"]["collectives"]
