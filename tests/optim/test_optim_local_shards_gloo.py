"""``step_on_local_shards`` in real training on gloo ranks.

Three runs per scenario, same seed and data, ``STEPS`` steps: torch's ``fully_shard``
+ ``torch.optim`` (the reference), ours + ``torch.optim`` on the DTensors, and ours +
the local-shard step. At W=2 every reduction adds two terms, so the three must agree
bitwise: per-step losses and the final local shards (tests/_parity.py, [Note:
parity tolerances], item 1). A single-process model stepped by the same optimizer
with the ranks' ``full_tensor()`` grads must end bitwise equal too: an element-wise
update computes each element the same way on a shard as on the whole tensor.

Scenarios (one 2-rank spawn): optimizer configurations from ``_optim_cases.py`` (AdamW
with no weight decay for norms and a StepLR, SGD Nesterov, Adagrad, centered RMSprop,
Adam amsgrad+maximize, a user Lion with ``elementwise=True``), CPU
offload, ``torch.amp.GradScaler`` (with a skipped step on inf grads), and the
optimizer state dicts (``optimizer.state_dict()`` and ``get_state_dict``, fresh and
trained) against torch's.

FSDP + TP (in the 4-rank spawn): the same three runs on a 2 x 2 (dp, tp) mesh.

Checkpoints: ``dtensor_fsdp.checkpoint`` saves at W=2 after ``K`` local-shard steps;
resuming at W=2 continues bitwise equal to the uninterrupted run; at W=4 and W=1 (one
spawn each) the loaded params and optimizer state equal the saved ones exactly, the
local-shard step and the DTensor step continue bitwise equal to each other, and the
losses match the uninterrupted run's to fp32 reduction-order rounding.
"""

from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import CPUOffloadPolicy, fully_shard
from dtensor_fsdp.checkpoint import load_checkpoint, save_checkpoint
from dtensor_fsdp.models.llama import Llama, LlamaConfig, apply_tensor_parallel, cross_entropy_loss
from dtensor_fsdp.optim import step_on_local_shards
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import full, full_state, mean_over_world
from tests._pool import GlooPools
from tests.optim._optim_cases import CASES

CONFIG = LlamaConfig(
    vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)  # every dim 0 (64, 88, 32, 16 rows) splits evenly over 1, 2 and 4 ranks
GLOBAL_BATCH = 4  # rows per step, split over the ranks
STEPS = 20
PARITY_CASES = (
    "adamw_groups_steplr",
    "sgd_nesterov",
    "adagrad",
    "rmsprop_centered",
    "adam_amsgrad_maximize",
    "lion",
)
CKPT_CASE = "adamw_groups_steplr"  # StepLR(5): the decay falls after the checkpoint
K, M = 3, 3  # steps before and after the checkpoint
TP_STEPS = 5
# Resumed at another world size, the grads sum the ranks' terms in another order: a few
# ulps, amplified by AdamW over M steps; the losses stay within this (as in
# test_state_dict.py).
LOSS_RTOL = 1e-5
KINDS = ("torch", "ours", "ours_local")


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------


@dataclass
class Run:
    model: Llama
    optimizer: torch.optim.Optimizer
    scheduler: object | None
    scaler: torch.amp.GradScaler | None = None
    losses: list[float] = field(default_factory=list)
    dp: tuple[int, int] | None = None  # (rank, size) among data-parallel ranks; None: world


def _mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _run(
    mesh: DeviceMesh,
    kind: str,
    case: str,
    *,
    offload: bool = False,
    tp_mesh: DeviceMesh | None = None,
) -> Run:
    """``kind``: torch's fully_shard, ours stepped on DTensors, or ours on local shards;
    with ``tp_mesh``, tensor parallelism first (FSDP + TP)."""
    torch.manual_seed(0)
    model = Llama(CONFIG)
    if tp_mesh is not None:
        apply_tensor_parallel(model, tp_mesh)
    if kind == "torch":
        shard, policy = torch_fully_shard, TorchCPUOffloadPolicy
    else:
        shard, policy = fully_shard, CPUOffloadPolicy
    kwargs = {"offload_policy": policy(pin_memory=False)} if offload else {}
    for block in model.layers:
        shard(block, mesh=mesh, **kwargs)
    shard(model, mesh=mesh, **kwargs)
    optimizer, scheduler = CASES[case].build(model.named_parameters())
    if kind == "ours_local":
        step_on_local_shards(optimizer, elementwise=CASES[case].elementwise)
    return Run(model, optimizer, scheduler)


def _tokens(step: int, dp: tuple[int, int] | None) -> torch.Tensor:
    """This data-parallel rank's rows of the global batch of ``step``:
    (GLOBAL_BATCH / dp size, T + 1)."""
    rank, size = dp or (dist.get_rank(), dist.get_world_size())
    generator = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(
        0, CONFIG.vocab_size, (GLOBAL_BATCH, CONFIG.max_seq_len + 1), generator=generator
    )
    return tokens.chunk(size)[rank]


def _backward(run: Run, step: int, scale: float = 1.0) -> None:
    tokens = _tokens(step, run.dp)
    loss = cross_entropy_loss(run.model(tokens[:, :-1]), tokens[:, 1:])
    run.losses.append(mean_over_world(loss))
    loss = loss * scale
    (loss if run.scaler is None else run.scaler.scale(loss)).backward()


def _optimizer_step(run: Run) -> None:
    if run.scaler is None:
        run.optimizer.step()
    else:
        run.scaler.step(run.optimizer)
        run.scaler.update()
    if run.scheduler is not None:
        run.scheduler.step()
    run.optimizer.zero_grad()


def _train(run: Run, steps: range) -> None:
    for step in steps:
        _backward(run, step)
        _optimizer_step(run)


def _locals(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.to_local().detach().clone() for name, p in model.named_parameters()}


def _full_grads(model: nn.Module) -> list[torch.Tensor]:
    """``full_tensor()`` of every grad with one all-gather: every dim 0 splits evenly
    (CONFIG), so rank r's local grads, flattened back to back, are the r-th row of
    (W, numel / W) and each param's columns are its dim-0 chunks in rank order.
    (``all_gather`` of a list: the one spelling torch 2.11 to 2.14 all accept.)"""
    grads = [p.grad for p in model.parameters()]
    world_size = dist.get_world_size()
    assert all(g.to_local().numel() * world_size == g.numel() for g in grads)
    flat = torch.cat([g.to_local().reshape(-1) for g in grads])  # (numel / W,)
    rows = [torch.empty_like(flat) for _ in range(world_size)]
    dist.all_gather(rows, flat)
    columns = torch.stack(rows).split([g.to_local().numel() for g in grads], dim=1)
    return [c.reshape(g.shape) for c, g in zip(columns, grads, strict=True)]


def _scenario_parity(mesh: DeviceMesh, case: str, *, offload: bool = False) -> dict:
    """The three kinds, plus a single-process model fed the local-shard run's full
    grads (``full_tensor()``) and stepped by the same optimizer configuration."""
    runs = {kind: _run(mesh, kind, case, offload=offload) for kind in KINDS}
    torch.manual_seed(0)
    reference = Llama(CONFIG)
    ref_optimizer, ref_scheduler = CASES[case].build(reference.named_parameters())
    for step in range(STEPS):
        for run in runs.values():
            _backward(run, step)
        grads = _full_grads(runs["ours_local"].model)
        for p, grad in zip(reference.parameters(), grads, strict=True):
            p.grad = grad
        for run in runs.values():
            _optimizer_step(run)
        ref_optimizer.step()
        if ref_scheduler is not None:
            ref_scheduler.step()
        ref_optimizer.zero_grad()
    return {
        "losses": {kind: run.losses for kind, run in runs.items()},
        "locals": {kind: _locals(run.model) for kind, run in runs.items()},
        "full": {n: full(p) for n, p in runs["ours_local"].model.named_parameters()},
        "reference": {n: p.detach().clone() for n, p in reference.named_parameters()},
        "devices": {p.to_local().device.type for p in runs["ours_local"].model.parameters()},
    }


def _scenario_fsdp_tp() -> dict:
    """FSDP + TP on a 2 x 2 (dp, tp) mesh: params with (_StridedShard, Shard),
    (Shard, Shard) and (Shard, Replicate) placements."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    runs = {}
    for kind in KINDS:
        run = runs[kind] = _run(mesh["dp"], kind, "adamw_groups_steplr", tp_mesh=mesh["tp"])
        run.dp = (mesh.get_local_rank("dp"), 2)
        _train(run, range(TP_STEPS))
    return {
        "losses": {kind: run.losses for kind, run in runs.items()},
        "locals": {kind: _locals(run.model) for kind, run in runs.items()},
        "placements": {tuple(p.placements) for p in runs["ours_local"].model.parameters()},
    }


def _scenario_grad_scaler(mesh: DeviceMesh) -> dict:
    """GradScaler on the CPU: scale, unscale (on the DTensor grads), step, update; step
    3 has inf grads, so the scaler skips it and halves the scale."""
    runs = {kind: _run(mesh, kind, "adamw_foreach") for kind in KINDS}
    scales = {kind: [] for kind in KINDS}
    for kind, run in runs.items():
        run.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        for step in range(8):
            _backward(run, step, scale=float("inf") if step == 3 else 1.0)
            _optimizer_step(run)
            scales[kind].append(run.scaler.get_scale())
    return {
        "scales": scales,
        "locals": {kind: _locals(run.model) for kind, run in runs.items()},
        "steps": {
            kind: next(iter(run.optimizer.state.values()))["step"].item()
            for kind, run in runs.items()
        },
    }


def _describe(value: object) -> object:
    """A state-dict value as comparable plain data: DTensors by type, placements,
    global shape, stride and local values; containers recursively."""
    if isinstance(value, DTensor):
        return (
            "DTensor",
            tuple(value.placements),
            tuple(value.shape),
            value.stride(),
            value.to_local().clone(),
        )
    if isinstance(value, torch.Tensor):
        return ("Tensor", tuple(value.shape), value.clone())
    if isinstance(value, dict):
        return {key: _describe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(item) for item in value]
    return value


def _scenario_state_dicts(mesh: DeviceMesh) -> dict:
    """``get_state_dict`` before any step (torch initializes the state with an lr=0
    step, through our wrapper) and after 2 steps, and ``optimizer.state_dict()``."""
    records = {}
    for kind in ("torch", "ours_local"):
        run = _run(mesh, kind, "adamw_groups_steplr")
        fresh = get_state_dict(run.model, run.optimizer)[1]
        _train(run, range(2))
        records[kind] = {
            "fresh": _describe(fresh),
            "trained": _describe(get_state_dict(run.model, run.optimizer)[1]),
            "optimizer": _describe(run.optimizer.state_dict()),
        }
    return records


def _resume(mesh: DeviceMesh, kind: str, path: str) -> Run:
    run = _run(mesh, kind, CKPT_CASE)
    loaded = load_checkpoint(path, run.model, run.optimizer)
    run.scheduler.load_state_dict(loaded.extra["scheduler"])
    return run


def _scenario_save(mesh: DeviceMesh, directory: str) -> dict:
    run = _run(mesh, "ours_local", CKPT_CASE)
    _train(run, range(K))
    path = save_checkpoint(
        directory, K, run.model, run.optimizer, extra={"scheduler": run.scheduler.state_dict()}
    )
    saved = full_state(run.model, run.optimizer)
    _train(run, range(K, K + M))
    resumed = _resume(mesh, "ours_local", path)
    loaded = full_state(resumed.model, resumed.optimizer)
    _train(resumed, range(K, K + M))
    return {
        "path": path,
        "saved": saved,
        "loaded": loaded,
        "losses": run.losses,
        "resumed_losses": resumed.losses,
        "locals": _locals(run.model),
        "resumed_locals": _locals(resumed.model),
        "lr": (run.optimizer.param_groups[0]["lr"], resumed.optimizer.param_groups[0]["lr"]),
    }


def _scenario_load(mesh: DeviceMesh, path: str) -> dict:
    records = {}
    for kind in ("ours_local", "ours"):
        run = _resume(mesh, kind, path)
        loaded = full_state(run.model, run.optimizer)
        _train(run, range(K, K + M))
        records[kind] = {"loaded": loaded, "losses": run.losses, "locals": _locals(run.model)}
    return records


def _worker_2(rank: int, world_size: int, directory: str) -> dict:
    mesh = _mesh()
    scenarios = {
        f"parity/{case}": (lambda case=case: _scenario_parity(mesh, case)) for case in PARITY_CASES
    }
    scenarios["cpu_offload"] = lambda: _scenario_parity(mesh, "adamw_foreach", offload=True)
    scenarios["grad_scaler"] = lambda: _scenario_grad_scaler(mesh)
    scenarios["state_dicts"] = lambda: _scenario_state_dicts(mesh)
    scenarios["save"] = lambda: _scenario_save(mesh, directory)
    return run_scenarios(scenarios)


def _load_worker(rank: int, world_size: int, path: str) -> dict:
    mesh = _mesh()
    scenarios = {"load": lambda: _scenario_load(mesh, path)}
    if world_size == 4:
        scenarios["fsdp_tp"] = _scenario_fsdp_tp
    return run_scenarios(scenarios)


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> dict:
    directory = str(tmp_path_factory.mktemp("local_shard_ckpt"))
    return {"two": run_distributed(_worker_2, 2, directory, pool=gloo_pool)}


@pytest.fixture(scope="module")
def loaded(runs: dict, gloo_pool: GlooPools) -> dict[int, list]:
    """The W=2 checkpoint loaded at other world sizes (4 and 1: full tier only)."""
    path = scenario_records(runs["two"], "save")[0]["path"]
    return {w: run_distributed(_load_worker, w, path, pool=gloo_pool) for w in (4, 1)}


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(a) == sorted(b), what
    for key, value in a.items():
        assert value.dtype == b[key].dtype and torch.equal(value, b[key]), f"{what}: {key}"


def _assert_parity(records: list[dict]) -> None:
    for rank, rec in enumerate(records):
        losses = rec["losses"]
        assert len(losses["torch"]) == STEPS
        assert losses["ours"] == losses["torch"], f"rank {rank}: ours (DTensor step) vs torch"
        assert losses["ours_local"] == losses["torch"], f"rank {rank}: local step vs torch"
        _assert_equal(rec["locals"]["ours"], rec["locals"]["torch"], f"rank {rank} ours")
        _assert_equal(rec["locals"]["ours_local"], rec["locals"]["torch"], f"rank {rank} local")
        _assert_equal(rec["full"], rec["reference"], f"rank {rank} single process")


@pytest.mark.parametrize("case", PARITY_CASES)
def test_training_bitwise_equal_to_torch(runs: dict, case: str) -> None:
    _assert_parity(scenario_records(runs["two"], f"parity/{case}"))


def test_cpu_offload(runs: dict) -> None:
    records = scenario_records(runs["two"], "cpu_offload")
    _assert_parity(records)
    assert records[0]["devices"] == {"cpu"}


def test_grad_scaler(runs: dict) -> None:
    for rank, rec in enumerate(scenario_records(runs["two"], "grad_scaler")):
        assert rec["scales"]["ours_local"] == rec["scales"]["torch"] == rec["scales"]["ours"]
        assert rec["scales"]["torch"][3] == rec["scales"]["torch"][2] / 2, "inf grads: halved"
        assert rec["steps"]["ours_local"] == rec["steps"]["torch"] == 7, "step 3 was skipped"
        _assert_equal(rec["locals"]["ours_local"], rec["locals"]["torch"], f"rank {rank}")
        _assert_equal(rec["locals"]["ours"], rec["locals"]["torch"], f"rank {rank}")


def _assert_same_described(a: object, b: object, where: str) -> None:
    if isinstance(b, dict):
        assert isinstance(a, dict) and list(a) == list(b), where
        for key in b:
            _assert_same_described(a[key], b[key], f"{where}/{key}")
    elif isinstance(b, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same_described(x, y, f"{where}[{index}]")
    elif isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where


def test_state_dicts_match_torch(runs: dict) -> None:
    """Same keys, types, placements, shapes, strides and values as torch's
    ``fully_shard`` + ``torch.optim``, from ``optimizer.state_dict()`` and from
    ``get_state_dict`` (fresh: its lr=0 initializing step ran through our wrapper)."""
    for rank, rec in enumerate(scenario_records(runs["two"], "state_dicts")):
        for what in ("fresh", "trained", "optimizer"):
            _assert_same_described(
                rec["ours_local"][what], rec["torch"][what], f"rank {rank} {what}"
            )
        trained = rec["ours_local"]["trained"]["state"]
        assert trained["layers.0.attention.wq.weight"]["exp_avg"][0] == "DTensor"
        assert trained["layers.0.attention.wq.weight"]["step"][0] == "Tensor"


def test_checkpoint_resume_same_world_is_bitwise(runs: dict) -> None:
    for rank, rec in enumerate(scenario_records(runs["two"], "save")):
        _assert_equal(rec["loaded"], rec["saved"], f"rank {rank} loaded state")
        assert rec["resumed_losses"] == rec["losses"][K:], f"rank {rank}"
        _assert_equal(rec["resumed_locals"], rec["locals"], f"rank {rank} resumed params")
        assert rec["lr"][0] == rec["lr"][1] == 1e-2 * 0.5, "StepLR decayed after the resume"


@pytest.mark.full
def test_fsdp_tp_bitwise_equal_to_torch(loaded: dict[int, list]) -> None:
    records = scenario_records(loaded[4], "fsdp_tp")
    for rank, rec in enumerate(records):
        assert len(rec["losses"]["torch"]) == TP_STEPS
        assert rec["losses"]["ours_local"] == rec["losses"]["ours"] == rec["losses"]["torch"]
        _assert_equal(rec["locals"]["ours_local"], rec["locals"]["torch"], f"rank {rank}")
        _assert_equal(rec["locals"]["ours"], rec["locals"]["torch"], f"rank {rank}")
    placements = {str(p) for p in records[0]["placements"]}
    assert any("_StridedShard" in p for p in placements) and any(
        "Replicate" in p for p in placements
    )


@pytest.mark.full
@pytest.mark.parametrize("world_size", [4, 1])
def test_checkpoint_resume_other_world(runs: dict, loaded: dict[int, list], world_size: int) -> None:
    saved = scenario_records(runs["two"], "save")[0]
    assert any(key.endswith("/exp_avg_sq") for key in saved["saved"])
    for rank, rec in enumerate(scenario_records(loaded[world_size], "load")):
        where = f"2 -> {world_size} rank {rank}"
        local, dtensor = rec["ours_local"], rec["ours"]
        _assert_equal(local["loaded"], saved["saved"], f"{where} loaded state")
        _assert_equal(dtensor["loaded"], saved["saved"], f"{where} loaded state (DTensor step)")
        assert local["losses"] == dtensor["losses"], where
        _assert_equal(local["locals"], dtensor["locals"], f"{where}: local vs DTensor step")
        assert local["losses"] == pytest.approx(saved["losses"][K:], rel=LOSS_RTOL), where
