"""Checkpoints carry the error-feedback residuals of quantized communication.

``CommPrecisionPolicy(error_feedback=True)`` keeps, per quantized param and rank, the
quantization error of the last reduce-scatter; the next step sends it. A resume that
restarted it at zero changed every step after the checkpoint (the filed defect: step 3
loss 0.0088435793 uninterrupted, 0.0088436557 resumed). Here one uninterrupted run of
``STEPS`` steps is the reference, and a run that saves after ``RESUME_AT`` steps, builds
a fresh model and optimizer, loads and trains the rest must equal it bitwise (losses,
local params, residuals): the arithmetic after the load is the same.

Routes users take: torch DCP of ``model.state_dict()`` (optimizer through
``get_optimizer_state_dict``), DCP of ``get_state_dict(model, optim)`` (which walks every
key as an attribute path), torch's full state dicts (plain tensors, no DCP), and
``dtensor_fsdp.checkpoint``. Also ``Shard(1)``, HSDP (2 x 2: rows over both data
parallel axes) and FSDP x TP (2 x 2); a checkpoint without residuals restarts them at
zero with a warning (bitwise the run that switched error feedback on at the checkpoint),
as one of another data-parallel world size does; ``load_state_dict`` refuses a residual
of the wrong size whole and ignores residuals, with a warning, where error feedback is
off; and the keys are torch's ``fully_shard``'s exactly unless error feedback is on.

torch's ``fully_shard`` has no quantized communication: the references are our own
uninterrupted runs, and torch's ``fully_shard`` for the state-dict keys.
"""

import os
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from dtensor_fsdp import (
    CommPrecisionPolicy,
    fully_shard,
    load_full_state_dict,
    save_full_state_dict,
)
from dtensor_fsdp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

WORLD_SIZE = 2
STEPS, RESUME_AT = 6, 3
GLOBAL_BATCH = 16
EF = CommPrecisionPolicy(
    all_gather="int8", reduce_scatter="int8", block_size=64, error_feedback=True
)
NO_EF = CommPrecisionPolicy(all_gather="int8", reduce_scatter="int8", block_size=64)
# The default filter quantizes the 2-D params: each Linear's weight. Linear(64, 9)'s 9
# rows are uneven over 2 ranks: its residual rows carry padding, dropped in the state.
Run = list[dict[str, Any]]  # each rank's scenario records
EF_KEYS = [
    "0._fsdp_error_feedback.weight",
    "2._fsdp_error_feedback.weight",
    "_fsdp_error_feedback.4.weight",
]


def _build() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(20, 48), nn.ReLU(), nn.Linear(48, 64), nn.ReLU(), nn.Linear(64, 9)
    )


def _sharded(
    policy: CommPrecisionPolicy | None = EF,
    shard: Callable = fully_shard,
    tp_mesh: DeviceMesh | None = None,
    **kwargs: Any,
) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _build()
    if tp_mesh is not None:  # Linear 0 column-, Linear 2 row-parallel; the root's plain
        parallelize_module(model, tp_mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    shard(model[0], **kwargs)
    shard(model[2], **kwargs)
    shard(model, **kwargs)
    if policy is not None:
        model.set_comm_precision(policy)
    return model, torch.optim.AdamW(model.parameters(), lr=3e-3)


def _train(
    model: nn.Module, optim: torch.optim.Optimizer, steps: range, dp: tuple[int, int]
) -> list[float]:
    """Steps ``steps`` on this data-parallel rank's slice ``dp = (index, parts)`` of a
    fixed global batch per step; the losses."""
    losses = []
    for step in steps:
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(GLOBAL_BATCH, 20, generator=gen).chunk(dp[1])[dp[0]]
        y = torch.randint(0, 9, (GLOBAL_BATCH,), generator=gen).chunk(dp[1])[dp[0]]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses


def _record(model: nn.Module, losses: list[float]) -> dict[str, Any]:
    """What a resume must reproduce: the losses, this rank's params and residuals."""
    state = model.state_dict()
    return {
        "losses": losses,
        "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
        "residuals": {k: v.to_local().clone() for k, v in state.items() if k in EF_KEYS},
    }


# ---------------------------------------------------------------------------
# Save and load, per route
# ---------------------------------------------------------------------------


def _save_dcp_module_state(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}
    dcp.save(state, checkpoint_id=path)


def _load_dcp_module_state(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    state = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, optim)}
    dcp.load(state, checkpoint_id=path)
    model.load_state_dict(state["model"])
    set_optimizer_state_dict(model, optim, state["optim"])


def _save_dcp_get_state_dict(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model_state, optim_state = get_state_dict(model, optim)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def _load_dcp_get_state_dict(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model_state, optim_state = get_state_dict(model, optim)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optim, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )


_FULL = StateDictOptions(full_state_dict=True)
_full_states: dict[str, Any] = {}  # the full state dicts route keeps them in memory


def _save_full(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    _full_states[path] = get_state_dict(model, optim, options=_FULL)


def _load_full(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model_state, optim_state = _full_states.pop(path)
    assert not isinstance(model_state[EF_KEYS[0]], DTensor)  # plain, gathered
    set_state_dict(
        model, optim, model_state_dict=model_state, optim_state_dict=optim_state, options=_FULL
    )


def _save_checkpoint(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    save_checkpoint(path, RESUME_AT, model, optim, extra={})


def _load_checkpoint(path: str, model: nn.Module, optim: torch.optim.Optimizer) -> None:
    found = latest_checkpoint(path)
    assert found is not None
    load_checkpoint(found, model, optim)


ROUTES = {
    "dcp_module_state_dict": (_save_dcp_module_state, _load_dcp_module_state),
    "dcp_get_state_dict": (_save_dcp_get_state_dict, _load_dcp_get_state_dict),
    "full_state_dict": (_save_full, _load_full),
    "checkpoint": (_save_checkpoint, _load_checkpoint),
}


def _uninterrupted(
    dp: tuple[int, int], first: CommPrecisionPolicy = EF, **kwargs: Any
) -> dict[str, Any]:
    """``STEPS`` steps in one run, with ``first`` before ``RESUME_AT`` and ``EF`` after."""
    model, optim = _sharded(first, **kwargs)
    losses = _train(model, optim, range(RESUME_AT), dp)
    if first is not EF:
        model.set_comm_precision(EF)  # residuals start at zero
    losses += _train(model, optim, range(RESUME_AT, STEPS), dp)
    return _record(model, losses)


def _resumed(
    dp: tuple[int, int], path: str, route: str, first: CommPrecisionPolicy = EF, **kwargs: Any
) -> dict[str, Any]:
    """``_uninterrupted`` with a save after ``RESUME_AT`` steps and a load into a fresh
    model and optimizer (``EF`` set before the load, as a resumed job sets it up)."""
    save, load = ROUTES[route]
    model, optim = _sharded(first, **kwargs)
    losses = _train(model, optim, range(RESUME_AT), dp)
    save(path, model, optim)
    del model, optim
    model, optim = _sharded(EF, **kwargs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(path, model, optim)
    losses += _train(model, optim, range(RESUME_AT, STEPS), dp)
    record = _record(model, losses)
    record["warnings"] = [str(w.message) for w in caught if "error-feedback" in str(w.message)]
    return record


def _keys(path: str) -> dict[str, list[str]]:
    """The state-dict keys of torch's fully_shard and of ours per policy, and of our
    full export with error feedback (the weights only)."""
    out = {"torch": sorted(_sharded(None, torch_fully_shard)[0].state_dict())}
    for name, policy in (("none", None), ("no_ef", NO_EF), ("ef", EF)):
        out[name] = sorted(_sharded(policy)[0].state_dict())
    save_full_state_dict(_sharded(EF)[0], path)
    out["ef_export"] = sorted(load_full_state_dict(path))
    return out


def _residual_values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.to_local().clone() for k, v in model.state_dict().items() if k in EF_KEYS}


def _bad_residual(dp: tuple[int, int]) -> dict[str, Any]:
    """A residual of another data-parallel world size (4 rows) is refused whole: the
    model's params and residuals stay as they were."""
    model, optim = _sharded()
    _train(model, optim, range(1), dp)
    before = _record(model, [])
    state = {k: v.full_tensor() for k, v in model.state_dict().items()}
    state[EF_KEYS[0]] = torch.zeros(4, *state[EF_KEYS[0]].shape[1:])
    state["0.weight"] = torch.ones_like(state["0.weight"])
    try:
        model.load_state_dict(state)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    return {"error": error, "before": before, "after": _record(model, [])}


def _residuals_without_error_feedback(dp: tuple[int, int]) -> dict[str, Any]:
    """A state dict with residuals loads strictly into a model without error
    feedback: the params load, the residuals are ignored with a warning."""
    model, optim = _sharded()
    _train(model, optim, range(1), dp)
    state = model.state_dict()
    other, _ = _sharded(NO_EF)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        other.load_state_dict(state)
    return {
        "warnings": [str(w.message) for w in caught if "error-feedback" in str(w.message)],
        "equal": all(
            torch.equal(p.to_local(), q.to_local())
            for p, q in zip(model.parameters(), other.parameters(), strict=True)
        ),
    }


def _worker(rank: int, world_size: int, tmp: str) -> dict:
    dp = (rank, world_size)
    shard_1 = {"shard_placement_fn": lambda p: Shard(1) if p.ndim == 2 else Shard(0)}
    scenarios: dict[str, Callable[[], Any]] = {
        "keys": lambda: _keys(os.path.join(tmp, "export.safetensors")),
        "uninterrupted": lambda: _uninterrupted(dp),
        "no_ef_uninterrupted": lambda: _uninterrupted(dp, first=NO_EF),
        "no_ef_checkpoint": lambda: _resumed(
            dp, os.path.join(tmp, "no_ef"), "checkpoint", first=NO_EF
        ),
        "bad_residual": lambda: _bad_residual(dp),
        "without_error_feedback": lambda: _residuals_without_error_feedback(dp),
        "shard_1_uninterrupted": lambda: _uninterrupted(dp, **shard_1),
        "shard_1_checkpoint": lambda: _resumed(
            dp, os.path.join(tmp, "shard_1"), "checkpoint", **shard_1
        ),
    }
    for route in ROUTES:
        scenarios[route] = lambda route=route: _resumed(dp, os.path.join(tmp, route), route)
    return run_scenarios(scenarios)


def _other_world_size(dp: tuple[int, int], path: str, mesh: Any) -> dict[str, Any]:
    """Load the W=2 run's checkpoint (2 residual rows) at a data-parallel world size
    of 4: the residuals restart at zero, with a warning, and training goes on."""
    model, optim = _sharded(mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _load_checkpoint(path, model, optim)
    zero = all(not r.any() for r in _residual_values(model).values())
    return {
        "warnings": [str(w.message) for w in caught if "error-feedback" in str(w.message)],
        "zero": zero,
        "losses": _train(model, optim, range(RESUME_AT, STEPS), dp),
    }


def _hsdp_worker(rank: int, world_size: int, tmp: str) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    dp = (rank, world_size)  # mesh rank (r, s) is data-parallel rank 2 r + s
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = {"mesh": tp_mesh["dp"], "tp_mesh": tp_mesh["tp"]}
    tp_dp = (rank // 2, 2)  # both TP ranks of a data-parallel rank see its batch
    return run_scenarios(
        {
            "uninterrupted": lambda: _uninterrupted(dp, mesh=mesh),
            "dcp_get_state_dict": lambda: _resumed(
                dp, os.path.join(tmp, "hsdp"), "dcp_get_state_dict", mesh=mesh
            ),
            "tp_uninterrupted": lambda: _uninterrupted(tp_dp, **tp),
            "tp_checkpoint": lambda: _resumed(
                tp_dp, os.path.join(tmp, "tp"), "checkpoint", **tp
            ),
            "other_world_size": lambda: _other_world_size(
                dp, os.path.join(tmp, "checkpoint"), mesh
            ),
        }
    )


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ef_checkpoints"))


@pytest.fixture(scope="module")
def run(tmp: str, gloo_pool: GlooPools) -> Run:
    return run_distributed(_worker, WORLD_SIZE, tmp, timeout=240, pool=gloo_pool)


@pytest.fixture(scope="module")
def hsdp_run(run: Run, tmp: str, gloo_pool: GlooPools) -> Run:
    # After `run`: its W=2 checkpoint is loaded here at a data-parallel world size of 4.
    return run_distributed(_hsdp_worker, 4, tmp, timeout=240, pool=gloo_pool)


def _assert_bitwise(reference: dict[str, Any], resumed: dict[str, Any], rank: int) -> None:
    assert resumed["losses"] == reference["losses"], f"rank {rank}: losses"
    for what in ("params", "residuals"):
        assert resumed[what].keys() == reference[what].keys()
        for key, expected in reference[what].items():
            assert torch.equal(resumed[what][key], expected), f"rank {rank}: {what} {key}"


def _resumed_pairs(run: Run, reference: str, resumed: str) -> list[tuple[dict, dict]]:
    """Each rank's records of scenarios ``reference`` and ``resumed``, asserted bitwise
    equal; the reference's residuals are all there and not zero (else a restart at zero
    would pass too)."""
    pairs = list(
        zip(scenario_records(run, reference), scenario_records(run, resumed), strict=True)
    )
    for rank, (ref, res) in enumerate(pairs):
        _assert_bitwise(ref, res, rank)
        assert len(ref["residuals"]) == len(EF_KEYS), f"rank {rank}"
        assert all(r.abs().max() > 0 for r in ref["residuals"].values()), f"rank {rank}"
    return pairs


@pytest.mark.parametrize("route", list(ROUTES))
def test_resume_is_bitwise_the_uninterrupted_run(run: Run, route: str) -> None:
    for _, resumed in _resumed_pairs(run, "uninterrupted", route):
        assert resumed["warnings"] == []


def test_shard_dim_1_resume_is_bitwise(run: Run) -> None:
    _resumed_pairs(run, "shard_1_uninterrupted", "shard_1_checkpoint")


def test_checkpoint_without_residuals_restarts_them_at_zero_with_a_warning(run: Run) -> None:
    """Saved without error feedback: the resumed run is the one that switched error
    feedback on at the checkpoint (``set_comm_precision`` starts at zero)."""
    for _, resumed in _resumed_pairs(run, "no_ef_uninterrupted", "no_ef_checkpoint"):
        assert len(resumed["warnings"]) == 1
        assert "restart at zero" in resumed["warnings"][0]
        assert all(key in resumed["warnings"][0] for key in EF_KEYS)


def test_state_dict_keys_are_torch_unless_error_feedback_is_on(run: Run) -> None:
    for keys in scenario_records(run, "keys"):
        assert keys["none"] == keys["torch"]
        assert keys["no_ef"] == keys["torch"]
        assert keys["ef"] == sorted(keys["torch"] + EF_KEYS)
        assert keys["ef_export"] == keys["torch"]


def test_hsdp_resume_is_bitwise(hsdp_run: Run) -> None:
    _resumed_pairs(hsdp_run, "uninterrupted", "dcp_get_state_dict")


def test_residual_of_another_world_size_is_refused_whole(run: Run) -> None:
    for rank, record in enumerate(scenario_records(run, "bad_residual")):
        assert record["error"] is not None
        assert "nothing was loaded" in record["error"]
        assert f"'{EF_KEYS[0]}': shape (4, 48, 20), expected (2, 48, 20)" in record["error"]
        assert "another data-parallel world size" in record["error"]
        _assert_bitwise(record["before"], record["after"], rank)


def test_residuals_ignored_with_a_warning_without_error_feedback(run: Run) -> None:
    for record in scenario_records(run, "without_error_feedback"):
        assert record["equal"]
        # One warning per fully_shard module, naming its residuals.
        assert all("ignored" in w for w in record["warnings"])
        assert all(any(key in w for w in record["warnings"]) for key in EF_KEYS)


def test_checkpoint_at_another_world_size_restarts_residuals_at_zero(hsdp_run: Run) -> None:
    for record in scenario_records(hsdp_run, "other_world_size"):
        assert record["zero"]
        assert len(record["warnings"]) == 1
        assert "restart at zero" in record["warnings"][0]
        assert all(key in record["warnings"][0] for key in EF_KEYS)
        assert len(record["losses"]) == STEPS - RESUME_AT


def test_tensor_parallel_resume_is_bitwise(hsdp_run: Run) -> None:
    """FSDP x TP (2 x 2): the residual rows are over the data-parallel axis, and TP
    shards them as the params (Linear 0 by rows, Linear 2 by columns)."""
    _resumed_pairs(hsdp_run, "tp_uninterrupted", "tp_checkpoint")
