"""The two executors of one `GroupComm` description give the same bits.

A group's communication is described once (runtime/comm_description.py); the eager
runtime executes it with c10d and graph mode with functional collectives, both calling
the same arithmetic (runtime/comm_math.py). Over a table of descriptions (dtypes,
uneven shards, ``Shard(1)``, HSDP with and without all-reduce, micro-batches without
sync, quantized wires with error feedback, CPU offload, custom and built-in strategies,
the all-reduce hook, divide factors, unused parameters), one ``fully_shard`` group of
parameters of several shapes runs a few micro-batches on gloo ranks three ways: eager,
graph mode uncompiled (its gather and reduction run as Python ops) and graph mode
compiled with ``aot_eager``. What the forward sees (the unsharded parameters), the
sharded gradients and error feedback's residuals must be bitwise equal.

The HSDP rows (2 x 2) and fp16's division before and after the sum (which needs 4
ranks: on 2 it divides before only) run on 4 ranks, the others on 2, since each compile
costs every rank its CPU. The shapes are uneven over the shard group either way, and
one leaves a rank a shard of padding only.
"""

import dataclasses
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

import dtensor_fsdp
from dtensor_fsdp import (
    AllGather,
    CommPrecisionPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ReduceScatter,
    fully_shard,
)
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

FP32 = torch.float32
BF16 = torch.bfloat16
# By world size. Rows: 13 is uneven over 2 ranks (7, 6), 1 leaves rank 1 padding only;
# over 4, 13 gives rank 3 one row and 5 gives it padding only; HSDP's shard groups of 2
# split 13 (7, 6) and 5 (3, 2).
SHAPES = {2: ((13, 3), (1,), (4, 8)), 4: ((13, 3), (5,), (4, 8))}
MP = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32)


@dataclasses.dataclass(frozen=True)
class Row:
    """One description: how the group is built and set, and the micro-batches of each
    step as (requires_gradient_sync, requires_all_reduce)."""

    dtypes: tuple[torch.dtype, ...] = (FP32, FP32, FP32)
    hsdp: bool = False
    mp: MixedPrecisionPolicy | None = None
    shard_dim1: bool = False
    policy: CommPrecisionPolicy | None = None
    offload: bool = False
    custom: bool = False  # set_custom_all_gather / set_custom_reduce_scatter
    allocate: bool = False  # set_allocate_memory_from_process_group_for_comm(True)
    hook: bool = False
    divide_factor: float | None = None
    force_sum: bool = False
    unused: bool = False  # the forward leaves the last param unused (reduced as zeros)
    micro_batches: tuple[tuple[bool, bool], ...] = ((True, True),)
    steps: int = 2
    world_size: int = 2


ROWS = {
    "fp32_uneven": Row(),
    "bf16_params": Row(dtypes=(BF16, BF16, BF16)),
    "mixed_precision": Row(mp=MP),
    "mixed_dtypes": Row(dtypes=(FP32, BF16, FP32), mp=MixedPrecisionPolicy(param_dtype=BF16)),
    "fp16_reduce_divided_around_the_sum": Row(
        mp=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16),
        world_size=4,
    ),
    "shard_dim1": Row(shard_dim1=True),
    "hsdp": Row(hsdp=True, mp=MP, world_size=4),
    "hsdp_all_reduce_last_micro_batch": Row(
        hsdp=True, micro_batches=((True, False), (True, False), (True, True)), world_size=4
    ),
    "no_sync_micro_batches": Row(mp=MP, micro_batches=((False, True), (False, True), (True, True))),
    "quantized_all_gather": Row(policy=CommPrecisionPolicy(all_gather="int8", block_size=8)),
    "quantized_reduce_scatter_error_feedback": Row(
        policy=CommPrecisionPolicy(reduce_scatter="int8", block_size=8, error_feedback=True),
        steps=3,
    ),
    "hsdp_replicate_only": Row(
        hsdp=True,
        policy=CommPrecisionPolicy(reduce_scatter="bf16", replicate_only=True),
        world_size=4,
    ),
    "cpu_offload": Row(offload=True, mp=MP),
    "custom_strategies": Row(custom=True),
    "process_group_allocation": Row(allocate=True, mp=MP),
    "hook_divide_factor_force_sum": Row(hook=True, divide_factor=3.0, force_sum=True),
    "unused_param_reduced": Row(unused=True),
}


class _Params(nn.Module):
    """Parameters of ``SHAPES``; the loss is each one times a per-rank seed, so its
    gradient is the seed (cast to the unsharded dtype)."""

    def __init__(self, dtypes: tuple[torch.dtype, ...], unused: bool) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        shapes = SHAPES[dist.get_world_size()]
        for i, (shape, dtype) in enumerate(zip(shapes, dtypes, strict=True)):
            param = nn.Parameter(torch.randn(shape, generator=generator).to(dtype))
            self.register_parameter(f"p{i}", param)
        self.used = len(shapes) - 1 if unused else len(shapes)
        self.seen: list[torch.Tensor] = []

    def forward(self, seeds: list[torch.Tensor]) -> torch.Tensor:
        params = [getattr(self, f"p{i}") for i in range(self.used)]
        self.seen = [p.detach().clone() for p in params]  # the unsharded params
        return sum((p * s.to(p.dtype)).float().sum() for p, s in zip(params, seeds))


class _RecordingAllGather(AllGather):
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _RecordingReduceScatter(ReduceScatter):
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _build(row: Row) -> tuple[nn.Module, dict[str, Any]]:
    if row.hsdp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = _Params(row.dtypes, row.unused)
    kwargs: dict[str, Any] = {"mesh": mesh}
    if row.mp is not None:
        kwargs["mp_policy"] = row.mp
    if row.offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if row.shard_dim1:
        kwargs["shard_placement_fn"] = lambda p: Shard(1) if p.ndim == 2 and p.shape[1] % 4 == 0 else None  # fmt: skip
    fully_shard(model, **kwargs)
    comms: dict[str, Any] = {}
    if row.policy is not None:
        model.set_comm_precision(row.policy)
    if row.custom:
        comms = {"all_gather": _RecordingAllGather(), "reduce_scatter": _RecordingReduceScatter()}
        model.set_custom_all_gather(comms["all_gather"])
        model.set_custom_reduce_scatter(comms["reduce_scatter"])
    if row.allocate:
        model.set_allocate_memory_from_process_group_for_comm(True)
    if row.hook:
        model.set_all_reduce_hook(lambda reduced: reduced.mul_(0.5).add_(1e-3))
    if row.divide_factor is not None:
        model.set_gradient_divide_factor(row.divide_factor)
    if row.force_sum:
        model.set_force_sum_reduction_for_comms(True)
    if row.unused:
        model.set_reduce_scatter_unused_params(True)
    return model, comms


def _seeds(step: int, micro: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + dist.get_rank())
    return [torch.randn(shape, generator=generator) for shape in SHAPES[dist.get_world_size()]]


def _run(row: Row, mode: str) -> dict[str, Any]:
    torch._dynamo.reset()
    model, comms = _build(row)
    if mode == "graph":
        dtensor_fsdp.enable_graph_mode(model)
    elif mode == "compiled":
        dtensor_fsdp.compile(model, backend="aot_eager", bucketing=False)
    steps = []
    for step in range(row.steps):
        seen = []
        for micro, (sync, all_reduce) in enumerate(row.micro_batches):
            model.set_requires_gradient_sync(sync)
            model.set_requires_all_reduce(all_reduce)
            model(_seeds(step, micro)).backward()
            seen.append(model.seen)
        grads = {n: p.grad.to_local().clone() if p.grad is not None else None for n, p in model.named_parameters()}
        residuals = {
            k: v.to_local().clone() for k, v in model.state_dict().items() if "error_feedback" in k
        }
        steps.append({"seen": seen, "grads": grads, "residuals": residuals})
        # A step that changes the params, so the next all-gather carries new values.
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.to_local().sub_(param.grad.to_local().to(param.dtype), alpha=0.1)
                param.grad = None
    calls = {kind: comm.calls for kind, comm in comms.items()}
    return {"steps": steps, "calls": calls}


def _scenarios(rank: int, world_size: int) -> dict:
    return run_scenarios(
        {
            name: (lambda row=row: {mode: _run(row, mode) for mode in ("eager", "graph", "compiled")})
            for name, row in ROWS.items()
            if row.world_size == world_size
        }
    )


@pytest.fixture(scope="module")
def runs(gloo_pool: GlooPools) -> dict[int, list[dict]]:
    return {
        world_size: run_distributed(_scenarios, world_size, timeout=1500, pool=gloo_pool)
        for world_size in (2, 4)
    }


def _assert_equal(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: max |diff| {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def test_table_has_every_kind_of_description() -> None:
    assert len(ROWS) >= 12


@pytest.mark.parametrize("name", list(ROWS))
def test_both_executors_give_the_same_bits(runs, name: str) -> None:
    for rank, record in enumerate(scenario_records(runs[ROWS[name].world_size], name)):
        eager = record["eager"]
        assert any(g is not None for g in eager["steps"][0]["grads"].values())
        for mode in ("graph", "compiled"):
            _assert_equal(record[mode]["steps"], eager["steps"], f"rank {rank} {mode}")
        if ROWS[name].custom:  # the user's strategies ran, as often in each executor
            calls = eager["calls"]
            assert calls["all_gather"] > 0 and calls["reduce_scatter"] > 0, calls
            assert record["graph"]["calls"] == calls, record["graph"]["calls"]
