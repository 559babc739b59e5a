"""Ways of building a sharded model, torch's ``test_fully_shard_init.py`` family (its
user-visible parts), on torch's ``fully_shard`` and ours on 2 gloo ranks (one spawn;
``_side_by_side.py``).

Each case builds the model one way, records every local shard right after
initialization, then trains (loss, c10d collectives, every local grad, every local
shard after each Adam step), compared bitwise:

- ``meta``: built on the meta device, sharded there, ``to_empty`` then
  ``reset_parameters`` on the sharded parameters, for dims 8 (even shards), 3 (uneven)
  and 1 (rank 1's shard of a 1-row weight is empty), fp32 and bf16 compute (torch's
  ``test_meta_device_1d_init``);
- ``shared_module``: one Linear used at two places of the model, sharded once (torch's
  ``test_shard_tensor_parameters`` with ``model[0].in_proj = model[1].in_proj``);
- ``from_group``: the mesh made from a process group with ``DeviceMesh.from_group``
  (torch's ``test_1d_process_group_init``);
- ``shard_dim_neg1``: ``shard_placement_fn`` returning ``Shard(-1)`` (torch's
  ``test_init_1d_transformer_shard_dim_neg1``);
- ``mixed_dtypes``: a frozen bf16 parameter next to trainable fp32 ones in one group
  (torch's ``test_mixed_dtypes_no_grad_param``, with a forward that uses both);
- ``container_forward``: ``fully_shard`` on ``nn.ModuleDict``/``nn.ModuleList``
  subclasses that define ``forward`` (torch's ``TestFullyShardContainerSubclasses``).
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from tests.runtime.scenarios._side_by_side import (
    Side,
    cases_fixture,
    checked,
    local_shards,
    rank_input,
    train,
)

ROWS, STEPS = 4, 3


class Mlp(nn.Module):
    def __init__(self, dim: int, bias: bool = True, with_buffer: bool = False) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim, bias=bias)
        self.out_proj = nn.Linear(dim, dim, bias=bias)
        if with_buffer:
            self.register_buffer("scale", torch.ones(dim))
        self.with_buffer = with_buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.out_proj(self.in_proj(x).tanh())  # tanh: no dead unit at dim 1
        return x * self.scale if self.with_buffer else x


def _built(model: nn.Module, dim: int) -> dict:
    """The shards as built, then training."""
    at_init = local_shards(model)
    steps = train(model, STEPS, lambda step: model(rank_input(step, ROWS, dim)).float().sum())
    return {"at_init": at_init, "steps": steps}


def _meta(side: Side, mesh: DeviceMesh, dim: int, bf16: bool) -> dict:
    policy = (
        side.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if bf16
        else side.MixedPrecisionPolicy()
    )
    with torch.device("meta"):
        model = nn.Sequential(Mlp(dim, bias=False, with_buffer=True), Mlp(dim, bias=False))
        for module in (model[0], model[1], model):
            side.fully_shard(module, mesh=mesh, mp_policy=policy)
    model.to_empty(device="cpu")
    torch.manual_seed(42)  # DTensor's random init of the shards: the same on both sides
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    model[0].scale.fill_(1.0)
    return _built(model, dim)


def _shared_module(side: Side, mesh: DeviceMesh) -> dict:
    torch.manual_seed(42)
    model = nn.Sequential(Mlp(3), Mlp(3), Mlp(3))  # odd dims: uneven shards
    model[0].in_proj = model[1].in_proj
    side.fully_shard(model, mesh=mesh)
    return _built(model, 3)


def _from_group(side: Side, mesh: DeviceMesh) -> dict:
    group_mesh = DeviceMesh.from_group(dist.group.WORLD, "cpu", mesh_dim_names=("dp",))
    torch.manual_seed(42)
    model = Mlp(8)
    for module in (model.in_proj, model.out_proj, model):
        side.fully_shard(module, mesh=group_mesh)
    return _built(model, 8)


def _shard_dim_neg1(side: Side, mesh: DeviceMesh) -> dict:
    torch.manual_seed(42)
    model = nn.Sequential(Mlp(8), Mlp(8))
    for module in (model[0], model[1], model):
        side.fully_shard(module, mesh=mesh, shard_placement_fn=lambda p: Shard(-1))
    record = _built(model, 8)
    record["placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
    return record


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16), requires_grad=False)
        self.trained = nn.Parameter(torch.randn(8, 8))
        self.bias = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.trained + (x.bfloat16() @ self.frozen).float() + self.bias


def _mixed_dtypes(side: Side, mesh: DeviceMesh) -> dict:
    torch.manual_seed(42)
    model = MixedDtypes()
    side.fully_shard(model, mesh=mesh)
    return _built(model, 8)


class DictWithForward(nn.ModuleDict):
    def __init__(self) -> None:
        super().__init__({"a": nn.Linear(8, 8), "b": nn.Linear(8, 8)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self["b"](self["a"](x).relu())


class ListWithForward(nn.ModuleList):
    def __init__(self) -> None:
        super().__init__([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self:
            x = module(x).tanh()
        return x


def _container_forward(side: Side, mesh: DeviceMesh, cls: type) -> dict:
    torch.manual_seed(42)
    model = cls()
    side.fully_shard(model, mesh=mesh)
    return _built(model, 8)


META = [(dim, bf16) for dim in (8, 3, 1) for bf16 in (False, True)]
CASES: dict[str, Callable[[Side, DeviceMesh], Any]] = {
    "shared_module": _shared_module,
    "from_group": _from_group,
    "shard_dim_neg1": _shard_dim_neg1,
    "mixed_dtypes": _mixed_dtypes,
}
for _dim, _bf16 in META:
    CASES[f"meta-dim={_dim}-bf16={_bf16}"] = lambda s, m, d=_dim, b=_bf16: _meta(s, m, d, b)
for _cls in (DictWithForward, ListWithForward):
    CASES[f"container_forward-{_cls.__name__}"] = lambda s, m, c=_cls: _container_forward(s, m, c)


run = cases_fixture(__name__)


@pytest.mark.parametrize("dim,bf16", META, ids=[f"dim={d}-bf16={b}" for d, b in META])
def test_meta_device_init_then_training_matches_torch(run, dim, bf16) -> None:
    pairs = checked(run, f"meta-dim={dim}-bf16={bf16}")
    if dim == 1:  # rank 1 holds empty shards of the 1-row weights, and trains nothing
        assert all(t.numel() == 0 for t in pairs[1][0]["at_init"].values())


def test_module_shared_by_two_parents_matches_torch(run) -> None:
    checked(run, "shared_module")


def test_mesh_from_a_process_group_matches_torch(run) -> None:
    checked(run, "from_group")


def test_negative_shard_dim_matches_torch(run) -> None:
    for ours, _ in checked(run, "shard_dim_neg1"):
        assert all("Shard(dim=1)" in p or "Shard(dim=0)" in p for p in ours["placements"].values())


def test_frozen_bf16_param_beside_fp32_ones_matches_torch(run) -> None:
    for ours, _ in checked(run, "mixed_dtypes"):
        assert all(step["grads"]["frozen"] is None for step in ours["steps"])


@pytest.mark.parametrize("cls", ["DictWithForward", "ListWithForward"])
def test_module_dict_and_list_subclasses_with_forward_match_torch(run, cls) -> None:
    checked(run, f"container_forward-{cls}")
