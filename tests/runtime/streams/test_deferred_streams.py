"""FSDP's stream ordering under the deferred-execution backend (tests/_deferred_streams.py).

Each case trains the same model twice with our ``fully_shard``: once on the host
backend (every op at once) and once with ``DeferredStreams`` on the root's
``CommContext``, where a side stream's writes read as NaN until a wait orders them
before the read, a side stream that reads compute's writes without waiting for them
produces NaN, and freeing side-stream memory before its stream waited for compute's
last read is a recorded hazard. Losses, sharded grads and sharded params must match
bitwise (the same arithmetic; only the ordering differs), with no hazard; where the
arithmetic is torch's too (2-addend sums), also torch's ``fully_shard``'s.

The controls remove one wait each (the copy-out's wait for the all-gather stream, the
HSDP all-reduce stream's wait for the reduce-scatter input, hpZ's wait for the
post-forward buffer, the forward overlap's deferred wait, the root pre-forward's wait
for the optimizer) and show the backend then
produces NaN or a hazard: the backend can fail.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import (
    AllGather,
    CommPrecisionPolicy,
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    ReduceScatter,
)
from tests._deferred_streams import DeferredStreams
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._pool import GlooPools

WORLD_SIZE = 4
STEPS = 2
MP = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}


class SyncAllGather(AllGather):
    """A custom all-gather that runs synchronously and returns no Work (allowed by the
    interface): only the all-gather stream's event orders its output."""

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        dist.all_gather_single(output_tensor, input_tensor, group=group)  # no Work


class PlainReduceScatter(ReduceScatter):
    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        return dist.reduce_scatter_single(
            output_tensor, input_tensor, op=op, group=group, async_op=async_op
        )


@dataclass(frozen=True)
class Case:
    mesh: str  # a key of `_meshes`
    shard_kwargs: dict[str, Any] = field(default_factory=dict)  # ours and torch's
    configure: Callable[[torch.nn.Sequential], None] | None = None  # ours only
    micro_batches: int = 1  # > 1: set_requires_gradient_sync(False) but on the last
    against_torch: bool = False  # the arithmetic is torch's: compare bitwise


def _custom(model: torch.nn.Sequential) -> None:
    for module in (model, model[0], model[2]):
        module.set_custom_all_gather(SyncAllGather())
        module.set_custom_reduce_scatter(PlainReduceScatter())


def _quantized(model: torch.nn.Sequential) -> None:
    model.set_comm_precision(
        CommPrecisionPolicy(all_gather="int8", reduce_scatter="int8", block_size=64)
    )


def _prefetch(model: torch.nn.Sequential) -> None:
    model.set_modules_to_forward_prefetch([model[0], model[2]])
    model[0].set_modules_to_forward_prefetch([model[2]])
    model[2].set_modules_to_backward_prefetch([model[0]])


CASES = {
    "w1_mixed_precision": Case("w1", {"mp_policy": MP}, against_torch=True),
    "w1_offload_mixed_precision": Case("w1", {"mp_policy": MP, "offload_policy": "cpu"}),
    "fsdp2": Case("fsdp2", against_torch=True),
    "fsdp2_mixed_precision": Case("fsdp2", {"mp_policy": MP}, against_torch=True),
    "fsdp2_offload": Case("fsdp2", {"offload_policy": "cpu"}, against_torch=True),
    "hsdp_2x1": Case("hsdp_2x1", against_torch=True),
    "hsdp_2x1_mixed_precision": Case("hsdp_2x1", {"mp_policy": MP}),
    "hsdp_1x2": Case("hsdp_1x2", against_torch=True),
    "hsdp_2x2": Case("hsdp_2x2"),
    "hsdp_2x2_quantized": Case("hsdp_2x2", configure=_quantized),
    "hpz": Case("w4", {"reshard_after_forward": 2}),
    "custom_comms": Case("fsdp2", configure=_custom),
    "quantized": Case("fsdp2", configure=_quantized),
    "explicit_prefetch": Case("fsdp2", configure=_prefetch),
    "accumulation": Case("fsdp2", micro_batches=2, against_torch=True),
    "hsdp_2x1_accumulation": Case("hsdp_2x1", micro_batches=2),
}


def _meshes() -> dict[str, DeviceMesh]:
    """Every mesh the cases use, on 4 ranks (each built once: groups cost time)."""

    def sub(shape: tuple[int, ...]) -> DeviceMesh:
        return init_device_mesh("cpu", shape, mesh_dim_names=("x", "replicate", "shard"))[
            "replicate", "shard"
        ]

    return {
        "w1": init_device_mesh("cpu", (4, 1), mesh_dim_names=("x", "fsdp"))["fsdp"],
        "fsdp2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "fsdp"))["fsdp"],
        "w4": init_device_mesh("cpu", (4,)),
        "hsdp_2x1": sub((2, 2, 1)),
        "hsdp_1x2": sub((2, 1, 2)),
        "hsdp_2x2": init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")),
    }


def _shard_kwargs(case: Case, torch_api: bool) -> dict[str, Any]:
    kwargs = dict(case.shard_kwargs)
    if "mp_policy" in kwargs:
        kwargs["mp_policy"] = (TorchMixedPrecisionPolicy if torch_api else MixedPrecisionPolicy)(
            **MP
        )
    if "offload_policy" in kwargs:
        # torch's cannot pin without an accelerator; ours pins nothing on a CPU mesh, and
        # with pin_memory copies grads to the host asynchronously, as on an accelerator.
        kwargs["offload_policy"] = (
            TorchCPUOffloadPolicy(pin_memory=False) if torch_api else CPUOffloadPolicy()
        )
    return kwargs


def _loss(model: torch.nn.Module, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 3, generator=gen)
    return F.mse_loss(model(x).float(), y)


def _train(model: torch.nn.Module, case: Case, rank: int) -> dict[str, Any]:
    """STEPS optimizer steps of ``case.micro_batches`` backward passes each: the
    losses, and the local grads and params after each step."""
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads, params = [], [], []
    for step in range(STEPS):
        for micro in range(case.micro_batches):
            if case.micro_batches > 1:
                model.set_requires_gradient_sync(micro == case.micro_batches - 1)
            loss = _loss(model, step * case.micro_batches + micro, rank)
            loss.backward()
            losses.append(loss.detach().clone())
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        optim.step()
        optim.zero_grad()
        params.append({n: p.to_local().detach().clone() for n, p in model.named_parameters()})
    return {"losses": losses, "grads": grads, "params": params}


def _ours(case: Case, mesh: DeviceMesh) -> torch.nn.Sequential:
    model = shard_mlp(mlp(), mesh, **_shard_kwargs(case, torch_api=False))
    if case.configure is not None:
        case.configure(model)
    return model


def _through(
    model: torch.nn.Sequential, case: Case, rank: int, streams: DeferredStreams
) -> dict[str, Any]:
    """Train ``model`` with ``streams`` installed from the start (lazy init first)."""
    state = model._get_fsdp_state()
    state.lazy_init()
    state.ctx.streams = streams
    with streams.running():
        return _train(model, case, rank)


def _mismatches(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Where two trainings differ bitwise (NaN never equals)."""
    found = []
    for index, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True)):
        if not torch.equal(a, b):
            found.append(f"loss {index}: {a.item()} vs {b.item()}")
    for kind in ("grads", "params"):
        for step, (a, b) in enumerate(zip(ours[kind], theirs[kind], strict=True)):
            found += [f"{kind} step {step} {n}" for n in a if not torch.equal(a[n], b[n])]
    return found


def _case(rank: int, name: str, meshes: dict[str, DeviceMesh]) -> dict[str, Any]:
    case = CASES[name]
    mesh = meshes[case.mesh]
    host = _train(_ours(case, mesh), case, rank)
    streams = DeferredStreams()
    deferred = _through(_ours(case, mesh), case, rank, streams)
    record = {
        "vs_host": _mismatches(deferred, host),
        "hazards": streams.hazards,
        "stale_reads": streams.stale_reads,
        "deferred_writes": streams.deferred_writes,
    }
    if case.against_torch:
        theirs = shard_mlp(mlp(), mesh, shard=torch_fully_shard, **_shard_kwargs(case, True))
        record["vs_torch"] = _mismatches(deferred, _train(theirs, case, rank))
    return record


def _without_overlap_wait(model: torch.nn.Sequential) -> None:
    """The control's model: the kept forward all-gather output is freed without the
    all-gather stream waiting for its copy-out."""
    ctx = model._get_fsdp_state().ctx

    def release_without_wait() -> None:
        ctx._kept_all_gather = None

    ctx.release_kept_all_gather = release_without_wait


# Each control: the case, the (waiting stream, event's stream) waits it drops, and
# whether it also removes the forward overlap's deferred wait.
CONTROLS = {
    "no_copy_out_wait_w1": ("w1_mixed_precision", {("compute", "ALL_GATHER")}),
    "no_copy_out_wait_custom": ("custom_comms", {("compute", "ALL_GATHER")}),
    "no_all_reduce_wait": ("hsdp_2x1", {("ALL_REDUCE", "compute")}),
    "no_hpz_wait": ("hpz", {("ALL_GATHER", "compute")}),
    "no_overlap_wait": ("fsdp2", set()),
    "no_post_optimizer_wait": ("fsdp2", {("ALL_GATHER", "all compute")}),
}


def _control(rank: int, name: str, meshes: dict[str, DeviceMesh]) -> dict[str, Any]:
    case_name, dropped = CONTROLS[name]
    case = CASES[case_name]
    host = _train(_ours(case, meshes[case.mesh]), case, rank)
    streams = DeferredStreams(dropped=frozenset(dropped))
    model = _ours(case, meshes[case.mesh])
    if name == "no_overlap_wait":
        model._get_fsdp_state().lazy_init()
        _without_overlap_wait(model)
    deferred = _through(model, case, rank, streams)
    return {
        "vs_host": _mismatches(deferred, host),
        "nan_losses": sum(bool(loss.isnan()) for loss in deferred["losses"]),
        "hazards": streams.hazards,
        "stale_reads": streams.stale_reads,
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    meshes = _meshes()
    scenarios: dict[str, Callable[[], Any]] = {
        name: (lambda name=name: _case(rank, name, meshes)) for name in CASES
    }
    scenarios.update({name: (lambda name=name: _control(rank, name, meshes)) for name in CONTROLS})
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, timeout=300, pool=gloo_pool)


@pytest.mark.parametrize("name", list(CASES))
def test_training_through_deferred_streams_is_bitwise_the_host_training(run, name) -> None:
    for rank, rec in enumerate(scenario_records(run, name)):
        assert rec["vs_host"] == [], f"rank {rank}: {rec['vs_host']}"
        assert rec["hazards"] == [], f"rank {rank}: {rec['hazards']}"
        assert rec["stale_reads"] == 0, f"rank {rank}"
        # The backend deferred something: the side streams were used.
        assert rec["deferred_writes"] > 0, f"rank {rank}"
        # Each 2-addend sum is exact in any order (W=1: none): torch's arithmetic.
        assert rec.get("vs_torch", []) == [], f"rank {rank}: {rec['vs_torch']}"


@pytest.mark.parametrize("name", ["no_copy_out_wait_w1", "no_copy_out_wait_custom"])
def test_without_the_copy_out_wait_compute_reads_poison(run, name) -> None:
    # One rank with mixed precision (the cast runs on the all-gather stream, nothing is
    # gathered) and a custom all-gather returning no Work: only the event orders them.
    for rank, rec in enumerate(scenario_records(run, name)):
        assert rec["nan_losses"] > 0 and rec["vs_host"], f"rank {rank}: {rec}"


def test_without_the_all_reduce_wait_hsdp_reads_an_unfinished_input(run) -> None:
    # HSDP (2, 1): no reduce-scatter Work; the all-reduce stream reads the buffer
    # compute wrote, unordered: its result is poison, so are the grads.
    for rank, rec in enumerate(scenario_records(run, "no_all_reduce_wait")):
        assert rec["stale_reads"] > 0 and rec["vs_host"], f"rank {rank}: {rec}"


def test_without_the_root_pre_forward_wait_all_gathers_read_unfinished_optimizer_writes(
    run,
) -> None:
    for rank, rec in enumerate(scenario_records(run, "no_post_optimizer_wait")):
        # Step 1's all-gathers read the sharded params step 0's optimizer wrote.
        assert rec["stale_reads"] > 0 and rec["vs_host"], f"rank {rank}: {rec}"


def test_without_the_hpz_wait_backward_reads_an_unfinished_post_forward_buffer(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "no_hpz_wait")):
        assert rec["stale_reads"] > 0 and rec["vs_host"], f"rank {rank}: {rec}"


def test_without_the_overlap_wait_all_gather_memory_is_freed_under_the_copy_out(run) -> None:
    for rank, rec in enumerate(scenario_records(run, "no_overlap_wait")):
        # The kept output is freed before the all-gather stream waited for the copy-out
        # that read it: on a device its memory could be reused under that copy-out.
        assert rec["hazards"], f"rank {rank}: {rec}"
        assert rec["vs_host"] == []  # the host reuses nothing: only the hazard shows
