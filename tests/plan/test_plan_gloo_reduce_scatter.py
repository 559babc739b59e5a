"""``plan(backend="gloo")`` simulates ours' gloo reduce-scatter with ``AllToAllReduceScatter``
installed by the public ``set_custom_reduce_scatter``. On real gloo ranks it must be that
collective: the same c10d traffic as ours' own all-to-all path and the same sums, so the
trained parameters are bitwise ours'; and torch's ``fully_shard`` takes it through the
same public method."""

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp.plan.all_to_all import AllToAllReduceScatter
from tests._c10d import C10dRecorder
from tests._harness import run_distributed
from tests._mlp import mlp, shard_mlp
from tests._parity import full

STEPS = 2


def _train(model: torch.nn.Module, rank: int) -> dict[str, Any]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    recorder = C10dRecorder()
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)  # each rank its own data
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
        with recorder:
            F.mse_loss(model(x), y).backward()
        optim.step()
        optim.zero_grad()
    params = {n: full(p).detach().clone() for n, p in model.named_parameters()}
    return {"collectives": recorder.records, "params": params}


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    base = mlp()
    out = {}
    for name, shard in (("ours", None), ("ours_custom", None), ("torch_custom", torch_fully_shard)):
        model = copy.deepcopy(base)
        model = shard_mlp(model, mesh) if shard is None else shard_mlp(model, mesh, shard=shard)
        if name.endswith("custom"):
            for module in (model[0], model[2], model):
                module.set_custom_reduce_scatter(AllToAllReduceScatter())
        out[name] = _train(model, rank)
    return out


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    return run_distributed(_run, 3)


def test_it_is_ours_gloo_reduce_scatter(runs) -> None:
    for rank in runs:
        ours, custom = rank["ours"], rank["ours_custom"]
        # The same all-to-alls (gloo: ours never calls reduce_scatter_tensor there).
        assert ours["collectives"] == custom["collectives"]
        assert {kind for kind, _ in ours["collectives"]} == {"all_gather", "all_to_all"}
        # The same sum of the same received chunks, in rank order: bitwise.
        for param, value in ours["params"].items():
            assert torch.equal(value, custom["params"][param]), param


def test_torch_takes_it_through_the_same_public_method(runs) -> None:
    for rank in runs:
        theirs = rank["torch_custom"]
        assert theirs["collectives"] == rank["ours"]["collectives"]
        # Torch divides by the world size its own way (after the sum, as ours on gloo):
        # the same arithmetic, so bitwise too.
        for param, value in rank["ours"]["params"].items():
            assert torch.equal(value, theirs["params"][param]), param
