"""CPU offload with an accelerator mesh keeps every sharded param, sharded grad and
optimizer state tensor on the host, as torch's FSDP2 does. (Issue: on an H200 each
sharded param was a device copy that ``DTensor.from_local`` made of its host shard, not
a view of the host sharded buffer, and lazy init refused every group.)

`offload_records` makes the same model (tests/_mlp.py: two blocks and a root with
its own Linear) with ours and with torch's ``fully_shard`` and ``CPUOffloadPolicy``, in
each way a sharded model is made: eager, from a module already on the device, and on
meta followed by ``to_empty(device="cpu")`` and ``reset_parameters`` (for ours also
inside ``init_unsharded``). Right after that and after a training step (AdamW),
`check_offload_records` asserts for both: each sharded param's local tensor is on the
CPU, is a view of the storage FSDP all-gathers from (ours: the group's sharded buffer;
torch's: the param's padded shard) and is pinned iff ``pin_memory`` on an accelerator;
each sharded grad is on the CPU, pinned where torch pins it; the optimizer state is on
the CPU; and ours and torch's hold bitwise the same values. Both functions take the
mesh's device type: gloo CPU ranks here; the GPU checks call them on CUDA.

On a CPU mesh every tensor is on the CPU whatever FSDP does, so those checks cannot see
the bug on this machine. The stand-in accelerator (tests/_standin_device.py: a device
type whose tensors hold no storage) gives a ``DeviceMesh("standin", ...)`` on CPU-only
torch: the placements after ``fully_shard``, ``to_empty`` and ``init_unsharded``, a
state-dict load, a local-shard optimizer step and ``clip_grad_norm_`` run on it, with
the shards, grads and state on the host, and so does ``load_state_dict(assign=True)``
of DTensors on the device mesh into a model built on meta. Without the fix the
sharded params land on ``standin:0``, as they landed on ``cuda:0``.

Last, ``train.py --cpu-offload`` (eager and ``--meta-init``) trains bitwise as without.
"""

import contextlib
import functools
import json
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import train
from dtensor_fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    clip_grad_norm_,
    fully_shard,
    init_unsharded,
    step_on_local_shards,
)
from tests import _standin_device as standin
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import local_pairs

WORLD_SIZE = 2
Run = list[dict[str, Any]]  # each rank's scenario records
ROUTES = {
    "ours": ("eager", "on_device", "meta", "meta_init_unsharded"),
    "torch": ("eager", "on_device", "meta"),
}
# Routes whose values are the eager model's: compared bitwise with torch's eager.
SAME_VALUES = {"eager": "eager", "on_device": "on_device", "meta_init_unsharded": "eager"}
TRAIN_FLAGS = [
    "--dim", "64", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2",
    "--vocab-size", "128", "--seq-len", "16", "--batch-size", "2", "--steps", "3",
]  # fmt: skip
TRAIN_RUNS = {
    "plain": [],
    "offload": ["--cpu-offload"],
    "meta_offload": ["--meta-init", "--cpu-offload"],
}


# ---------------------------------------------------------------------------
# Building and inspecting (any device type)
# ---------------------------------------------------------------------------


def make_sharded(fsdp: str, route: str, mesh: DeviceMesh, pin_memory: bool) -> nn.Module:
    """The MLP sharded by ``fsdp`` ("ours" or "torch") with CPU offload, made by ``route``."""
    shard = fully_shard if fsdp == "ours" else torch_fully_shard
    policy = (CPUOffloadPolicy if fsdp == "ours" else TorchCPUOffloadPolicy)(pin_memory=pin_memory)
    if route.startswith("meta"):
        with torch.device("meta"):
            model = mlp()
    else:
        model = mlp()
        if route == "on_device":
            model.to(_device(mesh.device_type))
    shard_mlp(model, mesh, shard=shard, offload_policy=policy)
    if route.startswith("meta"):
        model.to_empty(device="cpu")  # torch's recipe for CPU offload
        exact = route == "meta_init_unsharded"
        with init_unsharded(model) if exact else contextlib.nullcontext():
            # The eager model's values inside init_unsharded (mlp()'s seed, module
            # order); outside, each rank draws its own shard.
            torch.manual_seed(0)
            for module in model.modules():
                if isinstance(module, nn.Linear):
                    module.reset_parameters()
    return model


def placements(model: nn.Module) -> dict[str, Any]:
    """Where each sharded param's local tensor is (device type, whether it is a view of
    the storage FSDP all-gathers from, pinned) and each sharded grad's (device type,
    pinned)."""
    storages = _shard_storages(model)
    params, grads = {}, {}
    for name, param in model.named_parameters():
        local = param.to_local()
        storage = storages[id(param)].untyped_storage()
        aliases = local.untyped_storage().data_ptr() == storage.data_ptr()
        params[name] = (local.device.type, aliases, local.is_pinned())
        if param.grad is not None:
            grad = param.grad.to_local()
            grads[name] = (grad.device.type, grad.is_pinned())
    return {"params": params, "grads": grads}


def state_devices(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, list[str]]:
    """Each param's DTensor optimizer-state tensors' device types (AdamW: two)."""
    return {
        name: sorted(
            v.to_local().device.type for v in optimizer.state[p].values() if isinstance(v, DTensor)
        )
        for name, p in model.named_parameters()
    }


def _shard_storages(model: nn.Module) -> dict[int, torch.Tensor]:
    """id(sharded param) -> what FSDP keeps its padded shard in: ours, the group's
    sharded buffer; torch's, the param's ``_sharded_param_data``."""
    storages = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state().groups:
                for fsdp_param in group.fsdp_params:
                    storages[id(fsdp_param.sharded_param)] = group.sharded_buffer
        elif isinstance(module, TorchFSDPModule):
            for group in _torch_groups(module):
                for fsdp_param in group.fsdp_params:
                    storages[id(fsdp_param.sharded_param)] = fsdp_param._sharded_param_data
    return storages


def _torch_groups(module: TorchFSDPModule) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)  # older torch: one group only
    if groups is None:
        groups = [state._fsdp_param_group]
    return [g for g in groups if g is not None]


def _device(device_type: str) -> torch.device:
    if device_type == "cpu":
        return torch.device("cpu")
    return torch.device(device_type, torch.get_device_module(device_type).current_device())


# ---------------------------------------------------------------------------
# On a real mesh: CPU here, CUDA in the GPU checks
# ---------------------------------------------------------------------------


def offload_records(device_type: str, pin_memory: bool) -> dict[str, Any]:
    """On every rank of the default process group: each FSDP and route of `ROUTES`
    on a 1-D ``device_type`` mesh, its `placements` when made and after a step (with the
    optimizer state's devices), and this rank's local values after the step.

    Returns:
        ``{"fsdp/route": {"made": ..., "stepped": ..., "state": ..., "values": ...}}``.
    """
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    device = _device(device_type)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(4, 8, generator=gen).to(device), torch.randn(4, 3, generator=gen).to(device)
    records = {}
    for fsdp, routes in ROUTES.items():
        for route in routes:
            model = make_sharded(fsdp, route, mesh, pin_memory)
            made = placements(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            F.mse_loss(model(x), y).backward()
            optimizer.step()
            records[f"{fsdp}/{route}"] = {
                "made": made,
                "stepped": placements(model),
                "state": state_devices(model, optimizer),
                "model": model,
            }
    for route, torch_route in SAME_VALUES.items():
        ours, theirs = records[f"ours/{route}"]["model"], records[f"torch/{torch_route}"]["model"]
        records[f"ours/{route}"]["values"] = {
            "params": _to_cpu(local_pairs(ours, theirs, grads=False)),
            "grads": _to_cpu(local_pairs(ours, theirs, grads=True)),
        }
    for record in records.values():
        del record["model"]
    return records


def check_offload_records(records: dict[str, Any], device_type: str, pin_memory: bool) -> None:
    """Assert what `offload_records` returned on one rank (see the module docstring)."""
    pinned = pin_memory and device_type != "cpu"  # pinning needs an accelerator
    names = set(records["torch/eager"]["made"]["params"])
    for key, record in records.items():
        for when in ("made", "stepped"):
            params = record[when]["params"]
            assert set(params) == names, (key, when)
            for name, where in params.items():
                assert where == ("cpu", True, pinned), (
                    f"{key} {when}: sharded param {name} (device, view of the sharded "
                    f"storage, pinned) is {where}, expected ('cpu', True, {pinned})"
                )
        grads = record["stepped"]["grads"]
        assert set(grads) == names, key
        for name, where in grads.items():
            assert where == ("cpu", pinned), f"{key}: sharded grad {name} is {where}"
        for name, devices in record["state"].items():
            assert devices and set(devices) == {"cpu"}, f"{key}: {name} state on {devices}"
        for kind, pairs in record.get("values", {}).items():
            for name, (ours, theirs) in pairs.items():
                # The same kernels on the same values, sums of at most two addends.
                assert torch.equal(ours, theirs), f"{key}: {kind} {name} differs from torch's"


def _to_cpu(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    return {name: (a.cpu(), b.cpu()) for name, (a, b) in pairs.items()}


# ---------------------------------------------------------------------------
# On the stand-in accelerator
# ---------------------------------------------------------------------------


@functools.cache
def _standin_mesh() -> DeviceMesh:
    """A 1-D stand-in mesh over the gloo world; the first call registers the device
    type in this process (spawned ranks only)."""
    standin.register()
    return DeviceMesh(standin.DEVICE_TYPE, list(range(dist.get_world_size())))


def _standin_placements(mesh: DeviceMesh) -> dict[str, Any]:
    """`placements` after each route that runs on the stand-in (see its module
    docstring for why torch's does not take CPU params there)."""
    routes = [("ours", r) for r in ROUTES["ours"]] + [("torch", "on_device"), ("torch", "meta")]
    return {
        f"{fsdp}/{route}": placements(make_sharded(fsdp, route, mesh, pin_memory=False))
        for fsdp, route in routes
    }


def _standin_load(mesh: DeviceMesh) -> dict[str, Any]:
    """``load_state_dict`` of full CPU tensors into an offloaded model: each rank's
    shard holds its chunk of the loaded values, still in the sharded buffer."""
    model = make_sharded("ours", "eager", mesh, pin_memory=False)
    torch.manual_seed(1)
    source = {name: torch.randn(p.shape) for name, p in model.named_parameters()}
    model.load_state_dict(source)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    return {
        "placements": placements(model),
        "values": {
            name: _compared(p.to_local(), source[name].chunk(world_size)[rank])
            for name, p in model.named_parameters()
        },
    }


def _standin_meta_assign(mesh: DeviceMesh) -> dict[str, Any]:
    """``load_state_dict(assign=True)`` into a model built on meta with CPU offload, of
    DTensors laid out as the sharded params on the device mesh (torch's documented
    route: ``distribute_tensor`` of each full value puts its shard on the device): the
    `placements` after the load."""
    with torch.device("meta"):
        model = mlp()
    shard_mlp(model, mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    on_device = {
        name: DTensor.from_local(
            torch.empty(p.to_local().shape, device=standin.DEVICE_TYPE),
            mesh,
            p.placements,
            run_check=False,
            shape=p.shape,
            stride=p.stride(),
        )
        for name, p in model.named_parameters()
    }
    model.load_state_dict(on_device, assign=True)
    return placements(model)


def _compared(a: torch.Tensor, b: torch.Tensor) -> tuple[str, str, bool]:
    """Both device types and, where both are on the host, whether ``a`` equals ``b``
    (a standin tensor has no values to compare, nor to send back to the parent)."""
    on_host = a.device.type == b.device.type == "cpu"
    return a.device.type, b.device.type, on_host and torch.equal(a, b)


def _host_grads(model: nn.Module) -> None:
    """Sharded grads on the host, as CPU offload lands them (no backward on the stand-in)."""
    for param in model.parameters():
        param.grad = param.detach().clone()


def _standin_optimizer(mesh: DeviceMesh) -> dict[str, Any]:
    """One AdamW step on host shards: on the local tensors (``step_on_local_shards``)
    and on the DTensors (torch.optim alone) give the same state, on the host."""
    models = {
        how: make_sharded("ours", "eager", mesh, pin_memory=False) for how in ("local", "dtensor")
    }
    optimizers = {}
    for how, model in models.items():
        _host_grads(model)
        optimizers[how] = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    step_on_local_shards(optimizers["local"])
    for optimizer in optimizers.values():
        optimizer.step()
    return {
        "state": {how: state_devices(models[how], optimizers[how]) for how in models},
        "values": {
            name: _compared(a.to_local(), b.to_local())
            for (name, a), b in zip(
                models["local"].named_parameters(), models["dtensor"].parameters(), strict=True
            )
        },
    }


def _standin_clip(mesh: DeviceMesh) -> tuple[Any, Any]:
    """Ours and torch's ``clip_grad_norm_`` of the same host grads: each total norm's
    device type and value (None off the host)."""
    totals = []
    for clip in (clip_grad_norm_, torch.nn.utils.clip_grad_norm_):
        model = make_sharded("ours", "eager", mesh, pin_memory=False)
        _host_grads(model)
        local = clip(model.parameters(), max_norm=0.1).to_local()  # Replicate: the total
        totals.append((local.device.type, local.item() if local.device.type == "cpu" else None))
    return tuple(totals)


def _standin_tensor_parallel_init() -> dict[str, Any]:
    """``init_unsharded`` of a tensor-parallel Linear (mesh (dp=1, tp=W)) with CPU
    offload: where the full params it registers live (the mesh's device: init draws from
    the generator the eager model would use there), and where the sharded params are
    after the exit (the host: their values are checked on a CPU mesh, the stand-in has
    none)."""
    _standin_mesh()  # registers the device type
    mesh = DeviceMesh(
        standin.DEVICE_TYPE, [list(range(dist.get_world_size()))], mesh_dim_names=("dp", "tp")
    )
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16))
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel()})
    fully_shard(model, mesh=mesh["dp"], offload_policy=CPUOffloadPolicy(pin_memory=False))
    model.to_empty(device="cpu")
    with init_unsharded(model):
        inside = {name: p.to_local().device.type for name, p in model.named_parameters()}
        for param in model.parameters():
            nn.init.constant_(param, 0.5)
    return {"inside": inside, "after": placements(model)}


def _standin_materialized_on_device(mesh: DeviceMesh) -> str:
    """``to_empty`` on the device with CPU offload, then ``init_unsharded``: its error."""
    with torch.device("meta"):
        model = mlp()
    shard_mlp(model, mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    model.to_empty(device=standin.DEVICE_TYPE)
    try:
        with init_unsharded(model):
            pass
    except RuntimeError as exc:
        return str(exc)
    return "no error"


# ---------------------------------------------------------------------------
# train.py
# ---------------------------------------------------------------------------


def _train(flags: list[str], path: str) -> dict[str, Any]:
    args = train.parse_args([*TRAIN_FLAGS, *flags, "--metrics-out", path])
    train.train(args, torch.device("cpu"))
    dist.barrier()  # rank 0 has written the file
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


def _run(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    scenarios = {"cpu": lambda: offload_records("cpu", pin_memory=False)}
    for label, flags in TRAIN_RUNS.items():
        path = os.path.join(directory, f"{label}.json")
        scenarios[f"train_{label}"] = lambda flags=flags, path=path: _train(flags, path)
    if standin.is_supported():  # last: the first registers the device type for good
        scenarios["standin"] = lambda: _standin_placements(_standin_mesh())
        scenarios["standin_load"] = lambda: _standin_load(_standin_mesh())
        scenarios["standin_meta_assign"] = lambda: _standin_meta_assign(_standin_mesh())
        scenarios["standin_optimizer"] = lambda: _standin_optimizer(_standin_mesh())
        scenarios["standin_clip"] = lambda: _standin_clip(_standin_mesh())
        scenarios["standin_tensor_parallel_init"] = _standin_tensor_parallel_init
        scenarios["standin_to_empty_on_device"] = lambda: _standin_materialized_on_device(
            _standin_mesh()
        )
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    directory = str(tmp_path_factory.mktemp("offload"))
    return run_distributed(_run, WORLD_SIZE, directory, timeout=300)


def test_sharded_params_grads_and_state_stay_on_the_host_as_torchs(run: Run) -> None:
    for records in scenario_records(run, "cpu"):
        check_offload_records(records, "cpu", pin_memory=False)


needs_standin = pytest.mark.skipif(
    not standin.is_supported(), reason="this torch cannot register a Python device type"
)


@needs_standin
def test_standin_accelerator_sharded_params_are_views_of_the_host_buffer(run: Run) -> None:
    for records in scenario_records(run, "standin"):
        for key, record in records.items():
            for name, where in record["params"].items():
                assert where == ("cpu", True, False), (
                    f"{key}: sharded param {name} (device, view of the sharded storage, "
                    f"pinned) is {where}: FSDP moved it to the mesh's device"
                )


@needs_standin
def test_standin_accelerator_load_state_dict_keeps_the_host_shards(run: Run) -> None:
    for record in scenario_records(run, "standin_load"):
        for name, where in record["placements"]["params"].items():
            assert where == ("cpu", True, False), (name, where)
        for name, compared in record["values"].items():
            assert compared == ("cpu", "cpu", True), (name, compared)


@needs_standin
def test_standin_accelerator_assign_load_into_meta_lands_on_the_host(run: Run) -> None:
    # torch's with pin_memory (its default) moves each assigned shard to the host too;
    # without, it leaves it on the device and lazy init refuses it.
    for record in scenario_records(run, "standin_meta_assign"):
        for name, where in record["params"].items():
            assert where == ("cpu", True, False), (name, where)


@needs_standin
def test_standin_accelerator_local_shard_step_keeps_state_on_the_host(run: Run) -> None:
    for record in scenario_records(run, "standin_optimizer"):
        assert record["state"]["local"] == record["state"]["dtensor"]
        assert all(devices == ["cpu", "cpu"] for devices in record["state"]["local"].values())
        for name, compared in record["values"].items():
            assert compared == ("cpu", "cpu", True), (name, compared)


@needs_standin
def test_standin_accelerator_total_norm_is_where_torchs_is(run: Run) -> None:
    for ours, theirs in scenario_records(run, "standin_clip"):
        assert ours[0] == theirs[0] == "cpu", (ours, theirs)
        # The same squares summed in another order (per-rank, then across ranks).
        assert ours[1] == pytest.approx(theirs[1], rel=1e-6)


@needs_standin
def test_standin_accelerator_tensor_parallel_init_unsharded_back_on_the_host(run: Run) -> None:
    for record in scenario_records(run, "standin_tensor_parallel_init"):
        # Full params on the compute device (the generator an eager model draws from).
        assert set(record["inside"].values()) == {standin.DEVICE_TYPE}, record["inside"]
        for name, where in record["after"]["params"].items():
            assert where == ("cpu", True, False), (name, where)


@needs_standin
def test_standin_accelerator_init_unsharded_names_the_offload_fix(run: Run) -> None:
    for message in scenario_records(run, "standin_to_empty_on_device"):
        assert "with CPU offloading FSDP parameters should be materialized on CPU" in message
        assert 'module.to_empty(device="cpu")' in message


def test_train_py_cpu_offload_trains_bitwise_as_without(run: Run) -> None:
    plain = scenario_records(run, "train_plain")[0]
    for label in ("offload", "meta_offload"):
        metrics = scenario_records(run, f"train_{label}")[0]
        assert metrics == plain, label
