"""Frozen and trainable parameters mixed, torch's ``test_fully_shard_frozen.py`` family, on
torch's ``fully_shard`` and ours on 2 gloo ranks (one spawn; ``_side_by_side.py``).

Per training step both sides record the loss, the c10d collectives of forward and
backward (a frozen parameter must add no reduce-scatter bytes), every local grad
(``None`` for frozen ones) and every local shard after an Adam step, compared bitwise:

- ``per_group``: frozen weights and trainable biases in the same groups (BitFit), frozen
  before or after ``fully_shard``, with and without activation checkpointing, per
  ``reshard_after_forward`` True, False and 1 (torch's
  ``test_train_mixed_requires_grad_per_group``);
- ``across_groups``: every other Linear frozen, each Linear its own group and, as in
  torch's test, its own root (no ``fully_shard`` on the model); a ``no_grad`` step in
  between and the frozen Linears unfrozen for the last step (torch's
  ``test_train_mixed_requires_grad_across_groups``), and the same under a root;
- ``freeze_midway``: everything trains for two steps, then half the groups are frozen;
- ``reused_mixed``: a trainable and a frozen Linear each run three times in one forward,
  the trainable one also under ``no_grad`` (torch's
  ``test_multi_forward_mixed_requires_grad``);
- ``frozen_first``: the first Linear frozen, so no gradient reaches its group and
  nothing hooks its backward; after each step the registered parameters (what
  ``model.parameters()`` yields) and an in-place update of them (an EMA-style decay),
  then ``reshard()`` and the next step.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh

from tests._c10d import bytes_of
from tests.runtime.scenarios._side_by_side import (
    Side,
    cases_fixture,
    checked,
    local_grads,
    local_shards,
    rank_input,
    train,
)

DIM, ROWS, STEPS = 8, 4, 3
RESHARD = (True, False, 1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.up(x).relu()).tanh()


def _freeze_weights(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        if "bias" not in name:
            param.requires_grad_(False)


def _per_group(side: Side, mesh: DeviceMesh, raf: bool | int, ac: bool, after: bool) -> list[dict]:
    torch.manual_seed(42)
    model = nn.Sequential(*(Block() for _ in range(3)))
    if not after:
        _freeze_weights(model)
    for block in model:
        if ac:
            checkpoint(block)
        side.fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    if after:
        _freeze_weights(model)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).sum())


def _linears(rooted: bool, side: Side, mesh: DeviceMesh, raf: bool | int) -> nn.Sequential:
    """Six Linears (with ReLUs), each its own group; a root over them if ``rooted``."""
    torch.manual_seed(42)
    model = nn.Sequential(*(m for _ in range(6) for m in (nn.Linear(DIM, DIM), nn.ReLU())))
    for module in model:
        if isinstance(module, nn.Linear):
            side.fully_shard(module, mesh=mesh, reshard_after_forward=raf)
    if rooted:
        side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    return model


def _set_every_other(model: nn.Sequential, requires_grad: bool) -> None:
    """Linears 0, 2 and 4 (modules 0, 4, 8)."""
    for index in range(0, len(model), 4):
        model[index].requires_grad_(requires_grad)


def _across_groups(
    side: Side, mesh: DeviceMesh, raf: bool | int, unfreeze: bool, rooted: bool
) -> list[dict]:
    model = _linears(rooted, side, mesh, raf)
    _set_every_other(model, False)

    def loss(step: int) -> torch.Tensor:
        if step == 1:
            with torch.no_grad():  # an evaluation step: no backward through it
                model(rank_input(100, ROWS, DIM))
        if step == STEPS - 1 and unfreeze:
            _set_every_other(model, True)
        return model(rank_input(step, ROWS, DIM)).sum()

    return train(model, STEPS, loss)


def _freeze_midway(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    model = _linears(True, side, mesh, raf)

    def loss(step: int) -> torch.Tensor:
        if step == 2:
            _set_every_other(model, False)
        return model(rank_input(step, ROWS, DIM)).sum()

    return train(model, STEPS + 1, loss)


class ReusedMixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(DIM, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.trained = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        for _ in range(3):
            x = self.frozen(self.trained(x).relu())
            with torch.no_grad():  # the same module, once more, outside autograd
                x += self.trained(x).relu()
        return x


def _reused_mixed(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    torch.manual_seed(42)
    model = ReusedMixed()
    for module in (model.first, model.frozen, model.trained, model):
        side.fully_shard(module, mesh=mesh, reshard_after_forward=raf)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).sum())


def _frozen_first(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    model = _linears(True, side, mesh, raf)
    model[0].requires_grad_(False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    for step in range(STEPS):
        loss = model(rank_input(step, ROWS, DIM)).sum()
        loss.backward()
        grads = local_grads(model)
        optim.step()
        optim.zero_grad()
        registered = {n: (type(p).__name__, tuple(p.shape)) for n, p in model.named_parameters()}
        with torch.no_grad():  # e.g. weight averaging over model.parameters()
            for param in model.parameters():
                param.mul_(0.9)
        for module in model.modules():
            if isinstance(module, side.FSDPModule):
                module.reshard()
        steps.append({"loss": loss.detach(), "grads": grads, "registered": registered})
        steps[-1]["shards"] = local_shards(model)
    return steps


def _raf_id(raf: bool | int) -> str:
    return f"raf={raf}"


PER_GROUP = [(raf, ac, after) for raf in RESHARD for ac in (False, True) for after in (False, True)]
ACROSS = [(raf, unfreeze, False) for raf in RESHARD for unfreeze in (False, True)] + [
    (raf, True, True) for raf in (True, False)
]


def _per_group_id(raf: bool | int, ac: bool, after: bool) -> str:
    return f"per_group-{_raf_id(raf)}-ac={ac}-freeze_after_init={after}"


def _across_id(raf: bool | int, unfreeze: bool, rooted: bool) -> str:
    return f"across_groups-{_raf_id(raf)}-unfreeze={unfreeze}-rooted={rooted}"


CASES: dict[str, Callable[[Side, DeviceMesh], Any]] = {}
for _case in PER_GROUP:
    CASES[_per_group_id(*_case)] = lambda s, m, c=_case: _per_group(s, m, *c)
for _case in ACROSS:
    CASES[_across_id(*_case)] = lambda s, m, c=_case: _across_groups(s, m, *c)
for _raf in RESHARD:
    CASES[f"freeze_midway-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _freeze_midway(s, m, r)
    CASES[f"reused_mixed-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _reused_mixed(s, m, r)
    CASES[f"frozen_first-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _frozen_first(s, m, r)


run = cases_fixture(__name__)


# Each Block's trainable biases: up.bias (2 * DIM) and down.bias (DIM) fp32 elements,
# both even, so no padding: the only bytes a block's reduce-scatter may carry.
BIAS_BYTES = (2 * DIM + DIM) * 4


@pytest.mark.parametrize(
    "raf,ac,after", PER_GROUP, ids=[_per_group_id(*c).removeprefix("per_group-") for c in PER_GROUP]
)
def test_frozen_weights_with_trainable_biases_in_one_group_match_torch(run, raf, ac, after) -> None:
    for rank, (ours, _) in enumerate(checked(run, _per_group_id(raf, ac, after))):
        for step, record in enumerate(ours):
            assert all(g is None for n, g in record["grads"].items() if "bias" not in n)
            reductions = [
                nbytes for kind, nbytes in record["collectives"] if kind == "reduce_scatter"
            ]
            assert reductions == [BIAS_BYTES] * 3, f"rank {rank} step {step}: {reductions}"
            assert bytes_of(record["collectives"], "reduce_scatter") == 3 * BIAS_BYTES


def _across_param(raf: bool | int, unfreeze: bool, rooted: bool) -> Any:
    return pytest.param(
        raf, unfreeze, rooted, id=_across_id(raf, unfreeze, rooted).split("-", 1)[1]
    )


@pytest.mark.parametrize("raf,unfreeze,rooted", [_across_param(*c) for c in ACROSS])
def test_frozen_groups_between_trainable_ones_match_torch(run, raf, unfreeze, rooted) -> None:
    for rank, (ours, _) in enumerate(checked(run, _across_id(raf, unfreeze, rooted))):
        frozen_grad = ours[-1]["grads"]["0.weight"]
        assert (frozen_grad is not None) == unfreeze, f"rank {rank}"


@pytest.mark.parametrize("raf", RESHARD, ids=_raf_id)
def test_groups_frozen_midway_match_torch(run, raf) -> None:
    for rank, (ours, _) in enumerate(checked(run, f"freeze_midway-{_raf_id(raf)}")):
        assert ours[1]["grads"]["0.weight"] is not None, f"rank {rank}"


@pytest.mark.parametrize("raf", RESHARD, ids=_raf_id)
def test_frozen_and_trainable_modules_run_several_times_match_torch(run, raf) -> None:
    for rank, (ours, _) in enumerate(checked(run, f"reused_mixed-{_raf_id(raf)}")):
        assert all(step["grads"]["frozen.weight"] is None for step in ours), f"rank {rank}"


@pytest.mark.parametrize("raf", RESHARD, ids=_raf_id)
def test_registered_params_after_backward_and_their_updates_match_torch(run, raf) -> None:
    for rank, (ours, _) in enumerate(checked(run, f"frozen_first-{_raf_id(raf)}")):
        assert all(kind == "DTensor" for kind, _ in ours[0]["registered"].values()), f"rank {rank}"
