"""``dtensor_fsdp.optim.Muon`` on sharded params, against torch.optim.Muon.

Model: three bias-free linears 24 -> 65 -> 40 -> 3 plus a biased one on top, each its
own ``fully_shard`` unit, then the root. Muon's recipe (``split_muon_params``): the four
weights go to Muon, in two param groups of different settings (Nesterov or not, both
``adjust_lr_fn``s, weight decays, ``ns_steps``); the bias goes to AdamW. Dim-0 sizes
65, 40, 3 and 7 are uneven over 2 or 4 ranks; over 4 the 3-row weight leaves rank 3
an empty chunk.

References:

1. A single process with torch.optim.Muon (and AdamW) on the same global batch,
   20 steps. Its gradient is computed as the sharded run computes it: one backward
   per data-parallel rank's rows, summed in the order the sharded reduction sums them
   (in rank order; HSDP: within each shard group, then across replicas) and divided
   by the world size (a power of two: exact). Given the same gradient our Muon
   computes the same bits as torch's ([Note: Muon numerics] in
   dtensor_fsdp/optim/muon.py), so the parameters must be **bitwise equal** after
   20 steps: FSDP over 2 and 4 ranks, HSDP (2 x 2), and ``Shard(1)`` params.

   Why not one backward over the whole batch: its gradient differs from the sharded
   one by fp32 rounding (a few ulps), which flips the bf16 rounding of a few elements
   of Newton-Schulz's input (probability ~ 1e-7 / 2^-8 per element and step), and
   Newton-Schulz amplifies that along the gradient's small singular directions (the
   quintic's slope at 0 is 3.4445, to the fifth over 5 steps: ~480). On this model
   at lr 0.02 the first flip comes after ~10 steps and moves parameters by ~1e-3;
   torch.optim.Muon on the DTensors differs by ~2e-3 from step 1 on. No tolerance
   tighter than the Muon update bound below follows from the numerics.

2. torch's ``fully_shard`` + torch.optim.Muon (Newton-Schulz on the DTensors), 2 ranks:
   collectives per ``optimizer.step()`` counted at the c10d level
   (``tests/_c10d.py``): ours exactly two all-to-alls of the expected bytes, torch's
   many. Parameters within the Muon update bound: the quintic iteration's output
   has singular values <= 1.2024 (its sup over [0, 1] after 5 steps), so any entry of
   an update is <= ``MUON_UPDATE_BOUND`` = 1.25 (with slack for bf16 rounding), and
   two runs from the same parameters end at most ``2 * 1.25 * lr * adjust`` apart
   per step, whatever their gradients. Loose: it catches gross errors only. The
   tight check is ours on torch's ``fully_shard`` against ours on ours: bitwise
   equal (at 2 ranks the two FSDPs' gradients are bitwise equal, see
   [Note: parity tolerances] in _parity.py).

3. Checkpoints: save Muon + AdamW (both optimizers in one checkpoint) on 2 ranks after
   K steps with ``dtensor_fsdp.checkpoint``, resume on 2 ranks and on 4; the loaded
   state must equal the saved one exactly and the run must continue bitwise like the
   uninterrupted reference. The optimizer state dict has torch.optim.Muon's layout.

4. ``train.py --optimizer muon`` (2 ranks): trains, checkpoints both optimizers, and a
   run resumed from step 2 ends bitwise where an uninterrupted one does.
"""

import json
import os
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

import train
from dtensor_fsdp import fully_shard
from dtensor_fsdp.checkpoint import load_checkpoint, save_checkpoint
from dtensor_fsdp.optim import Muon, split_muon_params
from dtensor_fsdp.optim.muon import adjust_lr
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import adamw_param_atol, assert_pairs_equal, full
from tests._pool import GlooPools

STEPS = 20
TORCH_STEPS = 5  # against torch's fully_shard + torch.optim.Muon
K, M = 3, 3  # checkpoint: steps before the save, steps after the resume
ROWS_PER_RANK = 2
MUON_UPDATE_BOUND = 1.25  # see the module docstring, item 2
# Two Muon param groups of different settings, one exchange (one shard group).
MUON_GROUPS = (
    {"lr": 0.02, "weight_decay": 0.1},
    {
        "lr": 0.01,
        "weight_decay": 0.05,
        "nesterov": False,
        "adjust_lr_fn": "match_rms_adamw",
        "ns_steps": 4,
    },
)
ADAMW = {"lr": 1e-2, "weight_decay": 0.01}
# Global rank -> how the sharded reduction sums the data-parallel ranks' gradients:
# in rank order (FSDP), or per shard group then across replicas (HSDP over (2, 2)).
SEQUENTIAL, SHARD_GROUPS_FIRST = "sequential", "shard_groups_first"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [nn.Linear(24, 65, bias=False), nn.Linear(65, 40, bias=False)]
            + [nn.Linear(40, 3, bias=False), nn.Linear(3, 7)]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def _build() -> Model:
    torch.manual_seed(0)
    return Model()


def _batch(step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randn(rows, 24, generator=gen), torch.randn(rows, 7, generator=gen)


def _optimizers(
    model: nn.Module, muon_cls: type[torch.optim.Optimizer] = Muon
) -> list[torch.optim.Optimizer]:
    """Muon's recipe: the weights in two Muon param groups, the bias to AdamW."""
    muon_params, other = split_muon_params(model)
    assert len(muon_params) == 4 and len(other) == 1
    groups = [{"params": muon_params[:1], **MUON_GROUPS[0]}]
    groups.append({"params": muon_params[1:], **MUON_GROUPS[1]})
    return [muon_cls(groups), torch.optim.AdamW(other, **ADAMW)]


def _step(optimizers: list[torch.optim.Optimizer]) -> None:
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()


def _shard(
    model: nn.Module, mesh: DeviceMesh, shard: Callable = fully_shard, **kwargs
) -> nn.Module:
    for layer in model.layers:
        shard(layer, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    return model


# ---------------------------------------------------------------------------
# The single-process reference (runs in each rank, or in the parent)
# ---------------------------------------------------------------------------


def _reference_step(
    model: nn.Module, optimizers: list, step: int, dp_size: int, order: str
) -> None:
    """One torch.optim step on the global batch, its gradient summed like the sharded
    run's (module docstring, item 1)."""
    x, y = _batch(step, dp_size * ROWS_PER_RANK)
    per_rank = []
    for xr, yr in zip(x.chunk(dp_size), y.chunk(dp_size), strict=True):
        model.zero_grad(set_to_none=True)
        F.mse_loss(model(xr), yr).backward()
        per_rank.append([p.grad for p in model.parameters()])
    for index, param in enumerate(model.parameters()):
        grads = [g[index] for g in per_rank]
        if order == SHARD_GROUPS_FIRST:  # (replicate, shard) = (2, 2): ranks {0, 1}, {2, 3}
            total = (grads[0] + grads[1]) + (grads[2] + grads[3])
        else:
            total = grads[0]
            for grad in grads[1:]:
                total = total + grad
        param.grad = total / dp_size
    _step(optimizers)


def _reference(steps_by_world: list[int], order: str = SEQUENTIAL, muon_cls=torch.optim.Muon):
    """The reference model after one step per entry, each on that many dp ranks."""
    model = _build()
    optimizers = _optimizers(model, muon_cls)
    for step, dp_size in enumerate(steps_by_world):
        _reference_step(model, optimizers, step, dp_size, order)
    return model, optimizers


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: full(p) for name, p in model.named_parameters()}


def _full_state(model: nn.Module, optimizers: list) -> dict[str, torch.Tensor]:
    """Full params and every optimizer state tensor per FQN."""
    state = _full_params(model)
    for name, p in model.named_parameters():
        for optimizer in optimizers:
            for key, value in optimizer.state.get(p, {}).items():
                state[f"{name}/{key}"] = full(value)
    return state


# ---------------------------------------------------------------------------
# Scenarios (every rank)
# ---------------------------------------------------------------------------


def _train(model: nn.Module, optimizers: list, steps: range, dp_rank: int, dp_size: int):
    for step in steps:
        x, y = _batch(step, dp_size * ROWS_PER_RANK)
        F.mse_loss(model(x.chunk(dp_size)[dp_rank]), y.chunk(dp_size)[dp_rank]).backward()
        _step(optimizers)


def _scenario_reference_parity(layout: str) -> dict:
    """Item 1: 20 steps against the single-process reference; full params and state."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    kwargs = {}
    order = SEQUENTIAL
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        order = SHARD_GROUPS_FIRST
    else:
        mesh = init_device_mesh("cpu", (world_size,))
        if layout == "shard_dim1":  # the weights' columns: 24, 40 divide by 2 (65 does not)
            kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.shape[-1] in (24, 40) else None
    model = _shard(_build(), mesh, **kwargs)
    optimizers = _optimizers(model)
    _train(model, optimizers, range(STEPS), rank, world_size)
    ref, ref_optimizers = _reference([world_size] * STEPS, order)
    ours, theirs = _full_state(model, optimizers), _full_state(ref, ref_optimizers)
    return {
        "pairs": {k: (ours[k], theirs.get(k)) for k in ours},
        "keys": (sorted(ours), sorted(theirs)),
        "placements": {n: tuple(p.placements) for n, p in model.named_parameters()},
    }


def _scenario_against_torch() -> dict:
    """Item 2: ours on our FSDP, ours on torch's FSDP, torch's Muon on torch's FSDP."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    runs = {
        "ours": _shard(_build(), mesh),
        "ours_on_torch_fsdp": _shard(_build(), mesh, torch_fully_shard),
        "torch": _shard(_build(), mesh, torch_fully_shard),
    }
    optimizers = {
        name: _optimizers(model, torch.optim.Muon if name == "torch" else Muon)
        for name, model in runs.items()
    }
    records = []
    for step in range(TORCH_STEPS):
        x, y = _batch(step, world_size * ROWS_PER_RANK)
        comms = {}
        for name, model in runs.items():
            F.mse_loss(model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank]).backward()
            muon, adamw = optimizers[name]
            with C10dRecorder() as recorder:
                muon.step()
            comms[name] = recorder.records
            adamw.step()
            muon.zero_grad()
            adamw.zero_grad()
        records.append(
            {
                "comms": comms,
                "params": {name: _full_params(model) for name, model in runs.items()},
            }
        )
    muon = optimizers["ours"][0]
    local_numels = [p.to_local().numel() for g in muon.param_groups for p in g["params"]]
    return {"records": records, "local_numels": local_numels}


def _scenario_state_dict_layout() -> dict:
    """Item 3: the state dict of ours and of torch.optim.Muon, on the same sharded model."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    layouts = {}
    for name, cls in (("ours", Muon), ("torch", torch.optim.Muon)):
        model = _shard(_build(), mesh)
        optimizers = _optimizers(model, cls)
        _train(model, optimizers, range(1), rank, world_size)
        sd = optimizers[0].state_dict()
        layouts[name] = {
            "param_groups": sd["param_groups"],
            "state": {
                index: {
                    key: (type(v).__name__, tuple(v.placements), tuple(v.to_local().shape))
                    for key, v in entry.items()
                }
                for index, entry in sd["state"].items()
            },
        }
    return layouts


def _scenario_save(directory: str) -> dict:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _shard(_build(), init_device_mesh("cpu", (world_size,)))
    optimizers = _optimizers(model)
    _train(model, optimizers, range(K), rank, world_size)
    save_checkpoint(directory, K, model, optimizers, extra={"data_position": K})
    return {"state": _full_state(model, optimizers)}


def _scenario_load(directory: str) -> dict:
    """Resume on this world; the reference ran K steps on 2 ranks, then M on this one."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = _shard(_build(), init_device_mesh("cpu", (world_size,)))
    optimizers = _optimizers(model)
    loaded = load_checkpoint(os.path.join(directory, f"step_{K:08d}"), model, optimizers)
    state = _full_state(model, optimizers)
    _train(model, optimizers, range(loaded.extra["data_position"], K + M), rank, world_size)
    ref, ref_optimizers = _reference([2] * K + [world_size] * M)
    ours, theirs = _full_state(model, optimizers), _full_state(ref, ref_optimizers)
    return {"loaded": state, "final": {k: (ours[k], theirs[k]) for k in theirs}}


TRAIN_FLAGS = [
    "--device",
    "cpu",
    "--dim",
    "32",
    "--n-layers",
    "2",
    "--n-heads",
    "4",
    "--n-kv-heads",
    "2",
    "--vocab-size",
    "64",
    "--seq-len",
    "16",
    "--batch-size",
    "2",
    "--optimizer",
    "muon",
]


def _scenario_train_py(directory: str) -> dict:
    """Item 4: 4 steps straight; 2 steps and a checkpoint, then a resume to 4."""
    cpu = torch.device("cpu")
    runs = {}
    for name, flags in {
        "straight": ["--steps", "4"],
        "first_half": ["--steps", "2", "--checkpoint-every", "2"],
        "resumed": ["--steps", "4", "--resume"],
    }.items():
        metrics = os.path.join(directory, f"{name}.json")
        ckpt = ["--checkpoint-dir", os.path.join(directory, "train_py")]
        train.train(train.parse_args([*TRAIN_FLAGS, *flags, *ckpt, "--metrics-out", metrics]), cpu)
        dist.barrier()
        with open(metrics) as f:
            runs[name] = json.load(f)
    reader = dcp.FileSystemReader(os.path.join(directory, "train_py", f"step_{2:08d}"))
    return {"runs": runs, "saved_keys": sorted(reader.read_metadata().state_dict_metadata)}


def _worker(rank: int, world_size: int, directory: str) -> dict:
    scenarios = {}
    if world_size == 2:
        scenarios = {
            "fsdp": lambda: _scenario_reference_parity("fsdp"),
            "shard_dim1": lambda: _scenario_reference_parity("shard_dim1"),
            "against_torch": _scenario_against_torch,
            "state_dict_layout": _scenario_state_dict_layout,
            "save": lambda: _scenario_save(directory),
            "train_py": lambda: _scenario_train_py(directory),
        }
    elif world_size == 4:
        scenarios = {
            "fsdp": lambda: _scenario_reference_parity("fsdp"),
            "hsdp": lambda: _scenario_reference_parity("hsdp"),
        }
    scenarios["load"] = lambda: _scenario_load(directory)
    return run_scenarios(scenarios)


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> dict[int, list]:
    """One spawn per world size; 2 first: it saves the checkpoint that 2 and 4 load."""
    directory = str(tmp_path_factory.mktemp("muon_ckpt"))
    return {
        w: run_distributed(_worker, w, directory, timeout=240, pool=gloo_pool) for w in (2, 4)
    }


@pytest.mark.parametrize(
    ("world_size", "layout"), [(2, "fsdp"), (2, "shard_dim1"), (4, "fsdp"), (4, "hsdp")]
)
def test_bitwise_equal_to_single_process_torch_muon(runs, world_size: int, layout: str) -> None:
    for rank, rec in enumerate(scenario_records(runs[world_size], layout)):
        ours_keys, ref_keys = rec["keys"]
        assert ours_keys == ref_keys, f"rank {rank}"
        assert any(k.endswith("/momentum_buffer") for k in ours_keys)
        assert_pairs_equal(rec["pairs"], f"{layout} W={world_size} rank {rank} after {STEPS}")
    placements = scenario_records(runs[world_size], layout)[0]["placements"]
    expected = {
        "fsdp": (Shard(0),),
        "hsdp": (Replicate(), Shard(0)),
        "shard_dim1": (Shard(1),),
    }[layout]
    assert expected in placements.values(), placements


def test_collectives_and_parity_against_torch_fully_shard(runs) -> None:
    records = scenario_records(runs[2], "against_torch")
    world_size = 2
    for rank, rec in enumerate(records):
        # This rank's chunks travel in bf16 (2 bytes); it gets back its chunks too.
        sent = 2 * sum(rec["local_numels"])
        for step, step_rec in enumerate(rec["records"]):
            where = f"rank {rank} step {step}"
            ours = step_rec["comms"]["ours"]
            assert [kind for kind, _ in ours] == ["all_to_all", "all_to_all"], (where, ours)
            assert ours[0][1] == sent, (where, ours)
            assert step_rec["comms"]["ours_on_torch_fsdp"] == ours, where
            torch_kinds = [kind for kind, _ in step_rec["comms"]["torch"]]
            # At least one per matrix and Newton-Schulz iteration (5 + 3 * 4 here);
            # observed on torch 2.13: 46 all-gathers and all-reduces.
            assert len(torch_kinds) >= 17, (where, torch_kinds)
            params = step_rec["params"]
            assert_pairs_equal(
                {n: (p, params["ours_on_torch_fsdp"][n]) for n, p in params["ours"].items()},
                f"{where}: ours on our fully_shard vs ours on torch's",
            )
            _assert_within_muon_bound(params["ours"], params["torch"], steps=step + 1, where=where)
    # The owners' all-to-all returns, in all, every matrix once (bf16).
    returned = sum(rec["records"][0]["comms"]["ours"][1][1] for rec in records)
    matrices = sum(p.numel() for p in split_muon_params(_build())[0])
    assert returned == 2 * matrices, (returned, matrices)
    assert world_size == len(records)


def _assert_within_muon_bound(ours: dict, theirs: dict, steps: int, where: str) -> None:
    """Per element: ``steps * 2 * MUON_UPDATE_BOUND * lr * adjust`` (module docstring,
    item 2). AdamW's bias: bitwise after the first step (same gradients at 2 ranks),
    then AdamW's bound (its gradients follow the Muon params apart)."""
    model = _build()
    muon_params = {id(p) for p in split_muon_params(model)[0]}
    for index, (name, param) in enumerate(model.named_parameters()):
        if id(param) not in muon_params:
            atol = 0.0 if steps == 1 else adamw_param_atol(steps, lr=ADAMW["lr"])
            torch.testing.assert_close(
                ours[name], theirs[name], atol=atol, rtol=0, msg=f"{where} {name}"
            )
            continue
        group = MUON_GROUPS[0] if index == 0 else MUON_GROUPS[1]
        lr = adjust_lr(group["lr"], group.get("adjust_lr_fn"), param.shape)
        atol = steps * 2 * MUON_UPDATE_BOUND * lr
        torch.testing.assert_close(
            ours[name], theirs[name], atol=atol, rtol=0, msg=f"{where} {name}"
        )
    assert any(not torch.equal(ours[n], theirs[n]) for n in ours), "torch's Muon equals ours?"


def test_state_dict_layout_is_torch_muons(runs) -> None:
    for rank, rec in enumerate(scenario_records(runs[2], "state_dict_layout")):
        assert rec["ours"] == rec["torch"], f"rank {rank}"
        assert {key for entry in rec["ours"]["state"].values() for key in entry} == {
            "momentum_buffer"
        }


@pytest.mark.parametrize("world_size", [2, 4])
def test_checkpoint_resumes_on_another_world_size(runs, world_size: int) -> None:
    saved = scenario_records(runs[2], "save")[0]["state"]
    assert any(k.endswith("/momentum_buffer") for k in saved)
    assert any(k.endswith("/exp_avg_sq") for k in saved)
    for rank, rec in enumerate(scenario_records(runs[world_size], "load")):
        where = f"2 -> {world_size} rank {rank}"
        assert sorted(rec["loaded"]) == sorted(saved), where
        assert_pairs_equal({k: (v, rec["loaded"][k]) for k, v in saved.items()}, where)
        assert_pairs_equal(rec["final"], f"{where}, {M} steps after the resume")


def test_train_py_optimizer_muon_resumes_exactly(runs) -> None:
    rec = scenario_records(runs[2], "train_py")[0]  # rank 0 wrote the metrics
    straight, resumed = rec["runs"]["straight"], rec["runs"]["resumed"]
    assert straight["losses"][-1] < straight["losses"][0], straight["losses"]
    assert resumed["losses"] == straight["losses"][2:]
    assert resumed["params"] == straight["params"]  # floats from JSON: exact
    keys = rec["saved_keys"]
    for must in (
        "optim.state.layers.0.attention.wq.weight.momentum_buffer",  # Muon
        "optim.state.tok_embeddings.weight.exp_avg",  # AdamW
        "optim.state.output.weight.exp_avg_sq",
    ):
        assert must in keys, (must, keys)
    assert not any(k.endswith("norm.weight.momentum_buffer") for k in keys)
