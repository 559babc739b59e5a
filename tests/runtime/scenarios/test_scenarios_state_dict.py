"""State dicts of a training model, torch's ``test_fully_shard_state_dict.py`` family, on
torch's ``fully_shard`` and ours on 2 gloo ranks (one spawn; ``_side_by_side.py``).

What a checkpoint sees, and what the step after a load computes with: a state dict
whose values silently stop tracking the parameters, or a load that the next forward
does not read, trains on without an error. Compared bitwise:

- ``save_load``: per MLP width 2-5 (uneven shards at odd widths) and for
  ``reshard_after_forward`` True and False (then after a forward without backward),
  the state dict's keys, placements and local values, whether each value shares the
  sharded parameter's storage, then a load of new values from DTensors on other
  storage: the parameters' local values, whether they kept their storage, and two
  training steps on the loaded values (torch's ``_test_dp_state_dict_save_load``);
- ``cached``: one ``state_dict()`` taken before training, read after each step: it
  must hold the stepped values (torch's ``test_cached_state_dict``);
- ``meta_pieces``: a model built and sharded on meta, loaded one parameter at a time
  (``strict=False, assign=True``) from DTensors, then trained (torch's
  ``test_dp_state_dict_cpu_offload``, without offload, and with ``CPUOffloadPolicy``).
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from tests.runtime.scenarios._side_by_side import (
    Side,
    cases_fixture,
    checked,
    local,
    local_shards,
    rank_input,
    train,
)

ROWS = 4


class Mlp(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(self.in_proj(x).tanh())


def _model(side: Side, mesh: DeviceMesh, dim: int, raf: bool) -> nn.Sequential:
    torch.manual_seed(42)
    model = nn.Sequential(Mlp(dim), nn.Sequential(Mlp(dim), nn.Linear(dim, dim)), Mlp(dim))
    for module in model:
        side.fully_shard(module, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    return model


def _state_dict_record(model: nn.Module) -> dict:
    state = model.state_dict()  # its hooks reshard first: the params are sharded after
    storage = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    return {
        name: (
            type(value).__name__,
            str(value.placements) if isinstance(value, DTensor) else None,
            local(value),
            # the value is the sharded parameter's data (not a copy); an empty shard
            # has no data to compare
            value.to_local().numel() == 0 or value.to_local().data_ptr() == storage[name],
        )
        for name, value in state.items()
    }


def _save_load(side: Side, mesh: DeviceMesh, dim: int, raf: bool) -> dict:
    model = _model(side, mesh, dim, raf)
    record: dict[str, Any] = {"saved": _state_dict_record(model)}
    if not raf:  # the parameters stay unsharded after this forward: the hooks reshard
        model(rank_input(50, ROWS, dim))
        record["saved_after_forward"] = _state_dict_record(model)
    storage = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    new_values = {
        name: value.detach().clone().fill_(0.5 + index / 10)
        for index, (name, value) in enumerate(model.state_dict().items())
    }
    model.load_state_dict(new_values)
    record["loaded"] = {
        name: (local(p), p.to_local().data_ptr() == storage[name])
        for name, p in model.named_parameters()
    }
    steps = train(model, 2, lambda step: model(rank_input(step, ROWS, dim)).sum())
    # Values only: the collectives after a forward without backward are
    # test_scenarios_comm.py's ``dangling_forward``.
    record["steps"] = [{k: v for k, v in step.items() if k != "collectives"} for step in steps]
    return record


def _cached(side: Side, mesh: DeviceMesh, dim: int) -> dict:
    torch.manual_seed(42)
    model = nn.Linear(dim, dim, bias=False)
    side.fully_shard(model, mesh=mesh)
    state = model.state_dict()  # taken once, read after every step

    def loss(step: int) -> torch.Tensor:
        return model(rank_input(step, dim, dim)).sum()

    steps = train(model, 3, loss)
    return {"steps": steps, "cached": local(state["weight"]), "param": local(model.weight)}


def _meta_pieces(side: Side, mesh: DeviceMesh, offload: bool) -> dict:
    kwargs: dict[str, Any] = {"mesh": mesh}
    if offload:
        kwargs["offload_policy"] = side.CPUOffloadPolicy(pin_memory=False)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    for module in model:
        side.fully_shard(module, **kwargs)
    side.fully_shard(model, **kwargs)
    torch.manual_seed(42)  # the same full values on every rank and side
    for name, meta_param in list(model.named_parameters()):
        full = torch.randn(meta_param.shape)
        piece = distribute_tensor(full, meta_param.device_mesh, meta_param.placements)
        model.load_state_dict({name: nn.Parameter(piece)}, strict=False, assign=True)
    at_load = local_shards(model)
    steps = train(model, 3, lambda step: model(rank_input(step, ROWS, 4)).sum())
    return {"at_load": at_load, "steps": steps}


SAVE_LOAD = [(dim, raf) for dim in (2, 3, 4, 5) for raf in (True, False)]
CASES: dict[str, Callable[[Side, DeviceMesh], Any]] = {}
for _dim, _raf in SAVE_LOAD:
    CASES[f"save_load-dim={_dim}-raf={_raf}"] = lambda s, m, d=_dim, r=_raf: _save_load(s, m, d, r)
for _dim in (2, 3):
    CASES[f"cached-dim={_dim}"] = lambda s, m, d=_dim: _cached(s, m, d)
for _offload in (False, True):
    CASES[f"meta_pieces-offload={_offload}"] = lambda s, m, o=_offload: _meta_pieces(s, m, o)


run = cases_fixture(__name__)


@pytest.mark.parametrize("dim,raf", SAVE_LOAD, ids=[f"dim={d}-raf={r}" for d, r in SAVE_LOAD])
def test_state_dict_save_and_load_match_torch(run, dim, raf) -> None:
    for ours, _ in checked(run, f"save_load-dim={dim}-raf={raf}"):
        # Saved values are views of the sharded params; the load wrote into them.
        assert all(aliased for *_, aliased in ours["saved"].values())
        first = next(iter(ours["loaded"].values()))[0]
        assert first.numel() == 0 or torch.all(first == 0.5)


@pytest.mark.parametrize("dim", [2, 3], ids=lambda d: f"dim={d}")
def test_state_dict_taken_once_tracks_the_steps_like_torch(run, dim) -> None:
    for ours, _ in checked(run, f"cached-dim={dim}"):
        assert torch.equal(ours["cached"], ours["param"])


@pytest.mark.parametrize("offload", [False, True], ids=lambda o: f"offload={o}")
def test_meta_model_loaded_piece_by_piece_matches_torch(run, offload) -> None:
    checked(run, f"meta_pieces-offload={offload}")
