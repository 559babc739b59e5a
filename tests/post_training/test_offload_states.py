"""Phase offload, 2 gloo ranks: ``offload_states(model, optimizer)`` and
``reload_states(offloaded)`` between training steps.

- Training after a round trip (with gradients held, or after ``zero_grad``; with the
  optimizer's state reloaded only before the step) is bitwise training without one,
  and bitwise torch's ``fully_shard`` trained the same way (torch has no offload). A
  group under ``CPUOffloadPolicy`` is left where it is and trains the same.
- Memory: after the offload, none of the tensors the device held (each group's sharded
  buffer, the sharded grads, the optimizer's state) is alive any more; each parameter,
  grad and state tensor is a view of one host chunk of its group; the same Parameter
  objects, the same optimizer. After the reload, the host chunks are gone.
- Placement on the stand-in accelerator (tests/_standin_device.py), where the device
  is not the host: after ``offload_states`` every sharded param, grad and optimizer
  state tensor is on the CPU (Adam's ``step`` stays on the CPU all along), after
  ``reload_states(optimizer=False)`` params and grads are on the device and the state
  on the CPU, after ``reload_states`` all on the device.
- While offloaded, a forward runs from the host copy (as under CPU offload) and gives
  the same logits. Refused, with nothing moved: an offload in the middle of a gradient
  accumulation; a reload after the parameters were replaced (``model.double()``).
"""

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import CPUOffloadPolicy, fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig
from dtensor_fsdp.post_training import offload_states, reload_states
from tests import _standin_device as standin
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp

WORLD_SIZE = 2
STEPS = 4
OFFLOAD_AFTER = 2  # the round trip comes after this many steps
CONFIG = LlamaConfig(
    vocab_size=67, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, max_seq_len=16
)


def _model(shard: Any = fully_shard, **kwargs: Any) -> Llama:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for block in model.layers:
        shard(block, mesh=mesh, **kwargs)
    return shard(model, mesh=mesh, **kwargs)


def _tokens() -> torch.Tensor:
    """This rank's batch, the same every step (a falling loss shows training)."""
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    return torch.randint(0, CONFIG.vocab_size, (2, 9), generator=gen)


def _loss(model: nn.Module) -> torch.Tensor:
    tokens = _tokens()
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


def _train(model: nn.Module, how: str) -> dict[str, Any]:
    """STEPS AdamW steps; ``how`` says where the round trip comes in step OFFLOAD_AFTER:
    "none", "after_step" (after zero_grad), "with_grads" (after backward) or
    "deferred" (after backward; the optimizer's state reloaded only before the step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        loss = _loss(model)
        loss.backward()
        losses.append(loss.item())
        if step == OFFLOAD_AFTER and how in ("with_grads", "deferred"):
            offloaded = offload_states(model, optimizer)
            reload_states(offloaded, optimizer=how != "deferred")
            if how == "deferred":
                reload_states(offloaded)
        optimizer.step()
        optimizer.zero_grad()
        if step == OFFLOAD_AFTER and how == "after_step":
            reload_states(offload_states(model, optimizer))
    return {
        "losses": losses,
        "shards": {n: p.to_local().clone() for n, p in model.named_parameters()},
    }


def _round_trips() -> dict[str, Any]:
    runs = {how: _train(_model(), how) for how in ("none", "after_step", "with_grads", "deferred")}
    runs["torch"] = _train(_model(torch_fully_shard), "none")
    offload = CPUOffloadPolicy(pin_memory=False)
    runs["cpu_offload_policy"] = _train(_model(offload_policy=offload), "with_grads")
    runs["cpu_offload_policy_none"] = _train(_model(offload_policy=offload), "none")
    return runs


def _memory() -> dict[str, Any]:
    """What the device held is freed; what is on the host is one chunk per group."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loss(model).backward()
    optimizer.step()
    _loss(model).backward()  # grads held too
    params = list(model.parameters())
    before = _storages(model, optimizer)
    offloaded = offload_states(model, optimizer)
    after = _storages(model, optimizer)
    out = {
        "device_freed": all(ref() is None for ref in before),
        "same_params": list(model.parameters()) == params
        and all(p is q for p, q in zip(model.parameters(), params, strict=True)),
        "host_chunks": len({id(ref()) for ref in after}),
        "groups": CONFIG.n_layers + 1,
    }
    reload_states(offloaded)
    out["host_freed"] = all(ref() is None for ref in after)
    return out


def _storages(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[weakref.ref]:
    """Weak references to the storages of every sharded param, grad and DTensor state."""
    tensors = [t for p in model.parameters() for t in (p, p.grad) if t is not None]
    tensors += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, DTensor)]
    return [weakref.ref(t.to_local().untyped_storage()) for t in tensors]


def _refused() -> dict[str, str]:
    out = {}
    model = _model()
    model.set_requires_gradient_sync(False)
    _loss(model).backward()
    shards = [p.to_local().clone() for p in model.parameters()]
    try:
        offload_states(model)
    except ValueError as error:
        out["accumulating"] = str(error)
    out["untouched"] = all(
        torch.equal(a, p.to_local()) for a, p in zip(shards, model.parameters(), strict=True)
    )
    model = _model()
    offloaded = offload_states(model)
    model.double()  # replaces the sharded params' storage behind offload's back
    try:
        reload_states(offloaded)
    except RuntimeError as error:
        out["replaced"] = str(error)
    return out


def _forward_while_offloaded() -> dict[str, Any]:
    """A forward from the host copy (as under CPU offload) equals the one before."""
    model = _model()
    with torch.no_grad():
        before = model(_tokens())
    offloaded = offload_states(model)
    with torch.no_grad():
        during = model(_tokens())
    reload_states(offloaded)
    with torch.no_grad():
        after = model(_tokens())
    return {"during": torch.equal(before, during), "after": torch.equal(before, after)}


def _standin_model(mesh: DeviceMesh, **kwargs: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The MLP on a stand-in mesh, with grads and Adam-like state made on the device
    (a stand-in cannot run a step): ``step`` on the CPU as torch.optim keeps it."""
    with torch.device(standin.DEVICE_TYPE if not kwargs else "cpu"):
        model = shard_mlp(mlp(), mesh, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        param.grad = torch.empty_like(param)
        optimizer.state[param] = {
            "step": torch.tensor(1.0),
            "exp_avg": torch.empty_like(param),
            "exp_avg_sq": torch.empty_like(param),
        }
    return model, optimizer


def _placements(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, set[str]]:
    return {
        "params": {p.to_local().device.type for p in model.parameters()},
        "grads": {p.grad.to_local().device.type for p in model.parameters()},
        "states": {s["exp_avg"].device.type for s in optimizer.state.values()}
        | {s["exp_avg_sq"].device.type for s in optimizer.state.values()},
        "steps": {s["step"].device.type for s in optimizer.state.values()},
    }


def _standin() -> dict[str, Any]:
    standin.register()  # once per process
    mesh = DeviceMesh(standin.DEVICE_TYPE, list(range(dist.get_world_size())))
    model, optimizer = _standin_model(mesh)
    out = {"start": _placements(model, optimizer)}
    offloaded = offload_states(model, optimizer, pin_memory=False)
    out["offloaded"] = _placements(model, optimizer)
    reload_states(offloaded, optimizer=False)
    out["params_back"] = _placements(model, optimizer)
    reload_states(offloaded)
    out["reloaded"] = _placements(model, optimizer)
    model, optimizer = _standin_model(mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    reload_states(offload_states(model, optimizer, pin_memory=False))
    out["cpu_offload_policy"] = _placements(model, optimizer)
    return out


def _worker(rank: int, world_size: int) -> dict:
    scenarios = {
        "round_trips": _round_trips,
        "memory": _memory,
        "refused": _refused,
        "forward_while_offloaded": _forward_while_offloaded,
    }
    if standin.is_supported():
        scenarios["standin"] = _standin
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run() -> list[dict]:
    # Its own spawn, not the session's pool: the stand-in accelerator's registration
    # (a renamed PrivateUse1 device) is process-wide and cannot be undone; a pooled
    # rank keeping it makes later runs' DCP and streams see an accelerator.
    return run_distributed(_worker, WORLD_SIZE, timeout=300)


@pytest.mark.parametrize(
    "how", ["after_step", "with_grads", "deferred", "torch", "cpu_offload_policy"]
)
def test_round_trip_trains_bitwise(run: list[dict], how: str) -> None:
    for runs in scenario_records(run, "round_trips"):
        reference = runs["cpu_offload_policy_none" if how == "cpu_offload_policy" else "none"]
        assert runs[how]["losses"] == reference["losses"]
        for name, shard in reference["shards"].items():
            assert torch.equal(runs[how]["shards"][name], shard), name
        assert runs[how]["losses"][-1] < runs[how]["losses"][0]  # it trained


def test_device_freed_one_host_chunk_per_group(run: list[dict]) -> None:
    for record in scenario_records(run, "memory"):
        assert record["device_freed"] and record["same_params"] and record["host_freed"]
        # Per group: the params' buffer, the grads' chunk, the state's chunk.
        assert record["host_chunks"] == 3 * record["groups"], record


def test_refused_with_nothing_moved(run: list[dict]) -> None:
    for record in scenario_records(run, "refused"):
        assert "accumulated gradients" in record["accumulating"] and record["untouched"]
        assert "no longer holds its offloaded parameters" in record["replaced"]


def test_forward_while_offloaded(run: list[dict]) -> None:
    for record in scenario_records(run, "forward_while_offloaded"):
        assert record == {"during": True, "after": True}


@pytest.mark.skipif(not standin.is_supported(), reason="needs Python device types")
def test_standin_placements(run: list[dict]) -> None:
    device, host = {standin.DEVICE_TYPE}, {"cpu"}
    everything = {"params", "grads", "states"}
    for record in scenario_records(run, "standin"):
        assert record["start"] == {**dict.fromkeys(everything, device), "steps": host}
        assert record["offloaded"] == {**dict.fromkeys(everything, host), "steps": host}
        assert record["params_back"] == {"params": device, "grads": device, "states": host,
                                         "steps": host}  # fmt: skip
        assert record["reloaded"] == record["start"]
        assert record["cpu_offload_policy"] == dict.fromkeys([*everything, "steps"], host)
