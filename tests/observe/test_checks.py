"""The divergence check and the non-finite gradient guard on 2 gloo ranks, in process.

With both on, training is bitwise what torch's ``fully_shard`` does and the real
collectives are torch's, plus exactly one (W, 6) int64 all-gather per FSDP collective
(the check), counted at the c10d level. A NaN on one rank raises on both before any
reduction; both ranks then skip the step and train on exactly as a run that never saw
that batch (and as torch's does). The torchrun jobs that abort or hang without the
checks are in test_divergence.py.
"""

import copy

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import CollectiveMismatchError, NonFiniteGradError, fully_shard
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import assert_pairs_equal, local_pairs
from tests._pool import GlooPools
from tests.observe._divergence_job import DIM, Net

WORLD_SIZE = 2
CHECK_NBYTES = WORLD_SIZE * 6 * 8  # (W, 6) int64


def _net() -> Net:
    torch.manual_seed(0)
    return Net([24, 32, 40])


def _shard(model: Net, mesh, shard=fully_shard) -> Net:
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _batch(step: int) -> torch.Tensor:
    seed = 100 * step + dist.get_rank()
    return torch.randn(4, DIM, generator=torch.Generator().manual_seed(seed))


def _checked_vs_torch(mesh) -> list[dict]:
    base = _net()
    ours, theirs = (
        _shard(copy.deepcopy(base), mesh),
        _shard(copy.deepcopy(base), mesh, torch_fully_shard),
    )
    ours.set_divergence_check(True, timeout=60.0)
    ours.set_nonfinite_grad_check(True)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    records = []
    for step in range(3):
        rec = {}
        for name, model, optim in zip(("ours", "torch"), (ours, theirs), optims, strict=True):
            with C10dRecorder() as recorder:
                loss = model(_batch(step))
                loss.backward()
            optim.step()
            optim.zero_grad()
            rec[name] = (loss.item(), recorder.records)
        rec["params"] = local_pairs(ours, theirs, grads=False)
        records.append(rec)
    return records


def _skip_step_on_nonfinite(mesh) -> dict:
    """Steps 0..3; rank 1's batch of step 2 holds a NaN. Ours raises at step 2 on both
    ranks and skips it; the reference (torch's fully_shard) never sees step 2."""
    base = _net()
    ours, theirs = (
        _shard(copy.deepcopy(base), mesh),
        _shard(copy.deepcopy(base), mesh, torch_fully_shard),
    )
    ours.set_nonfinite_grad_check(True)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs)]
    errors, losses = [], {"ours": [], "torch": []}
    for step in range(4):
        x = _batch(step)
        if step == 2 and dist.get_rank() == 1:
            x[1, 3] = float("nan")
        try:
            loss = ours(x)
            loss.backward()
            optims[0].step()
            losses["ours"].append(loss.item())
        except NonFiniteGradError as error:
            errors.append((step, str(error)))
        optims[0].zero_grad()
        if step != 2:
            loss = theirs(x)
            loss.backward()
            optims[1].step()
            optims[1].zero_grad()
            losses["torch"].append(loss.item())
    return {"errors": errors, "losses": losses, "params": local_pairs(ours, theirs, grads=False)}


def _setters(mesh) -> dict:
    model = _shard(_net(), mesh)
    model(_batch(0)).backward()  # lazy init: the root is known now
    out = {}
    try:
        model.blocks[0].set_divergence_check(True)
    except ValueError as error:
        out["non_root"] = str(error)
    model.set_divergence_check(True, timeout=2.5)
    out["timeout_s"] = model._get_fsdp_state().check.timeout.total_seconds()
    model.set_divergence_check(False)
    out["off"] = model._get_fsdp_state().check is None
    return out


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            "checked_vs_torch": lambda: _checked_vs_torch(mesh),
            "skip_step": lambda: _skip_step_on_nonfinite(mesh),
            "setters": lambda: _setters(mesh),
        }
    )


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=120, pool=gloo_pool)


def test_checked_training_is_torchs_plus_one_check_per_collective(run) -> None:
    for rank, records in enumerate(scenario_records(run, "checked_vs_torch")):
        for step, rec in enumerate(records):
            where = f"rank {rank} step {step}"
            (our_loss, ours), (their_loss, theirs) = rec["ours"], rec["torch"]
            assert our_loss == their_loss, where  # the checks change no arithmetic
            checks = [r for r in ours if r == ("all_gather", CHECK_NBYTES)]
            real = [r for r in ours if r != ("all_gather", CHECK_NBYTES)]

            # The real collectives are the same in kind and bytes (gloo: ours reduce-
            # scatters by all-to-all, torch by reduce_scatter_tensor, which gloo runs
            # as a full all-reduce plus a copy-out of the rank's chunk).
            def kinds(records):
                return sorted((k.replace("all_to_all", "reduce_scatter"), n) for k, n in records)

            assert kinds(real) == kinds(theirs), where
            assert len(checks) == len(real), f"{where}: one check per collective"
            assert_pairs_equal(rec["params"], f"{where} local shard vs torch")


def test_nonfinite_step_raises_on_both_ranks_and_can_be_skipped(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "skip_step")):
        assert [step for step, _ in rec["errors"]] == [2], f"rank {rank}: {rec['errors']}"
        assert "rank 1: blocks.2.up.weight" in rec["errors"][0][1]
        # Skipping the step leaves no trace: bitwise what never seeing it gives.
        assert rec["losses"]["ours"] == rec["losses"]["torch"], f"rank {rank}"
        assert_pairs_equal(rec["params"], f"rank {rank} after the skipped step")


def test_setters(run) -> None:
    for rec in scenario_records(run, "setters"):
        assert "call them on its root module" in rec["non_root"]
        assert rec["timeout_s"] == 2.5
        assert rec["off"]


def test_mismatch_error_type() -> None:
    # Callers catching torch's collective failures (RuntimeError) catch ours too.
    assert issubclass(CollectiveMismatchError, RuntimeError)
    assert issubclass(NonFiniteGradError, RuntimeError)
