"""``dcp.async_save`` of ``get_state_dict(model, optim)`` (issue 30 item 2), ours and
torch's ``fully_shard`` on the same model, seed and data, on gloo ranks.

torchtitan's async checkpointing takes this path: ``async_save`` stages (copies) the
state dict to host memory with torch's ``StateDictStager`` before it returns, then
writes in a thread while training goes on. Before the fix it raised on every rank
("Attempted to call copy_() on an invalid python storage.") for our sharded params:
every param after the first of a group is a view into the group's sharded buffer, and
the stager mistook such a DTensor for one with storage of its own (see [Note: state-dict
values own their storage] in ``io/state_dict.py``).

One run on 2 ranks trains ``K`` steps, saves the same state dict with ``dcp.save`` and
``dcp.async_save``, trains ``M`` more steps while the upload runs (the uninterrupted
run), then waits on the future. Runs on 1, 2 and 4 ranks resume fresh models from
each checkpoint (``dcp.load`` + ``set_state_dict``) and train the ``M`` steps again.
Checked bitwise, for each implementation and variant (plain, bf16 mixed precision, CPU
offload): the async resume equals the sync resume and the state at the save, params
and AdamW state; training after either resume is identical; at the save's world size it
continues exactly as the uninterrupted run. The root's ``Linear(16, 3)`` splits unevenly
(2 + 1 rows on 2 ranks, 1 + 1 + 1 + 0 on 4): padded shards, and an empty one.
"""

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import full, full_state
from tests._pool import GlooPools

SAVE_WORLD_SIZE = 2
LOAD_WORLD_SIZES = (1, 2, 4)
K, M = 2, 2  # steps before and after the checkpoint
GLOBAL_BATCH = 4  # rows per step, split evenly over 1, 2 or 4 ranks
IMPLS: dict[str, tuple[Callable[..., Any], type, type]] = {
    "ours": (fully_shard, MixedPrecisionPolicy, CPUOffloadPolicy),
    "torch": (torch_fully_shard, TorchMixedPrecisionPolicy, TorchCPUOffloadPolicy),
}
VARIANTS = ("plain", "bf16", "offload")
CASES = [(impl, variant) for impl in IMPLS for variant in VARIANTS]


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------


def _build(impl: str, variant: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    shard, mp_policy, offload_policy = IMPLS[impl]
    kwargs: dict[str, Any] = {}
    if variant == "bf16":
        kwargs["mp_policy"] = mp_policy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif variant == "offload":
        kwargs["offload_policy"] = offload_policy(pin_memory=False)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = shard_mlp(mlp(), mesh, shard=shard, **kwargs)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    """One AdamW step per global batch; each rank takes its rows, so the gradient (mean
    of the ranks' means over equal row counts) does not depend on the world size."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        rows = torch.randn(GLOBAL_BATCH, 8, generator=gen).chunk(world_size)[rank]  # (B/W, 8)
        model(rows).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _scenario_save(impl: str, variant: str, directory: str, pg: dist.ProcessGroup) -> dict:
    model, optimizer = _build(impl, variant)
    _train(model, optimizer, range(K))
    state_dict = _state_dict(model, optimizer)
    dcp.save(state_dict, checkpoint_id=os.path.join(directory, "sync"))
    # Its own process group: the upload's collectives run in a thread while training's
    # run on the default group (torchtitan does the same).
    future = dcp.async_save(
        state_dict, checkpoint_id=os.path.join(directory, "async"), process_group=pg
    )
    saved = full_state(model, optimizer)
    _train(model, optimizer, range(K, K + M))  # writes the params while the upload runs
    future.result()
    dist.barrier()  # every rank's files and rank 0's metadata are written
    return {"saved": saved, "uninterrupted": full_state(model, optimizer)}


def _scenario_resume(impl: str, variant: str, directory: str) -> dict:
    out = {}
    for source in ("sync", "async"):
        path = os.path.join(directory, source)
        if not os.path.exists(os.path.join(path, ".metadata")):
            # dcp.load would raise a CheckpointException, a BaseException that ends the
            # whole spawn instead of this scenario.
            raise FileNotFoundError(f"no checkpoint at {path}: its save failed")
        model, optimizer = _build(impl, variant)
        state_dict = _state_dict(model, optimizer)
        dcp.load(state_dict, checkpoint_id=path)
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state_dict["model"],
            optim_state_dict=state_dict["optim"],
        )
        loaded = full_state(model, optimizer)
        _train(model, optimizer, range(K, K + M))
        out[source] = {"loaded": loaded, "continued": full_state(model, optimizer)}
    return out


def _scenario_state_dict_values(impl: str) -> dict:
    """What a user sees of the state-dict values: the shards' own memory (a write into
    a value reaches the param, as ``dcp.load`` writes), and loads, ``assign=True`` too,
    that keep each of our groups in one storage (the all-gather reads it in place)."""
    model, _ = _build(impl, "plain")
    source, _ = _build(impl, "plain")
    with torch.no_grad():
        for value in source.parameters():
            value.add_(1.0)
    values = model.state_dict()
    params = dict(model.named_parameters())
    same_memory = all(
        values[k].to_local().data_ptr() == p.to_local().data_ptr() for k, p in params.items()
    )
    with torch.no_grad():
        for value in values.values():
            value.to_local().fill_(2.0)
    written_through = all(bool((full(p) == 2.0).all()) for p in params.values())
    model.load_state_dict(source.state_dict(), assign=True)
    loaded = all(
        torch.equal(full(p), full(q)) for p, q in zip(model.parameters(), source.parameters())
    )
    groups = (model[0], model[2], model[4])  # the root's group holds model[4]'s params
    storages = [
        len({p.to_local().untyped_storage().data_ptr() for p in group.parameters()})
        for group in groups
    ]
    return {
        "same_memory": same_memory,
        "written_through": written_through,
        "loaded": loaded,
        "storages": storages,
    }


def _case_dir(tmp: str, impl: str, variant: str) -> str:
    return os.path.join(tmp, f"{impl}_{variant}")


def _save_worker(rank: int, world_size: int, tmp: str) -> dict:
    pg = dist.new_group(backend="gloo")
    scenarios: dict[str, Callable[[], Any]] = {
        f"values/{impl}": (lambda i=impl: _scenario_state_dict_values(i)) for impl in IMPLS
    }
    for impl, variant in CASES:
        directory = _case_dir(tmp, impl, variant)
        scenarios[f"save/{impl}/{variant}"] = lambda i=impl, v=variant, d=directory: _scenario_save(
            i, v, d, pg
        )
        scenarios[f"resume/{impl}/{variant}"] = lambda i=impl, v=variant, d=directory: (
            _scenario_resume(i, v, d)
        )
    return run_scenarios(scenarios)


def _resume_worker(rank: int, world_size: int, tmp: str) -> dict:
    scenarios = {}
    for impl, variant in CASES:
        directory = _case_dir(tmp, impl, variant)
        scenarios[f"resume/{impl}/{variant}"] = lambda i=impl, v=variant, d=directory: (
            _scenario_resume(i, v, d)
        )
    return run_scenarios(scenarios)


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> dict[int, list[dict]]:
    # On the session's pool (2 and 4 ranks; 1 rank spawns): the upload's thread ends
    # with its future (torch's executor shuts down when the save is done), and a worker
    # that still finds it alive after the run retires, as for any run.
    tmp = str(tmp_path_factory.mktemp("async_save"))
    out = {
        SAVE_WORLD_SIZE: run_distributed(
            _save_worker, SAVE_WORLD_SIZE, tmp, timeout=300, pool=gloo_pool
        )
    }
    for world_size in LOAD_WORLD_SIZES:
        if world_size != SAVE_WORLD_SIZE:
            out[world_size] = run_distributed(
                _resume_worker, world_size, tmp, timeout=300, pool=gloo_pool
            )
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=f"{what}: {key}")


@pytest.mark.parametrize("impl,variant", CASES)
@pytest.mark.parametrize("world_size", LOAD_WORLD_SIZES)
def test_async_save_resumes_as_sync_save(
    runs: dict[int, list[dict]], impl: str, variant: str, world_size: int
) -> None:
    saved = scenario_records(runs[SAVE_WORLD_SIZE], f"save/{impl}/{variant}")
    resumed = scenario_records(runs[world_size], f"resume/{impl}/{variant}")
    for rank, record in enumerate(resumed):
        # Full tensors: every rank of either world sees the same values.
        _assert_equal(record["async"]["loaded"], saved[0]["saved"], f"rank {rank} async load")
        _assert_equal(record["sync"]["loaded"], saved[0]["saved"], f"rank {rank} sync load")
        _assert_equal(
            record["async"]["continued"], record["sync"]["continued"], f"rank {rank} training"
        )
        if world_size == SAVE_WORLD_SIZE:  # the same reduction order as the saving run
            _assert_equal(
                record["async"]["continued"], saved[rank]["uninterrupted"], f"rank {rank} resume"
            )


@pytest.mark.parametrize("variant", VARIANTS)
def test_ours_saves_what_torch_saves(runs: dict[int, list[dict]], variant: str) -> None:
    """The same model, seed and data: both implementations reach the same state, so the
    checkpoints they write (and resume from) hold the same values."""
    ours = scenario_records(runs[SAVE_WORLD_SIZE], f"save/ours/{variant}")
    theirs = scenario_records(runs[SAVE_WORLD_SIZE], f"save/torch/{variant}")
    for rank in range(SAVE_WORLD_SIZE):
        _assert_equal(ours[rank]["saved"], theirs[rank]["saved"], f"rank {rank} saved")


def test_state_dict_values_alias_the_shards(runs: dict[int, list[dict]]) -> None:
    """As torch's: each value is the shard's memory (no copy), so ``dcp.load`` into it
    writes the live param, and ``load_state_dict(assign=True)`` loads the values. Ours
    keeps every group's shards in one storage through it (the group's sharded buffer,
    which the all-gather reads in place); torch's gives each param its own."""
    for impl, per_group in (("ours", [1, 1, 1]), ("torch", [2, 2, 2])):
        for record in scenario_records(runs[SAVE_WORLD_SIZE], f"values/{impl}"):
            assert record == {
                "same_memory": True,
                "written_through": True,
                "loaded": True,
                "storages": per_group,
            }, impl
