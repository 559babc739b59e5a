"""Autograd corner cases, torch's ``test_fully_shard_autograd.py`` family and beyond, on
torch's ``fully_shard`` and ours on 2 gloo ranks (one spawn; ``_side_by_side.py``).

Each case is a way the autograd graph around FSDP's hooks can differ from a plain
``model(x).sum().backward()``; each is where a lifecycle change can drop a gradient
without an error. Per training step both sides record the loss, the collectives of
forward and backward (c10d level), every local grad (``None`` included) and every
local shard after an Adam step, compared bitwise:

- ``unused_output``: a module returns two outputs; the loss uses both for two steps,
  then only the first (torch's ``test_unused_forward_output``), per
  ``reshard_after_forward`` True, False and 1 (a post-forward mesh of one rank);
- ``unused_module``: a sharded module that the forward never runs (torch's
  ``test_unused_forward_module``);
- ``container``: activations between sharded blocks wrapped in a list, tuple,
  namedtuple, dict, dataclass or nested dataclass, next to non-tensor fields (a string,
  an int, an integer tensor), in fp32 and with bf16 compute (torch's
  ``test_nontensor_activations`` and ``test_structured_input_output``);
- ``views``: blocks whose outputs are views (``view``, transpose, slice) of their results;
- ``inplace``: the root modifies a sharded block's output in place (whole and through
  a slice) before the next block reads it;
- ``passthrough``: a block returns its own input next to its result;
- ``reused``: one sharded module run twice in a forward (torch's
  ``test_multi_forward_module``);
- ``retain_graph``: two losses from one forward, backpropagated one after the other with
  ``retain_graph`` and ``set_is_last_backward`` (torch's backward-prefetch case of a
  forward whose two branches are used in separate backwards);
- ``eval_between``: ``no_grad`` and ``inference_mode`` forwards between training steps
  (their outputs compared too);
- ``weight_outside``: a sharded module whose output is dropped while the root uses its
  weight directly (``reshard_after_forward=False`` keeps it registered unsharded): no
  hook of that module fires in backward, and only the end-of-backward callback can
  reduce the weight's gradient.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tests._c10d import C10dRecorder
from tests.runtime.scenarios._containers import KINDS, ContainerModel
from tests.runtime.scenarios._side_by_side import (
    Side,
    assert_same,
    cases_fixture,
    checked,
    collectives,
    known_difference,
    local_grads,
    local_shards,
    rank_input,
    side_records,
    train,
)

DIM, ROWS, STEPS = 8, 4, 3
RESHARD = (True, False, 1)


def _raf_id(raf: bool | int) -> str:
    return f"raf={raf}"


# ---------------------------------------------------------------------------
# Unused outputs and modules
# ---------------------------------------------------------------------------


class Branches(nn.Module):
    """Two Linears on the same input; ``both=False`` runs only the first."""

    def __init__(self, both: bool) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)
        self.both = both

    def forward(self, x: torch.Tensor) -> Any:
        out_a = self.a(x).relu()
        return (out_a, self.b(x).relu()) if self.both else out_a


def _unused_output(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    torch.manual_seed(42)
    model = Branches(both=True)
    side.fully_shard(model.a, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)  # the root holds b

    def loss(step: int) -> torch.Tensor:
        out_a, out_b = model(rank_input(step, ROWS, DIM))
        # b's output stops counting after two steps: its grads are no longer produced.
        return (out_a * out_b).sum() if step < 2 else out_a.sum()

    return train(model, STEPS + 1, loss)


def _unused_module(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    torch.manual_seed(42)
    model = Branches(both=False)
    for module in (model.a, model.b, model):
        side.fully_shard(module, mesh=mesh, reshard_after_forward=raf)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).sum())


# ---------------------------------------------------------------------------
# Activations inside containers, next to non-tensor values
# ---------------------------------------------------------------------------


def _container(side: Side, mesh: DeviceMesh, kind: str, raf: bool, bf16: bool) -> list[dict]:
    torch.manual_seed(42)
    model = ContainerModel(kind)
    # bf16 compute with an fp32 reduction: the same arithmetic on both sides.
    policy = (
        side.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else side.MixedPrecisionPolicy()
    )
    for block in model.blocks:
        side.fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=raf)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)))


# ---------------------------------------------------------------------------
# Views, in-place ops on outputs, an input passed through
# ---------------------------------------------------------------------------


class ViewBlock(nn.Module):
    """A Linear whose output leaves as a view: ``(B, D) -> (B, 2, D/2)``, transposed, or
    the first D/2 columns of a (B, 2D) result."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.lin = nn.Linear(DIM, 2 * DIM if how == "slice" else DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x.reshape(-1, DIM) if x.dim() == 3 else x)
        if self.how == "view":
            return out.view(-1, 2, DIM // 2)  # (B, 2, D/2)
        if self.how == "transpose":
            return out.t()  # (D, B)
        return out[:, :DIM]  # (B, D) of (B, 2D)


class ViewModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(ViewBlock(how) for how in ("view", "slice", "transpose"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.stem(x))  # (B, 2, D/2)
        h = self.blocks[1](h.reshape(-1, DIM))  # (B, D)
        return self.blocks[2](h).t().relu().sum()  # (D, B) -> (B, D)


class InplaceModel(nn.Module):
    """Each block's output is changed in place by the root before the next block: whole
    (``mul_``) and through a slice (``add_`` on the first columns)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for index, block in enumerate(self.blocks):
            h = block(h)
            if index % 2 == 0:
                h.mul_(0.5)
            else:
                h[:, : DIM // 2].add_(1.0)
            h = h.tanh()
        return h.sum()


class Passthrough(nn.Module):
    """Returns its input beside its result: the input is also one of its outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.lin(x).relu()


class PassthroughModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Passthrough() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            same, out = block(h)
            h = same * out
        return h.sum()


ROOTED = {"views": ViewModel, "inplace": InplaceModel, "passthrough": PassthroughModel}


def _blocks_then_root(
    side: Side, mesh: DeviceMesh, model_cls: Callable[[], nn.Module], raf: bool | int
) -> list[dict]:
    torch.manual_seed(42)
    model = model_cls()
    for block in model.blocks:
        side.fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)))


# ---------------------------------------------------------------------------
# A module run twice; two backwards of one forward
# ---------------------------------------------------------------------------


class Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(DIM, DIM)
        self.outer = nn.Linear(DIM, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(self.inner(x) + self.inner(x.flip(0)).relu())


def _reused(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    torch.manual_seed(42)
    model = Reused()
    side.fully_shard(model.inner, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)).sum())


def _retain_graph(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    """``stem -> Branches``: backward through ``b``'s output first (``retain_graph``,
    not the last backward), then through ``a``'s; ``stem`` gets grads from both."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(DIM, DIM), Branches(both=True))
    for module in (model[0], model[1].a, model[1].b, model):
        side.fully_shard(module, mesh=mesh, reshard_after_forward=raf)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    for step in range(STEPS):
        with C10dRecorder() as recorder:
            out_a, out_b = model(rank_input(step, ROWS, DIM))
            model.set_is_last_backward(False)
            out_b.sum().backward(retain_graph=True)
            first = local_grads(model)
            model.set_is_last_backward(True)
            out_a.sum().backward()
        steps.append({"after_first": first, "grads": local_grads(model)})
        steps[-1]["collectives"] = collectives(recorder)
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        steps[-1]["shards"] = local_shards(model)
    return steps


# ---------------------------------------------------------------------------
# Evaluation forwards between training steps
# ---------------------------------------------------------------------------


def _eval_between(side: Side, mesh: DeviceMesh, raf: bool | int) -> list[dict]:
    torch.manual_seed(42)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()) for _ in range(3)))
    for block in model:
        side.fully_shard(block, mesh=mesh, reshard_after_forward=raf)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=raf)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    steps = []
    for step in range(STEPS):
        model(rank_input(step, ROWS, DIM)).sum().backward()
        record = {"grads": local_grads(model)}
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        with torch.no_grad():
            record["no_grad_out"] = model(rank_input(100 + step, ROWS, DIM))
        with torch.inference_mode():
            record["inference_out"] = model(rank_input(200 + step, ROWS, DIM)).clone()
        record["shards"] = local_shards(model)
        steps.append(record)
    return steps


class WeightOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(DIM, DIM)
        self.aux = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        self.aux(h.detach())  # run, its output dropped
        return (h @ self.aux.weight.t()).tanh().sum()  # the unsharded weight, used here


def _weight_outside(side: Side, mesh: DeviceMesh) -> list[dict]:
    torch.manual_seed(42)
    model = WeightOutside()
    side.fully_shard(model.aux, mesh=mesh, reshard_after_forward=False)
    side.fully_shard(model, mesh=mesh, reshard_after_forward=False)
    return train(model, STEPS, lambda step: model(rank_input(step, ROWS, DIM)))


# ---------------------------------------------------------------------------
# The spawn
# ---------------------------------------------------------------------------

CASES: dict[str, Callable[[Side, DeviceMesh], Any]] = {"weight_outside": _weight_outside}
for _raf in RESHARD:
    CASES[f"unused_output-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _unused_output(s, m, r)
    CASES[f"unused_module-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _unused_module(s, m, r)
    CASES[f"reused-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _reused(s, m, r)
    for _name, _cls in ROOTED.items():
        CASES[f"{_name}-{_raf_id(_raf)}"] = lambda s, m, c=_cls, r=_raf: _blocks_then_root(
            s, m, c, r
        )
for _raf in (True, False):
    CASES[f"retain_graph-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _retain_graph(s, m, r)
    CASES[f"eval_between-{_raf_id(_raf)}"] = lambda s, m, r=_raf: _eval_between(s, m, r)
CONTAINER_CASES = [(kind, raf, False) for kind in KINDS for raf in (True, False)] + [
    (kind, True, True) for kind in ("namedtuple", "dict", "nested_dataclass")
]


def _container_id(kind: str, raf: bool, bf16: bool) -> str:
    return f"container-{kind}-{_raf_id(raf)}-bf16={bf16}"


for _case in CONTAINER_CASES:
    CASES[_container_id(*_case)] = lambda s, m, c=_case: _container(s, m, *c)


run = cases_fixture(__name__)


@pytest.mark.parametrize("raf", RESHARD, ids=_raf_id)
def test_unused_forward_output_matches_torch(run, raf) -> None:
    checked(run, f"unused_output-{_raf_id(raf)}")


@pytest.mark.parametrize("raf", RESHARD, ids=_raf_id)
def test_unused_forward_module_matches_torch(run, raf) -> None:
    for rank, (ours, _) in enumerate(checked(run, f"unused_module-{_raf_id(raf)}")):
        assert all(step["grads"]["b.weight"] is None for step in ours), f"rank {rank}"


@pytest.mark.parametrize(
    "kind,raf,bf16", CONTAINER_CASES, ids=[_container_id(*c) for c in CONTAINER_CASES]
)
def test_activations_in_containers_match_torch(run, kind, raf, bf16) -> None:
    for rank, (ours, _) in enumerate(checked(run, _container_id(kind, raf, bf16))):
        # Every block's two Linears get grads: no container field loses its hook.
        assert all(g is not None for g in ours[0]["grads"].values()), f"rank {rank}"


@pytest.mark.parametrize("name", list(ROOTED))
@pytest.mark.parametrize("raf", RESHARD, ids=_raf_id)
def test_views_inplace_and_passthrough_outputs_match_torch(run, name, raf) -> None:
    for rank, (ours, _) in enumerate(checked(run, f"{name}-{_raf_id(raf)}")):
        assert all(g is not None for g in ours[0]["grads"].values()), f"rank {rank}"


@pytest.mark.parametrize("raf", RESHARD, ids=_raf_id)
def test_module_run_twice_in_one_forward_matches_torch(run, raf) -> None:
    checked(run, f"reused-{_raf_id(raf)}")


@pytest.mark.parametrize("raf", [True, False], ids=_raf_id)
def test_two_backwards_of_one_forward_grads_match_torch(run, raf) -> None:
    for rank, (ours, theirs) in enumerate(side_records(run, f"retain_graph-{_raf_id(raf)}")):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            where = f"rank {rank} step {step}"
            assert_same(mine["grads"], torchs["grads"], f"{where} grads")
            assert_same(mine["shards"], torchs["shards"], f"{where} shards")
            # The second backward adds a's grads and more of stem's to the first's.
            assert mine["grads"]["0.weight"] is not None, where
            assert mine["grads"]["1.a.weight"] is not None, where


RETAIN_GRAPH_COLLECTIVES = {
    True: "ours all-gathers the stem (its backward needs no weight: the input needs no "
    "grad) again in the second backward, where torch's reduces it without one: 4 "
    "collectives in that backward (AG, RS, AG, RS), torch's 3 (AG, RS, RS)",
    False: "the second backward re-gathers a and the stem on both, in another order: "
    "torch's prefetches the stem while a computes (AG, AG, RS, RS), ours gathers it after "
    "reducing a (AG, RS, AG, RS)",
}


@pytest.mark.parametrize(
    "raf",
    [
        pytest.param(r, marks=known_difference(RETAIN_GRAPH_COLLECTIVES[r]), id=_raf_id(r))
        for r in (True, False)
    ],
)
def test_two_backwards_of_one_forward_collectives_match_torch(run, raf) -> None:
    for rank, (ours, theirs) in enumerate(side_records(run, f"retain_graph-{_raf_id(raf)}")):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            assert mine["collectives"] == torchs["collectives"], f"rank {rank} step {step}"


@pytest.mark.parametrize("raf", [True, False], ids=_raf_id)
def test_grads_between_two_backwards_are_registered_like_torch(run, raf) -> None:
    for rank, (ours, theirs) in enumerate(side_records(run, f"retain_graph-{_raf_id(raf)}")):
        for step, (mine, torchs) in enumerate(zip(ours, theirs, strict=True)):
            assert_same(mine["after_first"], torchs["after_first"], f"rank {rank} step {step}")


@pytest.mark.parametrize("raf", [True, False], ids=_raf_id)
def test_eval_forwards_between_steps_match_torch(run, raf) -> None:
    checked(run, f"eval_between-{_raf_id(raf)}")


def test_weight_used_outside_its_module_matches_torch(run) -> None:
    for rank, (ours, _) in enumerate(checked(run, "weight_outside")):
        assert all(step["grads"]["aux.weight"] is not None for step in ours), f"rank {rank}"
