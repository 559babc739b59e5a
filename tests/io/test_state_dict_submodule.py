"""``state_dict()``/``load_state_dict()`` of a plain submodule inside an FSDP group,
after a ``no_grad`` forward left the group unsharded, on 2 gloo ranks, against torch's
``fully_shard``.

After an evaluation forward the root stays unsharded (and so does a group with
``reshard_after_forward=False``). torch's FSDP2 hooks every module that holds FSDP
params, not only those passed to ``fully_shard``, so ``model.out.state_dict()`` of a
plain ``Linear`` reshards its group first and returns the sharded DTensors, and
``model.out.load_state_dict(sd)`` loads into the sharded params. Compared with torch:
the submodule state dict's types, placements and local values, then after loading
(copy and ``assign=True``) the next forward's output, the gradients and the whole
model's local shards, bitwise (the same local arithmetic on both sides). Layouts: the
submodule in the root's group (after the blocks' groups), in a list group
(``fully_shard([a, b], reshard_after_forward=False)``), and holding a parameter tied
with another module of the group. One spawn runs every scenario.
"""

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import assert_pairs_equal, local_pairs
from tests._pool import GlooPools

WORLD_SIZE = 2
LAYOUTS = ("root", "list", "tied")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self, tie: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8, bias=False)
        self.layers = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(8, 8)  # a plain submodule: never passed to fully_shard
        if tie:
            self.out.weight = self.layers[1].fc.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.layers:
            x = block(x)
        return self.out(x)


def _build(shard: Any, mesh: DeviceMesh, layout: str) -> tuple[Net, nn.Module]:
    """The model and the plain submodule under test."""
    torch.manual_seed(0)
    model = Net(tie=layout == "tied")
    if layout == "list":  # kept unsharded after forward, like the root
        shard(list(model.layers), mesh=mesh, reshard_after_forward=False)
    elif layout == "root":
        for block in model.layers:
            shard(block, mesh=mesh)
    shard(model, mesh=mesh)  # "tied": one group for all, so the tie stays in it
    return model, (model.layers[0].fc if layout == "list" else model.out)


def _described(state_dict: dict[str, Any]) -> dict[str, tuple]:
    """Per key: the value's type name, placements and (local) values."""
    return {
        key: (
            type(value).__name__,
            tuple(value.placements) if isinstance(value, DTensor) else None,
            (value.to_local() if isinstance(value, DTensor) else value).detach().clone(),
        )
        for key, value in state_dict.items()
    }


def _run_one(shard: Any, mesh: DeviceMesh, layout: str, assign: bool) -> tuple[Net, dict]:
    model, submodule = _build(shard, mesh, layout)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(dist.get_rank()))
    # New values for the submodule: its sharded state dict, doubled (DTensors).
    new_values = {key: value.detach() * 2 for key, value in submodule.state_dict().items()}
    with torch.no_grad():
        model(x)  # the group stays unsharded
    record: dict[str, Any] = {"state_dict": _described(submodule.state_dict())}
    submodule.load_state_dict(new_values, assign=assign)
    out = model(x)
    out.sum().backward()
    record["out"] = out.detach()
    record["after"] = _described(model.state_dict())
    return model, record


def _scenario(mesh: DeviceMesh, layout: str, assign: bool) -> dict[str, Any]:
    # torch's assign=True into a tied slot registers the new Parameter in the loaded
    # module only, and its next forward ties the two again with the other module's old
    # values: the load is lost. Ours keeps the tie and the loaded values, which is what
    # torch's copy (assign=False) gives: the reference there (README, differences).
    theirs, their_record = _run_one(
        torch_fully_shard, mesh, layout, assign and layout != "tied"
    )
    ours, our_record = _run_one(fully_shard, mesh, layout, assign)
    return {
        "ours": our_record,
        "theirs": their_record,
        "grads": local_pairs(ours, theirs, grads=True),
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            f"{layout}-{'assign' if assign else 'copy'}": (
                lambda layout=layout, assign=assign: _scenario(mesh, layout, assign)
            )
            for layout in LAYOUTS
            for assign in (False, True)
        }
    )


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, pool=gloo_pool)


def _assert_same_state_dict(ours: dict[str, tuple], theirs: dict[str, tuple], what: str) -> None:
    assert list(ours) == list(theirs), what
    for key, (our_type, our_placements, our_values) in ours.items():
        their_type, their_placements, their_values = theirs[key]
        assert (our_type, our_placements) == (their_type, their_placements), f"{what} {key}"
        assert torch.equal(our_values, their_values), f"{what} {key}: values"


@pytest.mark.parametrize("mode", ["copy", "assign"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_submodule_state_dict_after_eval_forward_as_torch(run, layout, mode):
    for rank, rec in enumerate(scenario_records(run, f"{layout}-{mode}")):
        ours, theirs = rec["ours"], rec["theirs"]
        # Sharded DTensors, as torch's, not the unsharded params.
        assert {t for t, _, _ in theirs["state_dict"].values()} == {"DTensor"}
        _assert_same_state_dict(ours["state_dict"], theirs["state_dict"], f"rank {rank} sd")
        # The load landed in the sharded params: the next forward uses it, as torch's.
        assert torch.equal(ours["out"], theirs["out"]), f"rank {rank}: forward after load"
        assert_pairs_equal(rec["grads"], f"rank {rank} grad")
        _assert_same_state_dict(ours["after"], theirs["after"], f"rank {rank} model sd")
