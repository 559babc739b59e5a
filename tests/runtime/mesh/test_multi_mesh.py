"""One ``fully_shard`` call over two data-parallel meshes (``shard_placement_fn``
returning torch's ``ShardPlacementResult``), on 4 gloo ranks, against torch's
``fully_shard`` on the same scenario.

The model is three blocks of a dense part and a grouped "experts" weight (E, D, D),
as torchtitan's MoE blocks have: the experts go to an expert mesh's ``efsdp`` axis
(2 ranks), the rest to the 4-rank ``dp`` mesh. Tokens are not dispatched (that is
tests/integrations/test_moe.py's job): this file checks FSDP's part, which both libraries
compute the same way, so every step of every scenario must agree with torch:

- the collectives at the c10d level, in issue order: kind, process group, bytes
  (torch makes one group per mesh in the call; its order of all-gathers, backward
  prefetches and reductions is what a profile shows and what ranks must agree on);
- losses, sharded grads and params: bitwise on the 2-rank expert group; on the 4-rank
  dense group ours sums the all-to-all's chunks in another order than gloo's
  reduce-scatter, so they agree within fp32 rounding of a 4-term sum;
- what a user sees after ``fully_shard``: placements, meshes, local shapes, groups.
"""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Shard
from torch.utils.checkpoint import checkpoint

from dtensor_fsdp import fully_shard as fully_shard_ours
from tests._c10d import C10dRecorder, ReduceScatterInputs
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import assert_pairs_close, local_pairs
from tests._pool import GlooPools

WORLD_SIZE = 4
DIM, EXPERTS, BATCH, STEPS = 8, 4, 3, 2
IN_FLIGHT_STEPS = 4


class Block(nn.Module):
    """A dense projection, ``EXPERTS`` expert matrices mixed evenly, a dense output."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(DIM, DIM)
        self.experts = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * 0.3)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.dense(x))
        h = torch.einsum("bd,edf->bf", h, self.experts) / EXPERTS
        return x + self.out(h)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(DIM, 3)
        # checkpoint(block) with reentrant checkpointing, which reruns each sharded
        # block's forward inside backward, before the block's pre-backward.
        self.reentrant = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if self.reentrant else block(x)
        return self.head(x)


def _shard(
    fully_shard: Callable[..., Any],
    model: Model,
    dp: DeviceMesh,
    efsdp: DeviceMesh,
    *,
    expert_dim: int = 0,
    reshard_after_forward: bool | int = True,
    explicit_prefetch: bool = False,
    sum_reduction: bool = False,
    empty_backward_prefetch: bool = False,
    root_reshards: bool = False,
    reentrant: bool = False,
) -> Model:
    """torchtitan's per-parameter mesh: experts on ``efsdp``, the rest on ``dp``, both
    through ``ShardPlacementResult`` with torch's mesh-info objects."""
    dp_info, efsdp_info = FSDPMeshInfo(dp, shard_mesh_dim=0), FSDPMeshInfo(efsdp, shard_mesh_dim=0)
    for block in model.blocks:

        def placement(param: nn.Parameter, experts: nn.Parameter = block.experts) -> Any:
            if param is experts:
                return ShardPlacementResult(Shard(expert_dim), efsdp_info)
            return ShardPlacementResult(Shard(0), dp_info)

        fully_shard(
            block, mesh=dp, reshard_after_forward=reshard_after_forward, shard_placement_fn=placement
        )
    fully_shard(model, mesh=dp)
    if explicit_prefetch:  # as torchtitan sets it when EP > 1
        blocks = list(model.blocks)
        for block, after in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([after])
        for block, before in zip(blocks[1:], blocks):
            block.set_modules_to_backward_prefetch([before])
    model.reentrant = reentrant
    if empty_backward_prefetch:  # an empty list: the implicit prefetch, as torch's
        for block in model.blocks:
            block.set_modules_to_backward_prefetch([])
    if root_reshards:  # before the first forward: the root does not keep its params
        model.set_reshard_after_forward(True, recurse=False)
    if sum_reduction:  # torchtitan's disable_fsdp_gradient_division
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    return model


def _collectives(recorder: C10dRecorder, roles: dict[str, str]) -> list[tuple[str, str, int]]:
    """(kind, mesh axis, bytes) in issue order; a reduction is a reduction whether
    torch's reduce_scatter or ours (an all-to-all on gloo) carries it. Any other
    group is one each library made itself: hpZ's post-forward groups."""
    kinds = {"all_to_all": "reduce_scatter"}
    return [
        (kinds.get(kind, kind), roles.get(group, "own"), size)
        for (kind, size), group in zip(recorder.records, recorder.groups, strict=True)
    ]


def _train(rank: int, dp: DeviceMesh, efsdp: DeviceMesh, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Model()
    models = {
        name: _shard(shard, copy.deepcopy(base), dp, efsdp, **options)
        for name, shard in (("ours", fully_shard_ours), ("torch", torch_fully_shard))
    }
    optimizers = {n: torch.optim.SGD(m.parameters(), lr=0.1) for n, m in models.items()}
    roles = {dp.get_group().group_name: "dp", efsdp.get_group().group_name: "efsdp"}
    gen = torch.Generator().manual_seed(10 + rank)
    steps = []
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, 3, generator=gen)
        step: dict[str, Any] = {}
        for name, model in models.items():
            with C10dRecorder() as recorder:
                loss = F.mse_loss(model(x), y)
                loss.backward()
            step[name] = {"loss": loss.detach(), "comms": _collectives(recorder, roles)}
        step["grads"] = local_pairs(models["ours"], models["torch"], grads=True)
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        step["params"] = local_pairs(models["ours"], models["torch"], grads=False)
        steps.append(step)
    return {"steps": steps, "layout": _layouts(models)}


def _layouts(models: dict[str, Model]) -> dict[str, Any]:
    """What a user sees of each library's sharding: per parameter its mesh axis,
    placements and local shape, and the number of groups of each block."""
    out: dict[str, Any] = {}
    for name, model in models.items():
        params = {
            n: (p.device_mesh.mesh_dim_names, p.placements, tuple(p.to_local().shape))
            for n, p in model.named_parameters()
            if isinstance(p, DTensor)
        }
        if name == "ours":
            groups = [len(b._get_fsdp_state().groups) for b in model.blocks]
        else:
            groups = [len(torch_fully_shard.state(b)._fsdp_param_groups) for b in model.blocks]
        out[name] = {"params": params, "groups": groups}
    return out


def _reduce_scatters_in_flight(dp: DeviceMesh, efsdp: DeviceMesh) -> dict[str, list[int]]:
    """How many reductions are in flight at each reduce-scatter issued in one backward
    (default bound 1), counted at the c10d level as the reduce-scatter inputs alive: a
    block's two groups are bounded together, so its dense reduce-scatter overlaps its
    experts' one. The least per issue over a few steps: gloo's worker may drop a
    finished collective's input a moment after the wait returns."""
    torch.manual_seed(0)
    base = Model()
    out: dict[str, list[int]] = {}
    for name, shard in (("ours", fully_shard_ours), ("torch", torch_fully_shard)):
        model = _shard(shard, copy.deepcopy(base), dp, efsdp)
        x = torch.randn(BATCH, DIM)
        model(x).sum().backward()  # lazy init
        steps = []
        for _ in range(IN_FLIGHT_STEPS):
            model.zero_grad()
            with ReduceScatterInputs() as inputs:
                model(x).sum().backward()
            steps.append(inputs.alive)
        out[name] = [min(counts) for counts in zip(*steps, strict=True)]
    return out


def _unshard_and_state_dict(dp: DeviceMesh, efsdp: DeviceMesh) -> dict[str, Any]:
    """``unshard(async_op=True)`` of a two-group block registers every parameter of
    both groups unsharded; ``state_dict`` then reshards, and loads back."""
    torch.manual_seed(0)
    base = Model()
    out: dict[str, Any] = {}
    for name, shard in (("ours", fully_shard_ours), ("torch", torch_fully_shard)):
        model = _shard(shard, copy.deepcopy(base), dp, efsdp)
        handle = model.blocks[1].unshard(async_op=True)
        handle.wait()
        unsharded = {n: type(p).__name__ for n, p in model.blocks[1].named_parameters()}
        model.blocks[1].reshard()
        resharded = {n: type(p).__name__ for n, p in model.blocks[1].named_parameters()}
        state = model.state_dict()
        fresh = _shard(shard, copy.deepcopy(base), dp, efsdp)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fresh.load_state_dict(state)
        out[name] = {
            "unsharded": unsharded,
            "resharded": resharded,
            "state_dict": {k: (type(v).__name__, tuple(v.shape)) for k, v in state.items()},
            "loaded": all(
                torch.equal(a.to_local(), b.to_local())
                for a, b in zip(fresh.parameters(), model.parameters(), strict=True)
            ),
        }
    return out


def _run(rank: int, world_size: int) -> dict[str, Any]:
    dp = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    efsdp = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    return run_scenarios({
        "implicit": lambda: _train(rank, dp, efsdp),
        "shard1_experts": lambda: _train(rank, dp, efsdp, expert_dim=1),
        "explicit_prefetch": lambda: _train(rank, dp, efsdp, explicit_prefetch=True),
        "keep_after_forward": lambda: _train(rank, dp, efsdp, reshard_after_forward=False),
        "hpz": lambda: _train(rank, dp, efsdp, reshard_after_forward=2),
        "sum_reduction": lambda: _train(rank, dp, efsdp, sum_reduction=True),
        "empty_backward_prefetch": lambda: _train(rank, dp, efsdp, empty_backward_prefetch=True),
        "root_reshards": lambda: _train(rank, dp, efsdp, root_reshards=True),
        "reentrant_checkpoint": lambda: _train(rank, dp, efsdp, reentrant=True),
        "in_flight": lambda: _reduce_scatters_in_flight(dp, efsdp),
        "unshard_state_dict": lambda: _unshard_and_state_dict(dp, efsdp),
    })


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, pool=gloo_pool)


TRAINING = [
    "implicit", "shard1_experts", "explicit_prefetch", "keep_after_forward", "hpz",
    "sum_reduction", "empty_backward_prefetch", "root_reshards", "reentrant_checkpoint",
]


@pytest.mark.parametrize("scenario", TRAINING)
def test_collectives_in_torchs_order(run, scenario):
    for rank, records in enumerate(scenario_records(run, scenario)):
        for index, step in enumerate(records["steps"]):
            ours, theirs = step["ours"]["comms"], step["torch"]["comms"]
            assert ours == theirs, f"rank {rank} step {index}:\nours  {ours}\ntorch {theirs}"
            # Both meshes carry traffic: the experts' collectives run on efsdp.
            assert {"dp", "efsdp"} <= {axis for _, axis, _ in ours}
            assert ("own" in {axis for _, axis, _ in ours}) == (scenario == "hpz")


@pytest.mark.parametrize("scenario", TRAINING)
def test_training_matches_torch(run, scenario):
    for rank, records in enumerate(scenario_records(run, scenario)):
        for index, step in enumerate(records["steps"]):
            # fp32 rounding of the 4-rank dense reduction's summation order.
            assert_pairs_close(step["grads"], f"rank {rank} step {index} grad")
            assert_pairs_close(step["params"], f"rank {rank} step {index} param")
        # Before any dense parameter differs by that rounding (step 0), the loss and
        # the 2-rank experts' reduction (a sum of two: the same in any order) are equal.
        first = records["steps"][0]
        assert torch.equal(first["ours"]["loss"], first["torch"]["loss"])
        for name, (ours, theirs) in first["grads"].items():
            if name.endswith("experts"):
                assert torch.equal(ours, theirs), f"rank {rank} {name}"


@pytest.mark.parametrize("scenario", ["implicit", "shard1_experts"])
def test_layout_matches_torch(run, scenario):
    layout = scenario_records(run, scenario)[0]["layout"]
    assert layout["ours"] == layout["torch"]
    assert layout["ours"]["groups"] == [2, 2, 2]
    dim = 0 if scenario == "implicit" else 1
    assert layout["ours"]["params"]["blocks.0.experts"] == (
        ("efsdp",), (Shard(dim),), (EXPERTS // 2, DIM, DIM) if dim == 0 else (EXPERTS, DIM // 2, DIM)
    )


def test_reduce_scatters_in_flight_as_torchs(run):
    for records in scenario_records(run, "in_flight"):
        assert records["ours"] == records["torch"]
        # Per block: experts (1 in flight), then dense beside it (2); then the root.
        assert records["ours"] == [1, 2, 1, 2, 1, 2, 1]


def test_unshard_and_state_dict_cover_both_groups(run):
    for records in scenario_records(run, "unshard_state_dict"):
        assert records["ours"] == records["torch"]
        assert set(records["ours"]["unsharded"].values()) == {"Parameter"}
        assert records["ours"]["loaded"]
