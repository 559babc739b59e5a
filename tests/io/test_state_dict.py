"""State dicts and distributed checkpoints of ``fully_shard``-ed models on gloo ranks.

Model state dicts (one 2-rank spawn): sharded keys and placements with no collective,
the values and the next backward after a forward that left groups unsharded (as torch's),
an exact save -> load round trip, a plain full state dict from an unsharded model,
torch's ``get_state_dict``/``set_state_dict`` with ``full_state_dict=True,
cpu_offload=True``, the streamed safetensors export, and bad input rejected whole.

Checkpoints (``dtensor_fsdp.checkpoint``): one spawn per *save* world size trains
``K`` steps and saves; one spawn per *load* world size loads every checkpoint meant for
it into a fresh model of its own layout and trains ``M`` more steps. Loaded params and
AdamW state must equal the saved ones exactly (``full_tensor()``), and the losses of the
resumed steps must equal those of one uninterrupted run of ``K + M`` steps. Each step
uses a fixed global batch split over the data-parallel ranks, so the loss does not
depend on the layout; the uninterrupted reference is a single process on the global
batch (computed in the parent). Layouts: 2 -> 4, 4 -> 2, 2 -> 1, FSDP -> HSDP and
FSDP+TP -> FSDP.
"""

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.debug import CommDebugMode

from dtensor_fsdp import fully_shard, load_full_state_dict, save_full_state_dict
from dtensor_fsdp.checkpoint import load_checkpoint, save_checkpoint
from dtensor_fsdp.models.llama import Llama, LlamaConfig, apply_tensor_parallel, cross_entropy_loss
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import full, full_state, mean_over_world
from tests._pool import GlooPools

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)  # 64 and 88 rows split evenly over 2 and 4; wk/wv have 16 rows
GLOBAL_BATCH = 4  # rows per step, split over the data-parallel ranks
K, M = 2, 2  # steps before and after the checkpoint
LOSS_RTOL = 1e-5


# ---------------------------------------------------------------------------
# Model, data and training, identical in every rank and in the parent
# ---------------------------------------------------------------------------


def _build() -> Llama:
    torch.manual_seed(0)
    return Llama(CONFIG)


def _tokens(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(
        0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.max_seq_len + 1), generator=gen
    )


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


@dataclass
class Sharded:
    """A sharded model, its optimizer and this rank's slice of the data-parallel world."""

    model: Llama
    optimizer: torch.optim.Optimizer
    dp_rank: int
    dp_size: int


def _shard(layout: str) -> Sharded:
    """A fresh model on this world: ``fsdp`` (1-D), ``hsdp`` (2 x 2) or ``tp`` (dp=2, tp=2)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _build()
    if layout == "fsdp":
        mesh, dp_rank, dp_size = init_device_mesh("cpu", (world_size,)), rank, world_size
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        dp_rank, dp_size = rank, world_size
    elif layout == "tp":
        root = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        apply_tensor_parallel(model, root["tp"])
        mesh, dp_rank, dp_size = root["dp"], root["dp"].get_local_rank(), 2
    else:
        raise ValueError(layout)
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return Sharded(model, _optimizer(model), dp_rank, dp_size)


def _train(run: Sharded, steps: range) -> list[float]:
    """One AdamW step per global batch in ``steps``; the mean loss over the world."""
    losses = []
    for step in steps:
        tokens = _tokens(step).chunk(run.dp_size)[run.dp_rank]  # (B / dp, T + 1)
        loss = cross_entropy_loss(run.model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        run.optimizer.step()
        run.optimizer.zero_grad()
        losses.append(mean_over_world(loss))
    return losses


def _reference_losses(steps: int) -> list[float]:
    """One process, the global batch, ``steps`` steps uninterrupted."""
    model = _build()
    optimizer = _optimizer(model)
    losses = []
    for step in range(steps):
        tokens = _tokens(step)
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


# ---------------------------------------------------------------------------
# Model state dict scenarios (2 ranks)
# ---------------------------------------------------------------------------


def _scenario_sharded_keys() -> dict:
    run = _shard("fsdp")
    _train(run, range(1))
    with CommDebugMode() as comm:
        sd = run.model.state_dict()
    return {
        "keys": (sorted(sd), sorted(_build().state_dict())),
        "placements": {k: tuple(v.placements) for k, v in sd.items() if isinstance(v, DTensor)},
        "plain": sorted(k for k, v in sd.items() if not isinstance(v, DTensor)),
        "comm_count": comm.get_total_counts(),
    }


def _scenario_after_forward() -> dict:
    """``state_dict()`` while parameters are unsharded: after a forward whose groups keep
    them (``reshard_after_forward=False``, no backward yet) and after a ``no_grad``
    forward (the root keeps its own). torch's FSDP2 reshards in a state-dict pre-hook
    (``to_sharded_hook``), so the values are the sharded DTensors and the next backward
    gathers again; ours must do the same (values, then the backward's collectives and
    gradients)."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    tokens = _tokens(0)
    records = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = _build()
        for block in model.layers:
            shard(block, mesh=mesh, reshard_after_forward=False)
        shard(model, mesh=mesh, reshard_after_forward=False)
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        after_grad_forward = _sharded_values(model.state_dict())
        with C10dRecorder() as backward:
            loss.backward()
        grads = {k: full(p.grad) for k, p in model.named_parameters()}
        with torch.no_grad():
            model(tokens[:, :-1])
        after_no_grad = _sharded_values(model.state_dict())
        records[name] = {
            "values": (after_grad_forward, after_no_grad),
            "backward": backward.records,
            "grads": grads,
        }
    return records


def _sharded_values(sd: dict) -> dict:
    """Each value's type, placements and local tensor, as a user of the state dict sees it."""
    return {
        k: (
            type(v).__name__,
            tuple(getattr(v, "placements", ())),
            full(v) if isinstance(v, DTensor) else v,
        )
        for k, v in sd.items()
    }


def _scenario_round_trip() -> dict:
    source = _shard("fsdp")
    _train(source, range(2))
    target = _shard("fsdp")
    target.model.load_state_dict(source.model.state_dict())
    return {
        "pairs": {
            k: (full(v), full(target.model.state_dict()[k]))
            for k, v in source.model.state_dict().items()
        }
    }


def _scenario_plain_full() -> dict:
    torch.manual_seed(7)
    plain = Llama(CONFIG)  # other values than _build()'s
    run = _shard("fsdp")
    run.model.load_state_dict(plain.state_dict())
    sd = run.model.state_dict()
    return {
        "pairs": {k: (full(sd[k]), v.detach().clone()) for k, v in plain.state_dict().items()},
        "local_shapes": {k: tuple(sd[k].to_local().shape) for k in sd},
    }


def _scenario_full_options() -> dict:
    """torch's full_state_dict/cpu_offload options: rank 0 gets full CPU tensors; a full
    model + optimizer state dict loads back exactly with full_state_dict=True."""
    source = _shard("fsdp")
    _train(source, range(2))
    expected = full_state(source.model, source.optimizer)
    offloaded, offloaded_optim = get_state_dict(
        source.model,
        source.optimizer,
        options=StateDictOptions(full_state_dict=True, cpu_offload=True),
    )
    on_all, optim_on_all = get_state_dict(
        source.model, source.optimizer, options=StateDictOptions(full_state_dict=True)
    )
    target = _shard("fsdp")
    set_state_dict(
        target.model,
        target.optimizer,
        model_state_dict=on_all,
        optim_state_dict=optim_on_all,
        options=StateDictOptions(full_state_dict=True),
    )
    return {
        "offloaded": {
            k: (type(v).__name__, v.device.type, v.clone()) for k, v in offloaded.items()
        },
        "offloaded_optim_keys": sorted(offloaded_optim.get("state", {})),
        "expected": expected,
        "loaded": full_state(target.model, target.optimizer),
    }


def _scenario_export(path: str) -> dict:
    run = _shard("fsdp")
    _train(run, range(1))
    save_full_state_dict(run.model, path)
    torch_path = os.path.join(os.path.dirname(path), "model.pt")
    save_full_state_dict(run.model, torch_path, format="torch")
    fulls = {k: full(v) for k, v in run.model.state_dict().items()}
    plain = Llama(CONFIG)
    plain.load_state_dict(load_full_state_dict(path))
    from_torch = torch.load(torch_path, weights_only=True)  # an ordinary torch.save file
    return {
        "pairs": {k: (fulls[k], v.detach().clone()) for k, v in plain.state_dict().items()},
        "torch_pairs": {k: (fulls[k], from_torch[k]) for k in fulls},
        "leftovers": sorted(os.listdir(os.path.dirname(path))),
    }


def _scenario_export_rejects_dtype(path: str) -> dict:
    model = nn.Linear(4, 4)
    model.register_buffer("phase", torch.zeros(4, dtype=torch.complex128))
    fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    try:
        save_full_state_dict(model, path)
        error = None
    except ValueError as exc:
        error = str(exc)
    dist.barrier()
    return {"error": error, "exists": [os.path.exists(path), os.path.exists(path + ".tmp")]}


def _scenario_export_fails_on_rank0(tmp: str) -> dict:
    """Rank 0 cannot write (a missing directory; a write failing mid-file): every rank
    raises the same error once the gathers are done, instead of waiting forever in the
    next gather for a rank that raised."""
    import dtensor_fsdp.io.full_export as state_dict_module

    run = _shard("fsdp")
    cases = {
        "missing_dir": (os.path.join(tmp, "no_such_dir", "model.safetensors"), "safetensors"),
        "missing_dir_torch": (os.path.join(tmp, "no_such_dir", "model.pt"), "torch"),
        "disk_full": (os.path.join(tmp, "full", "model.safetensors"), "safetensors"),
    }
    os.makedirs(os.path.join(tmp, "full"), exist_ok=True)
    real_write, writes = state_dict_module.write_tensor, []

    def failing_write(file: object, tensor: torch.Tensor) -> None:
        writes.append(1)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        real_write(file, tensor)

    out: dict[str, object] = {}
    for name, (path, format) in cases.items():
        if name == "disk_full":
            state_dict_module.write_tensor = failing_write
        try:
            save_full_state_dict(run.model, path, format=format)
            out[name] = "no error"
        except RuntimeError as exc:
            out[name] = str(exc)
        finally:
            state_dict_module.write_tensor = real_write
        out[name + "_left"] = (
            sorted(os.listdir(os.path.dirname(path)))
            if os.path.isdir(os.path.dirname(path))
            else []
        )
    return out


def _bad_state_dicts(good: dict[str, torch.Tensor]) -> dict[str, tuple[dict, list[str]]]:
    """name -> (state dict, strings the error must contain)."""
    first, second = "tok_embeddings.weight", "layers.0.attention.wq.weight"
    missing = {k: v for k, v in good.items() if k != second}
    unexpected = {**good, "layers.9.extra.weight": torch.zeros(3)}
    shape = {**good, second: torch.zeros(5, 5)}
    other = nn.Sequential(nn.Linear(32, 32)).state_dict()
    return {
        "missing": (missing, ["missing keys", second]),
        "unexpected": (unexpected, ["unexpected keys", "layers.9.extra.weight"]),
        "shape": (shape, [second, "(5, 5)"]),
        "other_model": (other, ["0.weight", first, "missing keys"]),
    }


def _scenario_bad_input() -> dict:
    """Every bad state dict raises naming the keys, and changes nothing."""
    run = _shard("fsdp")
    _train(run, range(1))
    before = full_state(run.model, run.optimizer)
    torch.manual_seed(3)
    good = Llama(CONFIG).state_dict()  # different values: a partial load would show
    results = {}
    for name, (sd, _) in _bad_state_dicts(good).items():
        try:
            run.model.load_state_dict(sd)
            results[name] = None
        except RuntimeError as exc:
            results[name] = str(exc)
    return {"errors": results, "unchanged": (before, full_state(run.model, run.optimizer))}


# ---------------------------------------------------------------------------
# Checkpoint scenarios: save on one world, load on another
# ---------------------------------------------------------------------------


def _scenario_save(layout: str, directory: str) -> dict:
    run = _shard(layout)
    losses = _train(run, range(K))
    rank = dist.get_rank()
    path = save_checkpoint(
        directory,
        K,
        run.model,
        run.optimizer,
        extra={"step": K, "data_position": K},
        rank_extra={"rank": rank},
    )
    # Same world size: every rank gets its own entry back.
    same_world = load_checkpoint(path, _shard(layout).model, None)
    return {
        "path": path,
        "losses": losses,
        "state": full_state(run.model, run.optimizer),
        "rank_extra": same_world.rank_extra,
    }


def _scenario_load(layout: str, directory: str) -> dict:
    run = _shard(layout)
    loaded = load_checkpoint(os.path.join(directory, f"step_{K:08d}"), run.model, run.optimizer)
    state = full_state(run.model, run.optimizer)
    return {
        "state": state,
        "step": loaded.step,
        "extra": loaded.extra,
        "rank_extra": loaded.rank_extra,
        "saved_world_size": loaded.world_size,
        "losses": _train(run, range(loaded.extra["data_position"], K + M)),
    }


def _state_dict_worker(rank: int, world_size: int, tmp: str) -> dict:
    return run_scenarios(
        {
            "sharded_keys": _scenario_sharded_keys,
            "round_trip": _scenario_round_trip,
            "after_forward": _scenario_after_forward,
            "plain_full": _scenario_plain_full,
            "full_options": _scenario_full_options,
            "export": lambda: _scenario_export(os.path.join(tmp, "export", "model.safetensors")),
            "export_rejects_dtype": lambda: _scenario_export_rejects_dtype(
                os.path.join(tmp, "rejected.safetensors")
            ),
            "bad_input": _scenario_bad_input,
            "export_fails_on_rank0": lambda: _scenario_export_fails_on_rank0(
                os.path.join(tmp, "failing")
            ),
        }
    )


def _save_worker(rank: int, world_size: int, saves: dict[str, tuple[str, str]]) -> dict:
    """``saves``: scenario name -> (layout, directory)."""
    return run_scenarios(
        {
            name: (lambda layout=layout, d=d: _scenario_save(layout, d))
            for name, (layout, d) in saves.items()
        }
    )


def _load_worker(rank: int, world_size: int, loads: dict[str, tuple[str, str]]) -> dict:
    return run_scenarios(
        {
            name: (lambda layout=layout, d=d: _scenario_load(layout, d))
            for name, (layout, d) in loads.items()
        }
    )


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def state_dict_run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list[dict]:
    tmp = tmp_path_factory.mktemp("state_dict")
    os.makedirs(tmp / "export")
    return run_distributed(_state_dict_worker, 2, str(tmp), pool=gloo_pool)


# (save world size, save layout) -> [(load world size, load layout)]
TRANSFERS = {
    (2, "fsdp"): [(4, "fsdp"), (1, "fsdp"), (4, "hsdp")],
    (4, "fsdp"): [(2, "fsdp")],
    (4, "tp"): [(2, "fsdp")],
}


def _name(world_size: int, layout: str) -> str:
    return f"{layout}{world_size}"


@pytest.fixture(scope="module")
def checkpoint_runs(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> dict:
    """Saves on every source world, then loads on every target world: spawns by world."""
    root = tmp_path_factory.mktemp("checkpoints")
    saves_by_world: dict[int, dict[str, tuple[str, str]]] = {}
    for world_size, layout in TRANSFERS:
        directory = str(root / _name(world_size, layout))
        saves_by_world.setdefault(world_size, {})[_name(world_size, layout)] = (layout, directory)
    saved = {}
    for world_size, saves in saves_by_world.items():
        saved[world_size] = run_distributed(_save_worker, world_size, saves, pool=gloo_pool)
    loads_by_world: dict[int, dict[str, tuple[str, str]]] = {}
    for (src_world, src_layout), targets in TRANSFERS.items():
        for dst_world, dst_layout in targets:
            name = f"{_name(src_world, src_layout)}->{_name(dst_world, dst_layout)}"
            directory = str(root / _name(src_world, src_layout))
            loads_by_world.setdefault(dst_world, {})[name] = (dst_layout, directory)
    loaded = {
        w: run_distributed(_load_worker, w, loads, pool=gloo_pool)
        for w, loads in loads_by_world.items()
    }
    return {"saved": saved, "loaded": loaded, "reference": _reference_losses(K + M)}


def _assert_exact(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]], what: str) -> None:
    assert pairs, f"{what}: nothing compared"
    for key, (a, b) in pairs.items():
        assert a.dtype == b.dtype and torch.equal(a, b), f"{what}: {key} differs"


def test_state_dict_is_sharded_without_communication(state_dict_run: list[dict]) -> None:
    for rec in scenario_records(state_dict_run, "sharded_keys"):
        keys, unsharded_keys = rec["keys"]
        assert keys == unsharded_keys
        assert rec["plain"] == []
        assert set(rec["placements"].values()) == {(Shard(0),)}
        assert rec["comm_count"] == 0


def test_state_dict_after_forward_is_sharded_as_torchs(state_dict_run: list[dict]) -> None:
    """The state-dict pre-hook reshards (torch's ``to_sharded_hook``): taken after a
    forward that left groups unsharded, the values are the sharded DTensors, equal to
    torch's in type, placements and bits, and the backward gathers again as torch's."""
    for rank, rec in enumerate(scenario_records(state_dict_run, "after_forward")):
        ours, theirs = rec["ours"], rec["torch"]
        for when, mine, reference in zip(("grad", "no_grad"), ours["values"], theirs["values"]):
            assert mine.keys() == reference.keys(), (rank, when)
            for key, (kind, placements, value) in mine.items():
                assert (kind, placements) == reference[key][:2], (rank, when, key)
                assert kind == "DTensor" and placements == (Shard(0),), (rank, when, key)
                assert torch.equal(value, reference[key][2]), f"rank {rank} {when}: {key}"
        # All-gathers only: on gloo ours reduces by all-to-all where torch reduce-scatters.
        gathers = [[r for r in run["backward"] if r[0] == "all_gather"] for run in (ours, theirs)]
        assert gathers[0] and gathers[0] == gathers[1], (rank, gathers)
        _assert_exact(
            {k: (g, theirs["grads"][k]) for k, g in ours["grads"].items()}, f"rank {rank}"
        )


def test_state_dict_round_trip_is_exact(state_dict_run: list[dict]) -> None:
    for rec in scenario_records(state_dict_run, "round_trip"):
        _assert_exact(rec["pairs"], "round trip")


def test_load_plain_full_state_dict(state_dict_run: list[dict]) -> None:
    for rank, rec in enumerate(scenario_records(state_dict_run, "plain_full")):
        _assert_exact(rec["pairs"], f"rank {rank}")
        assert rec["local_shapes"]["tok_embeddings.weight"] == (32, 32)  # 64 rows / 2 ranks


def test_torch_full_state_dict_options(state_dict_run: list[dict]) -> None:
    records = scenario_records(state_dict_run, "full_options")
    rank0 = records[0]
    expected = rank0["expected"]
    for key, (kind, device, value) in rank0["offloaded"].items():
        assert (kind, device) == ("Tensor", "cpu"), key
        assert torch.equal(value, expected[key]), key
    assert len(rank0["offloaded"]) == len(_build().state_dict())
    assert rank0["offloaded_optim_keys"] == sorted(n for n, _ in _build().named_parameters())
    assert records[1]["offloaded"] == {}  # cpu_offload: only rank 0 holds the full copy
    for rank, rec in enumerate(records):
        _assert_exact(
            {k: (v, rec["loaded"][k]) for k, v in rec["expected"].items()}, f"rank {rank}"
        )


def test_save_full_state_dict_loads_into_unsharded_model(state_dict_run: list[dict]) -> None:
    for rec in scenario_records(state_dict_run, "export"):
        _assert_exact(rec["pairs"], "export")
        _assert_exact(rec["torch_pairs"], "export (torch.save format)")
        assert rec["leftovers"] == ["model.pt", "model.safetensors"]


def test_save_full_state_dict_unsupported_dtype_writes_nothing(state_dict_run: list[dict]) -> None:
    for rec in scenario_records(state_dict_run, "export_rejects_dtype"):
        assert rec["error"] is not None and "phase" in rec["error"] and "complex128" in rec["error"]
        assert rec["exists"] == [False, False]


def test_save_full_state_dict_failure_on_rank0_raises_on_every_rank(
    state_dict_run: list[dict],
) -> None:
    for rank, rec in enumerate(scenario_records(state_dict_run, "export_fails_on_rank0")):
        for name, kind in (
            ("missing_dir", "FileNotFoundError"),
            ("missing_dir_torch", "does not exist"),  # torch.save's own RuntimeError
            ("disk_full", "No space left on device"),
        ):
            assert "failed on rank 0" in rec[name] and kind in rec[name], (rank, name, rec[name])
        assert rec["disk_full_left"] == []  # the temporary file is removed


@pytest.mark.parametrize("case", ["missing", "unexpected", "shape", "other_model"])
def test_bad_state_dict_rejected_whole(state_dict_run: list[dict], case: str) -> None:
    musts = _bad_state_dicts(_build().state_dict())[case][1]
    for rank, rec in enumerate(scenario_records(state_dict_run, "bad_input")):
        error = rec["errors"][case]
        assert error is not None, f"rank {rank}: {case} was accepted"
        assert "nothing was loaded" in error
        for must in musts:
            assert must in error, f"rank {rank}: {must!r} not in {error!r}"
        before, after = rec["unchanged"]
        _assert_exact({k: (v, after[k]) for k, v in before.items()}, f"rank {rank} after {case}")


@pytest.mark.full  # checkpoints across world sizes: 1, 2 and 4 ranks
@pytest.mark.parametrize(
    ("src", "dst"),
    [(src, dst) for src, dsts in TRANSFERS.items() for dst in dsts],
    ids=lambda t: _name(*t),
)
def test_checkpoint_resumes_across_layouts(
    checkpoint_runs: dict, src: tuple[int, str], dst: tuple[int, str]
) -> None:
    transfer = f"{_name(*src)}->{_name(*dst)}"
    src_world, dst_world = src[0], dst[0]
    saved = scenario_records(checkpoint_runs["saved"][src_world], _name(*src))
    loaded = scenario_records(checkpoint_runs["loaded"][dst_world], transfer)
    reference = checkpoint_runs["reference"]
    assert saved[0]["losses"] == pytest.approx(reference[:K], rel=LOSS_RTOL)
    expected = saved[0]["state"]
    assert any(k.endswith("/exp_avg_sq") for k in expected) and any(
        k.endswith("/step") for k in expected
    )
    for rank, rec in enumerate(loaded):
        where = f"{transfer} rank {rank}"
        assert sorted(rec["state"]) == sorted(expected), where
        _assert_exact({k: (v, rec["state"][k]) for k, v in expected.items()}, where)
        assert (rec["step"], rec["extra"], rec["saved_world_size"]) == (
            K,
            {"step": K, "data_position": K},
            src_world,
        ), where
        assert rec["rank_extra"] is None, f"{where}: world size changed, no per-rank state"
        assert rec["losses"] == pytest.approx(reference[K:], rel=LOSS_RTOL), where


@pytest.mark.full
def test_checkpoint_same_world_returns_own_rank_extra(checkpoint_runs: dict) -> None:
    for world_size, layout in TRANSFERS:
        records = scenario_records(checkpoint_runs["saved"][world_size], _name(world_size, layout))
        assert [rec["rank_extra"] for rec in records] == [{"rank": r} for r in range(world_size)]
        assert os.path.basename(records[0]["path"]) == f"step_{K:08d}"


@pytest.mark.full
def test_save_then_load_dir_layout(checkpoint_runs: dict) -> None:
    """Only complete checkpoints remain: no ``.tmp`` directories after a save."""
    for world_size, layout in TRANSFERS:
        path = Path(
            scenario_records(checkpoint_runs["saved"][world_size], _name(world_size, layout))[0][
                "path"
            ]
        )
        assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
        assert (path / "COMPLETE").is_file() and (path / ".metadata").is_file()
