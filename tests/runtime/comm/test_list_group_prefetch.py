"""A list group's explicit forward prefetch, on torch's ``fully_shard`` and ours, 2 gloo
ranks: issued once, when the group's forward starts (torch's group hooks run its
pre-forward at the first module only), not again at each later module of the list.

The model runs ``a``, then ``c``, then ``b``, with ``fully_shard([a, b])`` prefetching
``c``: ``c`` is resharded after its forward, so a second prefetch at ``b`` would
all-gather it again during forward and hold it unsharded until its backward. Per step:
the c10d collectives of the forward and of the backward apart, and the losses and
local grads, bitwise.
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

DIM, STEPS = 8, 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (nn.Linear(DIM, DIM) for _ in range(3))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.b(torch.relu(self.c(torch.relu(self.a(x))))))


def _train(shard: Any) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    model = Net()
    shard([model.a, model.b], mesh=mesh)
    shard(model.c, mesh=mesh)
    shard(model, mesh=mesh)
    model.a.set_modules_to_forward_prefetch([model.c])
    torch.manual_seed(1 + torch.distributed.get_rank())
    steps = []
    for _ in range(STEPS):
        x = torch.randn(4, DIM)
        with C10dRecorder() as forward:
            loss = model(x).sum()
        with C10dRecorder() as backward:
            loss.backward()
        steps.append(
            {
                "forward": forward.records,
                "backward": [
                    ("reduce_scatter" if kind == "all_to_all" else kind, nbytes)
                    for kind, nbytes in backward.records
                ],
                "loss": loss.item(),
                "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
            }
        )
        model.zero_grad()
    return {"steps": steps}


def _run(rank: int, world_size: int) -> dict[str, Any]:
    return run_scenarios(
        {"ours": lambda: _train(ours_fully_shard), "torch": lambda: _train(torch_fully_shard)}
    )


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, 2, pool=gloo_pool)


def test_prefetched_once_per_forward_like_torch(run: list[dict[str, Any]]) -> None:
    for ours, theirs in zip(scenario_records(run, "ours"), scenario_records(run, "torch")):
        for mine, torchs in zip(ours["steps"], theirs["steps"], strict=True):
            # The root's, the list group's and c's (prefetched) all-gathers, once each.
            assert [kind for kind, _ in mine["forward"]] == ["all_gather"] * 3
            assert mine["forward"] == torchs["forward"]
            # c re-gathered in backward (resharded after its forward), then the
            # reductions: (kind, bytes) in issue order.
            assert mine["backward"] == torchs["backward"]
            assert mine["loss"] == torchs["loss"]
            for name, grad in mine["grads"].items():
                assert torch.equal(grad, torchs["grads"][name]), name
