"""Communication schedules, torch's ``test_fully_shard_comm.py`` family, on torch's
``fully_shard`` and ours on 2 gloo ranks (one spawn; ``_side_by_side.py``).

torch's tests of this family count collectives and record its private lifecycle calls
(``FSDPParamGroup.unshard``/``post_backward``); ours compare what a user sees, per
training step, bitwise: the loss, the c10d collectives of forward and of backward
apart (kind and bytes, in issue order), every local grad and every local shard after
an Adam step. A schedule change that reduces a group at the wrong time, or gathers
stale shards, shows in the gradients even where the counts agree.

The model is a stem Linear, blocks of two Linears each its own group, and a head
Linear (stem and head in the root's group), except where a case says otherwise:

- ``count``: per ``reshard_after_forward`` True, False, 1, None (torch's
  ``test_fully_shard_communication_count``);
- ``set_raf``: ``fully_shard`` with the opposite value, then
  ``set_reshard_after_forward`` on the root, recursively or not (torch's
  ``test_set_reshard_after_forward``);
- ``manual_reshard``: ``reshard_after_forward=False``, then ``reshard()`` on every
  module between forward and backward (torch's
  ``test_manual_reshard_with_reshard_after_forward_false``);
- ``two_forwards``: two forwards, one backward of their sum, with and without
  activation checkpointing (torch's ``_test_backward_prefetch_multi_forward``);
- ``forward_prefetch``/``backward_prefetch``: explicit prefetch of the next one or two
  blocks, under ``torch.utils.checkpoint`` (torch's ``test_set_modules_to_*_prefetch``);
- ``misprefetch``: a block prefetches, in backward, one that backward has passed
  (torch's ``test_backward_misprefetch``);
- ``prefetch_inside_ac``: ``checkpoint_wrapper`` around each block and its feed-forward,
  a nested group inside each block, list groups for the stem and the head, and an
  explicit backward prefetch of the previous block and its nested group (torch's
  ``test_set_modules_to_backward_prefetch_inside_ac``);
- ``list_groups``: blocks grouped two by two with ``fully_shard([a, b])``, the head's
  list group kept unsharded (torch's ``test_fully_shard_multi_module_backward_prefetch``);
- ``list_group_unused``: list groups holding a module that never runs (torch's
  ``test_fully_shard_multi_module_unused_module``);
- ``user_unshard``: the root's forward calls ``unshard(async_op=True)`` on blocks
  before it runs them (torch's ``test_unshard_async``);
- ``dangling_forward``: a grad-enabled forward whose output is dropped without a
  backward (an evaluation without ``no_grad``), then training;
- ``unshard_first``: ``unshard()`` before the first forward (no lazy init yet), and on a
  root without parameters (torch's ``test_unshard_without_lazy_init`` and
  ``test_unshard_no_param_group``).
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh

from tests._c10d import C10dRecorder
from tests.runtime.scenarios._blocks import DIM, Block, Stack
from tests.runtime.scenarios._side_by_side import (
    Side,
    assert_same,
    assert_trained,
    cases_fixture,
    checked,
    collectives,
    known_difference,
    local,
    local_grads,
    local_shards,
    rank_input,
    side_records,
)

ROWS, STEPS = 4, 3


def _stack(side: Side, mesh: DeviceMesh, blocks: int = 3, ac: str = "none", **kwargs: Any) -> Stack:
    """Each block its own group (``ac``: none, utils or composable), then the root."""
    torch.manual_seed(42)
    model = Stack(blocks, utils_ac=ac == "utils")
    for block in model.blocks:
        if ac == "composable":
            composable_checkpoint(block)
        side.fully_shard(block, mesh=mesh, **kwargs)
    side.fully_shard(model, mesh=mesh, **kwargs)
    return model


def _steps(
    model: nn.Module,
    forward: Callable[[int], torch.Tensor],
    between: Callable[[], None] = lambda: None,
    steps: int = STEPS,
    prologue: Callable[[], None] = lambda: None,
) -> list[dict]:
    """Adam over the sharded params, ``prologue()``, then per step: forward
    (``forward(step)`` returns the loss), ``between()``, backward; the loss, each
    phase's collectives, the local grads, the local shards after the step."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    prologue()
    records = []
    for step in range(steps):
        with C10dRecorder() as fwd:
            loss = forward(step)
        between()
        with C10dRecorder() as bwd:
            loss.backward()
        record = {
            "loss": loss.detach(),
            "forward": collectives(fwd),
            "backward": collectives(bwd),
            "grads": local_grads(model),
        }
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        record["shards"] = local_shards(model)
        records.append(record)
    return records


def _plain(model: nn.Module) -> Callable[[int], torch.Tensor]:
    return lambda step: model(rank_input(step, ROWS, DIM)).sum()


# ---------------------------------------------------------------------------
# reshard_after_forward
# ---------------------------------------------------------------------------


def _count(side: Side, mesh: DeviceMesh, raf: bool | int | None) -> list[dict]:
    model = _stack(side, mesh, reshard_after_forward=raf)
    return _steps(model, _plain(model))


def _set_raf(side: Side, mesh: DeviceMesh, value: bool, recurse: bool) -> list[dict]:
    model = _stack(side, mesh, reshard_after_forward=not value)
    model.set_reshard_after_forward(value, recurse=recurse)
    return _steps(model, _plain(model))


def _fsdp_modules(side: Side, model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, side.FSDPModule)]


def _manual_reshard(side: Side, mesh: DeviceMesh) -> list[dict]:
    model = _stack(side, mesh, reshard_after_forward=False)

    def reshard_all() -> None:
        for module in _fsdp_modules(side, model):
            module.reshard()

    return _steps(model, _plain(model), between=reshard_all)


def _dangling_forward(
    side: Side, mesh: DeviceMesh, raf: bool | int | None, root_params: bool
) -> list[dict]:
    """``root_params=False``: the blocks only, under a root that holds no parameters."""
    if root_params:
        model = _stack(side, mesh, reshard_after_forward=raf)
    else:
        torch.manual_seed(42)
        model = nn.Sequential(*(Block() for _ in range(3)))
        for block in model:
            side.fully_shard(block, mesh=mesh, reshard_after_forward=raf)
        side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    # The optimizer first: after this forward a group that kept its params unsharded
    # registers them, and an optimizer built then would hold those (on both sides).

    def dropped() -> None:
        model(rank_input(100, ROWS, DIM))  # no backward ever

    return _steps(model, _plain(model), prologue=dropped)


def _two_forwards(side: Side, mesh: DeviceMesh, raf: bool | int | None, ac: str) -> list[dict]:
    model = _stack(side, mesh, ac=ac, reshard_after_forward=raf)

    def forward(step: int) -> torch.Tensor:
        return (
            model(rank_input(step, ROWS, DIM)).sum()
            + model(rank_input(50 + step, ROWS, DIM)).square().sum()
        )

    return _steps(model, forward)


# ---------------------------------------------------------------------------
# Explicit prefetching
# ---------------------------------------------------------------------------


def _prefetch(side: Side, mesh: DeviceMesh, direction: str, count: int) -> list[dict]:
    model = _stack(side, mesh, blocks=4, ac="utils")
    blocks = list(model.blocks)
    for index, block in enumerate(blocks):
        if direction == "forward":
            targets = blocks[index + 1 : index + 1 + count]
            if targets:
                block.set_modules_to_forward_prefetch(targets)
        else:
            targets = blocks[max(0, index - count) : index][::-1]
            if targets:
                block.set_modules_to_backward_prefetch(targets)
    return _steps(model, _plain(model))


def _misprefetch(side: Side, mesh: DeviceMesh) -> list[dict]:
    model = _stack(side, mesh, blocks=2)
    # Backward runs block 1, then block 0: block 0 asking for block 1 asks for a
    # group whose backward is over.
    model.blocks[0].set_modules_to_backward_prefetch([model.blocks[1]])
    return _steps(model, _plain(model))


def _prefetch_inside_ac(side: Side, mesh: DeviceMesh, explicit: bool) -> list[dict]:
    torch.manual_seed(42)
    model = Stack(3)
    for block in model.blocks:
        block.ff = checkpoint_wrapper(block.ff)
    model.blocks = nn.ModuleList(checkpoint_wrapper(block) for block in model.blocks)
    inner = [block.ff.w1 for block in model.blocks]  # through both wrappers' __getattr__
    side.fully_shard([model.stem], mesh=mesh)
    for block, w1 in zip(model.blocks, inner):
        side.fully_shard(w1, mesh=mesh)  # like fully_shard(layer.moe.experts)
        side.fully_shard(block, mesh=mesh)
    side.fully_shard([model.norm, model.head], mesh=mesh)
    side.fully_shard(model, mesh=mesh)
    if explicit:
        blocks = list(model.blocks)
        model.head.set_modules_to_backward_prefetch([blocks[-1]])
        for index in range(len(blocks) - 1, 0, -1):
            blocks[index].set_modules_to_backward_prefetch([blocks[index - 1], inner[index - 1]])
        blocks[0].set_modules_to_backward_prefetch([model.stem])
    return _steps(model, _plain(model))


# ---------------------------------------------------------------------------
# List groups
# ---------------------------------------------------------------------------


def _list_groups(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = Stack(5, utils_ac=True)
    blocks = model.blocks
    side.fully_shard(blocks[0], mesh=mesh)
    side.fully_shard([blocks[1], blocks[2]], mesh=mesh)
    side.fully_shard([blocks[3], blocks[4]], mesh=mesh)
    side.fully_shard([model.stem], mesh=mesh)
    side.fully_shard([model.norm, model.head], mesh=mesh, reshard_after_forward=False)
    side.fully_shard(model, mesh=mesh)
    return _steps(model, _plain(model))


class WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(1, 1)
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).relu()


def _list_group_unused(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = nn.Sequential(WithUnused(), WithUnused(), nn.Linear(DIM, DIM))
    for part in model[:2]:
        side.fully_shard([part.unused, part.lin], mesh=mesh, reshard_after_forward=True)
    side.fully_shard(model, mesh=mesh)
    return _steps(model, _plain(model))


# ---------------------------------------------------------------------------
# unshard() called by the user
# ---------------------------------------------------------------------------


class EarlyUnshard(nn.Module):
    """Unshards each block asynchronously before the stem computes (the async handle is
    left for FSDP's pre-forward to wait on)."""

    def __init__(self, fsdp_module: type) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.fsdp_module = fsdp_module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if isinstance(block, self.fsdp_module):
                block.unshard(async_op=True)
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return h


def _user_unshard(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = EarlyUnshard(side.FSDPModule)
    for block in model.blocks:
        side.fully_shard(block, mesh=mesh, reshard_after_forward=False)
    side.fully_shard(model, mesh=mesh)
    return _steps(model, _plain(model))


def _unshard_first(side: Side, mesh: DeviceMesh, paramless_root: bool) -> dict:
    torch.manual_seed(42)
    model = Stack(2)
    if paramless_root:
        for name in ("stem", "norm", "head"):
            side.fully_shard(getattr(model, name), mesh=mesh)
    for block in model.blocks:
        side.fully_shard(block, mesh=mesh)
    side.fully_shard(model, mesh=mesh)
    handle = model.unshard(async_op=True)  # before any forward: no lazy init yet
    if handle is not None:
        handle.wait()
    registered = {n: (type(p).__name__, local(p)) for n, p in model.named_parameters()}
    return {"registered": registered, "steps": _steps(model, _plain(model))}


# ---------------------------------------------------------------------------
# The spawn
# ---------------------------------------------------------------------------


def _raf_id(raf: bool | int | None) -> str:
    return f"raf={raf}"


COUNT = (True, False, 1, None)
SET_RAF = [(value, recurse) for value in (True, False) for recurse in (True, False)]
TWO_FORWARDS = [(raf, ac) for raf in (True, False, None) for ac in ("none", "composable")]
PREFETCH = [(direction, count) for direction in ("forward", "backward") for count in (1, 2)]

CASES: dict[str, Callable[[Side, DeviceMesh], Any]] = {
    "manual_reshard": _manual_reshard,
    "misprefetch": _misprefetch,
    "list_groups": _list_groups,
    "list_group_unused": _list_group_unused,
    "user_unshard": _user_unshard,
}
for _raf in COUNT:
    CASES[f"count-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _count(s, m, r)
    for _root_params in (True, False):
        CASES[f"dangling_forward-{_raf_id(_raf)}-root_params={_root_params}"] = (
            lambda s, m, r=_raf, p=_root_params: _dangling_forward(s, m, r, p)
        )
for _value, _recurse in SET_RAF:
    CASES[f"set_raf-{_value}-recurse={_recurse}"] = lambda s, m, v=_value, r=_recurse: _set_raf(
        s, m, v, r
    )
for _raf, _ac in TWO_FORWARDS:
    CASES[f"two_forwards-{_raf_id(_raf)}-ac={_ac}"] = lambda s, m, r=_raf, a=_ac: _two_forwards(
        s, m, r, a
    )
for _direction, _n in PREFETCH:
    CASES[f"{_direction}_prefetch-{_n}"] = lambda s, m, d=_direction, c=_n: _prefetch(s, m, d, c)
for _explicit in (False, True):
    CASES[f"prefetch_inside_ac-explicit={_explicit}"] = lambda s, m, e=_explicit: (
        _prefetch_inside_ac(s, m, e)
    )
for _paramless in (False, True):
    CASES[f"unshard_first-paramless_root={_paramless}"] = lambda s, m, p=_paramless: _unshard_first(
        s, m, p
    )


run = cases_fixture(__name__)


def _count_kind(records: list[tuple[str, int]], kind: str) -> int:
    return sum(k == kind for k, _ in records)


@pytest.mark.parametrize("raf", COUNT, ids=_raf_id)
def test_collectives_per_reshard_after_forward_match_torch(run, raf) -> None:
    for ours, _ in checked(run, f"count-{_raf_id(raf)}"):
        # torch's counts: one all-gather per group in forward; in backward one per group
        # that resharded (the root never does with None; with 1, to a mesh of one rank,
        # the backward's gather is local), one reduce-scatter per group.
        groups = 4
        # (True == 1 as a dict key, hence no table.)
        if raf is True:
            regathered = groups
        elif raf is None:
            regathered = groups - 1
        else:
            regathered = 0
        for record in ours:
            assert _count_kind(record["forward"], "all_gather") == groups
            assert _count_kind(record["backward"], "all_gather") == regathered
            assert _count_kind(record["backward"], "reduce_scatter") == groups


@pytest.mark.parametrize("root_params", [True, False], ids=lambda p: f"root_params={p}")
@pytest.mark.parametrize("raf", COUNT, ids=_raf_id)
def test_training_after_a_forward_without_backward_matches_torch(run, raf, root_params) -> None:
    """Losses, grads and shards; the collectives are the next test's."""
    case = f"dangling_forward-{_raf_id(raf)}-root_params={root_params}"
    for rank, (ours, theirs) in enumerate(side_records(run, case)):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            for key in ("loss", "grads", "shards"):
                assert_same(mine[key], torchs[key], f"rank {rank} step {step} {key}")
        assert_trained(ours, f"rank {rank}")


DANGLING_DIFFERENCE = known_difference(
    "under a root without parameters, after a grad-enabled forward whose output got no "
    "backward, torch's next backward all-gathers the first block once more right before "
    "its reduce-scatter (raf True/None: AG AG RS AG RS AG RS; False/1: RS RS AG RS); ours "
    "issues that all-gather once (AG AG RS AG RS RS) or not at all (RS RS RS), as in "
    "any other step; the grads are the same"
)


@pytest.mark.parametrize(
    "root_params",
    [
        pytest.param(True, id="root_params=True"),
        pytest.param(False, id="root_params=False", marks=DANGLING_DIFFERENCE),
    ],
)
@pytest.mark.parametrize("raf", COUNT, ids=_raf_id)
def test_collectives_after_a_forward_without_backward_match_torch(run, raf, root_params) -> None:
    case = f"dangling_forward-{_raf_id(raf)}-root_params={root_params}"
    for rank, (ours, theirs) in enumerate(side_records(run, case)):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            for key in ("forward", "backward"):
                assert mine[key] == torchs[key], f"rank {rank} step {step} {key}"


@pytest.mark.parametrize("value,recurse", SET_RAF, ids=[f"{v}-recurse={r}" for v, r in SET_RAF])
def test_set_reshard_after_forward_matches_torch(run, value, recurse) -> None:
    checked(run, f"set_raf-{value}-recurse={recurse}")


def test_manual_reshard_after_forward_matches_torch(run) -> None:
    for ours, _ in checked(run, "manual_reshard"):
        assert all(_count_kind(r["backward"], "all_gather") == 4 for r in ours)


@pytest.mark.parametrize(
    "raf,ac", TWO_FORWARDS, ids=[f"{_raf_id(r)}-ac={a}" for r, a in TWO_FORWARDS]
)
def test_two_forwards_one_backward_match_torch(run, raf, ac) -> None:
    checked(run, f"two_forwards-{_raf_id(raf)}-ac={ac}")


@pytest.mark.parametrize("direction,count", PREFETCH, ids=[f"{d}-{c}" for d, c in PREFETCH])
def test_explicit_prefetch_matches_torch(run, direction, count) -> None:
    checked(run, f"{direction}_prefetch-{count}")


def test_backward_misprefetch_matches_torch(run) -> None:
    checked(run, "misprefetch")


@pytest.mark.parametrize("explicit", [False, True], ids=lambda e: f"explicit={e}")
def test_backward_prefetch_inside_activation_checkpointing_matches_torch(run, explicit) -> None:
    checked(run, f"prefetch_inside_ac-explicit={explicit}")


def test_list_groups_backward_prefetch_matches_torch(run) -> None:
    checked(run, "list_groups")


def test_list_groups_with_a_module_that_never_runs_match_torch(run) -> None:
    for rank, (ours, _) in enumerate(checked(run, "list_group_unused")):
        assert all(r["grads"]["0.unused.weight"] is None for r in ours), f"rank {rank}"


def test_unshard_called_in_forward_matches_torch(run) -> None:
    checked(run, "user_unshard")


@pytest.mark.parametrize("paramless", [False, True], ids=lambda p: f"paramless_root={p}")
def test_unshard_before_the_first_forward_matches_torch(run, paramless) -> None:
    checked(run, f"unshard_first-paramless_root={paramless}")
