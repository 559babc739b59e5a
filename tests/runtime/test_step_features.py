"""Features that change how a step runs, on 2 gloo ranks against a single-process
reference on the global batch: CPU offload, ``reset_iter_state`` after an exception in
forward and in backward, ``register_fsdp_forward_method``, activation checkpointing.

One spawn runs every scenario; each records plain figures and tensors and the tests
assert on them in the parent.
"""

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import (
    register_fsdp_forward_method as torch_register_fsdp_forward_method,
)
from torch.utils.checkpoint import checkpoint

from dtensor_fsdp import (
    CommTrace,
    CPUOffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import assert_pairs_close
from tests._pool import GlooPools
from tests.runtime._lockstep import (
    STEPS,
    WORLD_SIZE,
    _assert_parity,
    _batch,
    _local,
    _lockstep,
    _render,
    _trainable_grads,
    _unsharded_bytes,
)


def _offload(rank: int, mesh: Any, pin_memory: bool) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    records = _lockstep(rank, model, ref)
    x, y = _batch(0)
    F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    return {
        "records": records,
        "param_devices": {p.to_local().device.type for p in model.parameters()},
        "grad_devices": {p.grad.to_local().device.type for p in model.parameters()},
    }


class Flaky(nn.Linear):
    """A Linear that raises inside its forward (its params unsharded) when asked."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.fail:
            raise RuntimeError("injected forward failure")
        return out


class FlakyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.b0 = nn.Linear(8, 16)
        self.b1 = Flaky(16, 16)
        self.head = nn.Linear(16, 3)
        self.fail_in_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.b0(x))
        if self.fail_in_backward:
            # Fires after b1's backward, so b1's reduce-scatter is already issued.
            h.register_hook(self._raise)
        return self.head(F.relu(self.b1(h)))

    @staticmethod
    def _raise(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected backward failure")


def _reset_iter_state(rank: int, mesh: Any, where: str) -> dict[str, Any]:
    base = FlakyNet()
    ref = copy.deepcopy(base)
    fully_shard(base.b0, mesh=mesh)
    fully_shard(base.b1, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    x, y = _batch(99)
    # One clean step first, so the failure hits a model in its steady state.
    F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    F.mse_loss(ref(x), y).backward()
    model.zero_grad()
    ref.zero_grad()
    if where == "forward":
        model.b1.fail = True
    else:
        model.fail_in_backward = True
    try:
        F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
        raised = None
    except RuntimeError as error:
        raised = str(error)
    model.b1.fail = model.fail_in_backward = False
    model.reset_iter_state()
    unsharded_after_reset = _unsharded_bytes(model)
    model.zero_grad()
    trace = CommTrace()
    model.set_comm_trace(trace)
    records = _lockstep(rank, model, ref)
    return {
        "raised": raised,
        "unsharded_after_reset": unsharded_after_reset,
        "records": records,
        "trace": _render(trace),
    }


class Generator(nn.Module):
    """``generate`` uses the root's own params directly, not through ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.body(x)))

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(self.body(x)), 2 * self.head.weight)


def _forward_method(rank: int, mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = Generator()
    ref = copy.deepcopy(base)
    plain = Generator()
    fully_shard(plain.body, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    try:
        with torch.no_grad():
            plain.generate(torch.randn(2, 8))
        out["unregistered"] = None
    except RuntimeError as error:  # the root's head.weight is still a sharded DTensor
        out["unregistered"] = str(error)
    fully_shard(base.body, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    register_fsdp_forward_method(model, "generate")
    trace = CommTrace()
    model.set_comm_trace(trace)
    x, _ = _batch(0)
    with torch.no_grad():
        generated = model.generate(_local(x, rank))
    out["no_grad_trace"] = [(e, fqn or "root", phase) for e, fqn, phase in trace.schedule()]
    out["no_grad_diff"] = (generated - ref.generate(_local(x, rank))).abs().max().item()
    out["registered_after"] = {n: type(p).__name__ for n, p in model.named_parameters()}
    theirs = Generator()
    torch_fully_shard(theirs.body, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    torch_register_fsdp_forward_method(theirs, "generate")
    with torch.no_grad():
        theirs.generate(_local(x, rank))
    out["torch_registered_after"] = {n: type(p).__name__ for n, p in theirs.named_parameters()}
    # With grad: generate's output drives a backward that reduce-scatters as usual.
    trace.clear()
    model.generate(_local(x, rank)).pow(2).mean().backward()
    ref_loss = sum(ref.generate(_local(x, r)).pow(2).mean() for r in range(WORLD_SIZE)) / WORLD_SIZE
    ref_loss.backward()
    out["grads"] = _trainable_grads(model, ref)
    out["grad_is_none"] = {n: p.grad is None for n, p in model.named_parameters()}
    out["ref_grad_is_none"] = {n: p.grad is None for n, p in ref.named_parameters()}
    out["grad_trace"] = _render(trace)
    return out


class ACNet(nn.Module):
    """Two blocks and a head; ``mode`` checkpoints each block from outside (the
    module call, so FSDP's hooks run again on recompute) or inside (a function of
    the block's forward, so no hook runs on recompute)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ACBlock(8, 16), ACBlock(16, 16)])
        self.head = nn.Linear(16, 3)
        self.outer = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.outer else block(x)
        return self.head(x)


class ACBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.inner = False
        self.recomputes = 0

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputes += 1
        return F.relu(self.linear(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False) if self.inner else self._body(x)


def _activation_checkpointing(rank: int, mesh: Any, mode: str) -> dict[str, Any]:
    base = ACNet()
    ref = copy.deepcopy(base)
    for block in base.blocks:
        block.inner = mode == "inner"
        fully_shard(block, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    model.outer = mode == "outer"
    trace = CommTrace()
    model.set_comm_trace(trace)
    records = _lockstep(rank, model, ref)
    steps = len(trace.events) // STEPS
    trace.events[:] = trace.events[-steps:]
    return {
        "records": records,
        "trace": _render(trace),
        "body_calls": [b.recomputes for b in model.blocks],  # forwards + recomputes
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios({
        "offload": lambda: _offload(rank, mesh, pin_memory=True),
        "offload_unpinned": lambda: _offload(rank, mesh, pin_memory=False),
        "reset_forward": lambda: _reset_iter_state(rank, mesh, "forward"),
        "reset_backward": lambda: _reset_iter_state(rank, mesh, "backward"),
        "forward_method": lambda: _forward_method(rank, mesh),
        "ac_none": lambda: _activation_checkpointing(rank, mesh, "none"),
        "ac_outer": lambda: _activation_checkpointing(rank, mesh, "outer"),
        "ac_inner": lambda: _activation_checkpointing(rank, mesh, "inner"),
    })


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, timeout=180, pool=gloo_pool)


@pytest.mark.parametrize("name", ["offload", "offload_unpinned"])
def test_cpu_offload_matches_reference_with_shards_on_cpu(run, name):
    for rec in scenario_records(run, name):
        _assert_parity(rec["records"], name)
        assert rec["param_devices"] == rec["grad_devices"] == {"cpu"}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_an_exception(run, where):
    for rank, rec in enumerate(scenario_records(run, f"reset_{where}")):
        assert rec["raised"] == f"injected {where} failure"
        assert rec["unsharded_after_reset"] == 0
        _assert_parity(rec["records"], f"rank {rank} after a {where} failure")
    # The steps after the reset run the normal schedule.
    trace = scenario_records(run, f"reset_{where}")[0]["trace"]
    step = (
        "all_gather(root,f) all_gather(b0,f) all_gather(b1,f) all_gather(b1,b) all_gather(b0,b) "
        "reduce_scatter(b1,b) reduce_scatter(root,b) reduce_scatter(b0,b)"
    )
    assert trace == " ".join([step] * STEPS)


def test_registered_forward_method_unshards_and_reshards(run):
    for rec in scenario_records(run, "forward_method"):
        # Unregistered, generate meets the root's sharded DTensor head.weight.
        assert rec["unregistered"] is not None and "DTensor" in rec["unregistered"]
        assert rec["no_grad_diff"] < 1e-6
        # The root stays unsharded after a no_grad call, as torch's (generate calls no
        # forward here: HF's, which does, is resharded at its end; test_eval_generate.py).
        assert rec["registered_after"] == rec["torch_registered_after"] == {
            "body.weight": "DTensor", "body.bias": "DTensor",
            "head.weight": "Parameter", "head.bias": "Parameter",
        }
        assert_pairs_close(rec["grads"], "generate grad")
        # generate does not use head.bias: no grad for it, as on the reference.
        assert rec["grad_is_none"] == rec["ref_grad_is_none"] == {
            "body.weight": False, "body.bias": False, "head.weight": False, "head.bias": True,
        }
    rec = scenario_records(run, "forward_method")[0]
    assert_expected_inline("\n".join(" ".join(t) for t in rec["no_grad_trace"]), """\
unshard root forward
unshard body forward
reshard body forward""")
    # The root is still unsharded from the no_grad call (its sharded params unchanged),
    # so only the body is all-gathered. x has no grad, so both groups reduce-scatter from
    # the final callback, root first.
    assert rec["grad_trace"] == (
        "all_gather(body,f) all_gather(body,b) reduce_scatter(root,b) reduce_scatter(body,b)"
    )


@pytest.mark.parametrize("mode", ["none", "outer", "inner"])
def test_activation_checkpointing_matches_and_adds_no_all_gather(run, mode):
    for rec in scenario_records(run, f"ac_{mode}"):
        _assert_parity(rec["records"], f"AC {mode}")
        # Recompute runs each block's body once more per step, without communicating.
        assert rec["body_calls"] == [STEPS * (1 if mode == "none" else 2)] * 2
    assert scenario_records(run, f"ac_{mode}")[0]["trace"] == (
        "all_gather(root,f) all_gather(blocks.0,f) all_gather(blocks.1,f) all_gather(blocks.1,b) "
        "all_gather(blocks.0,b) reduce_scatter(blocks.1,b) reduce_scatter(root,b) "
        "reduce_scatter(blocks.0,b)"
    )
