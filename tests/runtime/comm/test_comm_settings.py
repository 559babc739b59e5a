"""torch 2.13's communication setters on ``FSDPModule``, on torch's ``fully_shard`` and on
ours, 2 gloo ranks, the 3-group MLP of test_comm.py:

- ``set_separate_reduce_scatter_group``: counted at the c10d level, per process group,
  over two training steps: every gradient reduction runs on one new process group over
  the shard ranks (torch's ``reduce_scatter_tensor``, our all-to-all), every all-gather
  stays on the shard group; one group for the whole tree when set on the root,
  ``recurse=False`` sets one module, a second call keeps the group, ``False`` reverts.
  Gradients and parameters bitwise equal to torch's.
- ``set_allocate_memory_from_process_group_for_comm`` and ``set_symm_mem_for_comm``:
  both install torch's strategies; training is bitwise torch's (gloo has no allocator
  of its own, so both allocations fall back to the usual one; this CPU build refuses
  symmetric memory, with torch's error).
- ``set_all_reduce_hook(hook, stream=)``: on the host the stream changes nothing; the
  hook scales the reduced gradients exactly as torch's does. A non-linear hook sees
  what torch's sees: the averaged gradients, or with
  ``set_force_sum_reduction_for_comms(True)`` the sums (divided after the hook).

The refusals are in tests/runtime/comm/test_setter_errors.py; the hook's stream on an accelerator in
tests/runtime/streams/test_streams.py.
"""

import contextlib
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import assert_pairs_equal, local_pairs
from tests._pool import GlooPools

WORLD_SIZE = 2
STEPS = 2
IMPLS = {"ours": fully_shard, "torch": torch_fully_shard}
REDUCTIONS = ("reduce_scatter", "all_to_all")  # torch's on gloo, ours on gloo


def _step(model: torch.nn.Module, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
    F.mse_loss(model(x), y).backward()


def _train(
    models: dict[str, torch.nn.Module], rank: int, recorders: dict[str, C10dRecorder] | None = None
) -> list[dict[str, Any]]:
    """STEPS SGD steps of each model (its collectives into ``recorders[impl]``, if
    given); per step, local grads and then shards, (ours, torch's) per FQN."""
    optims = {impl: torch.optim.SGD(m.parameters(), lr=0.1) for impl, m in models.items()}
    records = []
    for step in range(STEPS):
        for impl, model in models.items():
            with recorders[impl] if recorders else contextlib.nullcontext():
                _step(model, rank, step)
        grads = local_pairs(models["ours"], models["torch"], grads=True)
        for optim in optims.values():
            optim.step()
            optim.zero_grad()
        params = local_pairs(models["ours"], models["torch"], grads=False)
        records.append({"grads": grads, "params": params})
    return records


def _reduce_scatter_groups(model: torch.nn.Module, impl: str) -> list[Any]:
    """Each group's reduce-scatter process group, blocks first, then the root."""
    modules = (model[0], model[2], model)
    if impl == "torch":
        infos = [m._get_fsdp_state()._fsdp_param_groups[0].mesh_info for m in modules]
        return [info.reduce_scatter_process_group or info.shard_process_group for info in infos]
    return [m._get_fsdp_state().groups[0].reduction.reduce_scatter_group for m in modules]


def _separate_group(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    base = mlp()
    models = {impl: shard_mlp(copy.deepcopy(base), mesh, shard=s) for impl, s in IMPLS.items()}
    shard_group = mesh.get_group(0)
    out: dict[str, Any] = {"groups": {}, "collectives": {}}
    for impl, model in models.items():
        model[2].set_separate_reduce_scatter_group(recurse=False)
        only_block_2 = _reduce_scatter_groups(model, impl)
        # The root's group is visited first and makes the call's one new group, which
        # block 2 then takes too (torch reuses an existing group only for the first).
        model.set_separate_reduce_scatter_group()
        separate = _reduce_scatter_groups(model, impl)
        model.set_separate_reduce_scatter_group()  # again: the root's group is kept
        again = _reduce_scatter_groups(model, impl)
        out["groups"][impl] = {
            "only_block_2": [g is shard_group for g in only_block_2],
            "one_group": all(g is separate[0] for g in separate),
            "block_2_regrouped": separate[1] is not only_block_2[1],
            "kept": all(a is b for a, b in zip(again, separate, strict=True)),
            "ranks": separate[0].size(),
            "desc": separate[0].group_desc,
        }
        out["separate_name", impl] = separate[0].group_name
    recorders = {impl: C10dRecorder() for impl in models}
    records = _train(models, rank, recorders)
    out["collectives"] = {impl: r.by_group() for impl, r in recorders.items()}
    for impl, model in models.items():
        model.set_separate_reduce_scatter_group(False)
        out["groups"][impl]["reverted"] = all(
            g is shard_group for g in _reduce_scatter_groups(model, impl)
        )
    out["records"] = records
    out["shard_name"] = shard_group.group_name
    return out


def _accepted_setters(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    """The NCCL-only setters on both: symmetric memory refused by this CPU build (the
    same error), the process group's allocator installed (gloo has none: the usual
    allocation, the same training)."""
    base = mlp()
    models = {impl: shard_mlp(copy.deepcopy(base), mesh, shard=s) for impl, s in IMPLS.items()}
    errors = {}
    for impl, model in models.items():
        modules = (model, model[0], model[2]) if impl == "ours" else (model,)
        for module in modules:
            try:
                module.set_symm_mem_for_comm()
                errors[impl] = None
            except RuntimeError as error:
                errors[impl] = str(error).splitlines()[0]
            module.set_allocate_memory_from_process_group_for_comm(True)
    return {"symm_mem_errors": errors, "records": _train(models, rank)}


def _hook_with_stream(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    base = mlp()
    models = {impl: shard_mlp(copy.deepcopy(base), mesh, shard=s) for impl, s in IMPLS.items()}
    calls: dict[str, int] = {impl: 0 for impl in IMPLS}
    for impl, model in models.items():

        def hook(reduced: torch.Tensor, impl: str = impl) -> None:
            calls[impl] += 1
            reduced.mul_(3)

        for module in (model, model[0], model[2]):
            module.set_all_reduce_hook(hook, stream=torch.cpu.Stream())
    return {"calls": calls, "records": _train(models, rank)}


def _hook_values(rank: int, mesh: DeviceMesh, force_sum: bool) -> dict[str, Any]:
    """What a non-linear all-reduce hook sees: the mean (torch divides inside the
    collective) or, with sum-only reductions, the sum (torch divides after the hook)."""
    base = mlp()
    models = {impl: shard_mlp(copy.deepcopy(base), mesh, shard=s) for impl, s in IMPLS.items()}
    seen: dict[str, list[torch.Tensor]] = {impl: [] for impl in IMPLS}
    for impl, model in models.items():

        def hook(reduced: torch.Tensor, impl: str = impl) -> None:
            seen[impl].append(reduced.clone())
            reduced.copy_(reduced.abs().sqrt())  # not linear: the order matters

        for module in (model, model[0], model[2]):
            module.set_force_sum_reduction_for_comms(force_sum)
            module.set_all_reduce_hook(hook)
    return {"seen": seen, "records": _train(models, rank)}


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            "separate_group": lambda: _separate_group(rank, mesh),
            "accepted_setters": lambda: _accepted_setters(rank, mesh),
            "hook_with_stream": lambda: _hook_with_stream(rank, mesh),
            "hook_values": lambda: _hook_values(rank, mesh, force_sum=False),
            "hook_values_force_sum": lambda: _hook_values(rank, mesh, force_sum=True),
        }
    )


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, timeout=120, pool=gloo_pool)


def _assert_bitwise(records: list[dict[str, Any]], rank: int) -> None:
    # The same fp32 arithmetic and reductions of 2 terms on both sides: bitwise.
    for step, rec in enumerate(records):
        assert_pairs_equal(rec["grads"], f"rank {rank} step {step} local grad vs torch")
        assert_pairs_equal(rec["params"], f"rank {rank} step {step} local shard vs torch")


def test_separate_reduce_scatter_group_moves_every_reduction_like_torchs(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "separate_group")):
        ours, theirs = rec["groups"]["ours"], rec["groups"]["torch"]
        assert theirs == {
            "only_block_2": [True, False, True],
            "one_group": True,
            "block_2_regrouped": True,
            "kept": True,
            "ranks": WORLD_SIZE,
            "desc": "fsdp_reduce_scatter",
            "reverted": True,
        }, f"torch's premise: {theirs}"
        assert ours == theirs, f"rank {rank}"
        for impl in ("ours", "torch"):
            per_group = rec["collectives"][impl]
            separate = per_group.pop(rec["separate_name", impl])
            shard = per_group.pop(rec["shard_name"])
            # 3 groups x STEPS: every reduction on the new group, nothing else there;
            # every all-gather (3 forward + 2 backward per step) on the shard group.
            assert len(separate) == 3 * STEPS and set(separate) <= set(REDUCTIONS), (impl, separate)
            assert shard == ["all_gather"] * 5 * STEPS, (impl, shard)
            assert per_group == {}, (impl, per_group)
        _assert_bitwise(rec["records"], rank)


def test_process_group_and_symmetric_memory_allocation_as_torchs(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "accepted_setters")):
        errors = rec["symm_mem_errors"]
        assert errors["torch"] == "SymmetricMemory does not find allocation backend NCCL", errors
        assert errors["ours"] == errors["torch"], errors
        _assert_bitwise(rec["records"], rank)


def test_all_reduce_hook_with_a_stream_on_the_host(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "hook_with_stream")):
        assert rec["calls"] == {"ours": 3 * STEPS, "torch": 3 * STEPS}, f"rank {rank}"
        _assert_bitwise(rec["records"], rank)


@pytest.mark.parametrize("scenario", ["hook_values", "hook_values_force_sum"])
def test_all_reduce_hook_sees_what_torchs_sees(run, scenario) -> None:
    for rank, rec in enumerate(scenario_records(run, scenario)):
        ours, theirs = rec["seen"]["ours"], rec["seen"]["torch"]
        assert len(ours) == len(theirs) == 3 * STEPS, f"rank {rank}"
        # Sums and means of 2 fp32 terms: the same bits on both sides.
        for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            assert torch.equal(a, b), f"rank {rank} call {i}: the hook saw other values"
        _assert_bitwise(rec["records"], rank)
