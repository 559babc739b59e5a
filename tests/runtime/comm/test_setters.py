"""FSDPModule's communication setters on 2 gloo ranks, against a single-process reference
on the global batch: ``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``,
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (recording implementations of
torch's ``AllGather`` / ``ReduceScatter`` interfaces), ``set_all_reduce_hook``,
``set_post_optim_event``, ``set_unshard_in_backward``, ``set_reduce_scatter_unused_params``.

The scenarios use the 3-group MLP of tests/_mlp.py; one spawn runs every scenario; each
records plain figures and tensors and the tests assert on them in the parent.
"""

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import (
    AllGather,
    CommTrace,
    FSDPModule,
    ReduceScatter,
    fully_shard,
)
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import assert_pairs_close, full_pairs, local_pairs
from tests._pool import GlooPools
from tests.runtime._lockstep import (
    BATCH,
    STEPS,
    WORLD_SIZE,
    _assert_parity,
    _batch,
    _local,
    _lockstep,
    _render,
    _sgd,
)

# torch 2.13 renamed the single-tensor collectives (the old names warn); 2.11 has only
# the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _divide_factor(rank: int, mesh: Any, factor: float | None, force_sum: bool) -> dict[str, Any]:
    """With factor 1.0 each rank's loss is its share of the global mean (sum over its
    rows / global rows), so the summed grads are the global mean's."""
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    for module in model.modules():  # not recursive, as torch's: every FSDP module
        if isinstance(module, FSDPModule) and factor is not None:
            module.set_gradient_divide_factor(factor)
        if isinstance(module, FSDPModule) and force_sum:
            module.set_force_sum_reduction_for_comms(True)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if factor == 1.0:
            return F.mse_loss(m(x), y, reduction="sum") / (WORLD_SIZE * y.numel())
        return F.mse_loss(m(x), y)

    records = _lockstep(rank, model, ref, loss=loss, steps=1)
    if factor == 1.0:  # each rank's loss is 1/W of its mean: the global mean is their sum
        records[0]["loss"] = (records[0]["loss"][0] * WORLD_SIZE, records[0]["loss"][1])
    return {"records": records}


def _divide_factor_on_the_root_only(mesh: Any) -> dict[str, Any]:
    """``set_gradient_divide_factor`` (and force-sum, which torch needs on gloo) on the
    root only: the blocks keep dividing by the world size, in both libraries."""
    base = mlp()
    models = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = shard_mlp(copy.deepcopy(base), mesh, shard=shard)
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
        model(torch.randn(2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
        models[name] = model
    return {"grads": local_pairs(models["ours"], models["torch"], grads=True)}


def _torch_divide_factor_on_gloo(mesh: Any) -> str:
    """torch's FSDP2 with a divide factor alone: what its first backward raises on
    gloo (it reduces with PREMUL_SUM, which gloo lacks); ours trains (above)."""
    model = shard_mlp(mlp(), mesh, shard=torch_fully_shard)
    model.set_gradient_divide_factor(1.0)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return f"{type(error).__name__}: {error}"
    return "no error"


class RecordingAllGather(AllGather):
    """torch 2.13's AllGather interface on the plain c10d all-gather, counting calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, int, int]] = []  # (dtype, input dim, output numel)
        self.allocations = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append((input_tensor.dtype, input_tensor.dim(), output_tensor.numel()))
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(ReduceScatter):
    """torch 2.13's ReduceScatter interface on the plain c10d reduce-scatter."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (op, input numel, output numel)
        self.allocations = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append((str(op), input_tensor.numel(), output_tensor.numel()))
        return _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    gathers = {name: RecordingAllGather() for name in ("root", "0", "2")}
    scatters = {name: RecordingReduceScatter() for name in ("root", "0", "2")}
    for name, module in (("root", model), ("0", model[0]), ("2", model[2])):
        module.set_custom_all_gather(gathers[name])  # not recursive: one per group
        module.set_custom_reduce_scatter(scatters[name])
    records = _lockstep(rank, model, ref)
    return {
        "records": records,
        "gathers": {n: (c.calls, c.allocations) for n, c in gathers.items()},
        "scatters": {n: (c.calls, c.allocations) for n, c in scatters.items()},
    }


def _all_reduce_hook(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    calls: list[tuple[str, int, int]] = []
    for name, module in (("root", model), ("0", model[0]), ("2", model[2])):
        def hook(reduced: torch.Tensor, name: str = name) -> None:
            calls.append((name, reduced.dim(), reduced.numel()))
            reduced.mul_(2)

        module.set_all_reduce_hook(hook)
    return {"records": _lockstep(rank, model, ref, steps=1), "calls": calls}


def _post_optim_event(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    # On a CPU build an Event can be made and waited on but not recorded.
    events = []

    def after_step() -> None:
        event = torch.Event()
        events.append(event)
        model.set_post_optim_event(event)

    return {"records": _lockstep(rank, model, ref, after_step=after_step), "events": len(events)}


class EmbeddingNet(nn.Module):
    """Embedding (its own group) -> Linear block -> root head; embedding backward needs
    no weight values, only the indices."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.block(self.emb(tokens)))).mean(dim=1)


def _unshard_in_backward(rank: int, mesh: Any, unshard_in_backward: bool) -> dict[str, Any]:
    base = EmbeddingNet()
    ref = copy.deepcopy(base)
    fully_shard(base.emb, mesh=mesh)
    fully_shard(base.block, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    model.emb.set_unshard_in_backward(unshard_in_backward)
    trace = CommTrace()
    model.set_comm_trace(trace)
    tokens = torch.randint(0, 16, (WORLD_SIZE * BATCH, 5), generator=torch.Generator().manual_seed(0))

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(tokens.chunk(WORLD_SIZE)[rank] if m is model else tokens), y)

    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for step in range(STEPS):
        trace.clear()
        _, y = _batch(step)
        loss(model, None, _local(y, rank)).backward()
        loss(ref, None, y).backward()
        records.append({"grads": full_pairs(model, ref, grads=True), "trace": _render(trace)})
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    return {"records": records, "params": full_pairs(model, ref, grads=False)}


class Branchy(nn.Module):
    """``b`` runs only when asked: with different flags per rank, one rank's ``b`` gets
    no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = F.relu(self.a(x))
        return h + self.b(h) if use_b else h


class BranchyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.branchy = Branchy()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.head(self.branchy(x, use_b))


def _unused_params(rank: int, mesh: Any) -> dict[str, Any]:
    """Rank 0 uses ``branchy.b``, rank 1 does not; the reference averages the two
    ranks' losses, so b's grad is half of rank 0's."""
    base = BranchyNet()
    ref = copy.deepcopy(base)
    fully_shard(base.branchy, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    trace = CommTrace()
    model.set_comm_trace(trace)
    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for step in range(STEPS):
        trace.clear()
        x, y = _batch(step)
        F.mse_loss(model(_local(x, rank), use_b=rank == 0), _local(y, rank)).backward()
        ref_loss = sum(
            F.mse_loss(ref(_local(x, r), use_b=r == 0), _local(y, r)) for r in range(WORLD_SIZE)
        ) / WORLD_SIZE
        ref_loss.backward()
        records.append({
            "grads": full_pairs(model, ref, grads=True),
            "rs_bytes": [(e.fqn, e.nbytes) for e in trace.events if e.kind == "reduce_scatter"],
        })
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    return {"records": records, "params": full_pairs(model, ref, grads=False)}


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios({
        "divide_factor_1": lambda: _divide_factor(rank, mesh, 1.0, force_sum=False),
        "divide_factor_4": lambda: _divide_factor(rank, mesh, 4.0, force_sum=False),
        "force_sum": lambda: _divide_factor(rank, mesh, None, force_sum=True),
        "force_sum_factor_1": lambda: _divide_factor(rank, mesh, 1.0, force_sum=True),
        "torch_divide_factor": lambda: _torch_divide_factor_on_gloo(mesh),
        "divide_factor_root_only": lambda: _divide_factor_on_the_root_only(mesh),
        "custom_comms": lambda: _custom_comms(rank, mesh),
        "all_reduce_hook": lambda: _all_reduce_hook(rank, mesh),
        "post_optim_event": lambda: _post_optim_event(rank, mesh),
        "unshard_in_backward": lambda: _unshard_in_backward(rank, mesh, True),
        "no_unshard_in_backward": lambda: _unshard_in_backward(rank, mesh, False),
        "unused_params": lambda: _unused_params(rank, mesh),
    })


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, timeout=180, pool=gloo_pool)


@pytest.mark.parametrize("name", ["divide_factor_1", "force_sum", "force_sum_factor_1"])
def test_divide_factor_and_sum_reduction_keep_the_numbers(run, name):
    for rec in scenario_records(run, name):
        _assert_parity(rec["records"], name)


def test_divide_factor_alone_works_on_gloo_where_torchs_raises(run):
    # README, differences: ours divides after a SUM on any backend; torch's asks gloo
    # for PREMUL_SUM (torchtitan adds set_force_sum_reduction_for_comms(True) for it).
    for outcome in scenario_records(run, "torch_divide_factor"):
        assert outcome.startswith("RuntimeError") and "PREMUL_SUM" in outcome, outcome
    for rec in scenario_records(run, "divide_factor_1"):
        _assert_parity(rec["records"], "factor 1 without force_sum")


def test_divide_factor_applies_to_the_module_it_is_set_on(run):
    # The blocks' grads are means over the 2 ranks, the root's sums: as torch's. A
    # recursive setter would double the blocks' grads.
    for rec in scenario_records(run, "divide_factor_root_only"):
        assert_pairs_close(rec["grads"], "root-only divide factor")


def test_divide_factor_divides_the_sum(run):
    # Mean losses per rank, summed over 2 ranks and divided by 4: half the average.
    for rec in scenario_records(run, "divide_factor_4"):
        _assert_parity([{"grads": rec["records"][0]["grads"]}], "factor 4", grad_scale=0.5)


def test_custom_all_gather_and_reduce_scatter_are_used(run):
    for rec in scenario_records(run, "custom_comms"):
        _assert_parity(rec["records"], "custom comms")
        gathers, scatters = rec["gathers"], rec["scatters"]
        # Per step: every group all-gathers in forward, the blocks again in backward (the
        # root keeps its params); 1-D uint8 buffers of W x the padded shard bytes (see
        # test_comm.py).
        assert gathers == {
            "root": ([(torch.uint8, 1, 272)] * STEPS, STEPS),
            "0": ([(torch.uint8, 1, 576)] * 2 * STEPS, 2 * STEPS),
            "2": ([(torch.uint8, 1, 1088)] * 2 * STEPS, 2 * STEPS),
        }
        # One SUM reduce-scatter per group per step: fp32 numels in, 1/W out.
        sum_op = str(dist.ReduceOp.SUM)
        assert scatters == {
            "root": ([(sum_op, 68, 34)] * STEPS, STEPS),
            "0": ([(sum_op, 144, 72)] * STEPS, STEPS),
            "2": ([(sum_op, 272, 136)] * STEPS, STEPS),
        }


def test_all_reduce_hook_sees_each_reduced_buffer_and_can_scale_it(run):
    for rec in scenario_records(run, "all_reduce_hook"):
        _assert_parity([{"grads": rec["records"][0]["grads"]}], "hook x2", grad_scale=2.0)
        # Once per group, on the 1-D reduced shard (padded numel / W), in backward order.
        assert rec["calls"] == [("2", 1, 136), ("root", 1, 34), ("0", 1, 72)]


def test_post_optim_event_leaves_training_unchanged(run):
    for rec in scenario_records(run, "post_optim_event"):
        assert rec["events"] == STEPS
        _assert_parity(rec["records"], "post_optim_event")


def test_unshard_in_backward_false_skips_the_backward_all_gather(run):
    default = scenario_records(run, "unshard_in_backward")[0]["records"]
    skipped = scenario_records(run, "no_unshard_in_backward")
    # By default the block's pre-backward prefetches the embedding's params.
    assert default[1]["trace"] == (
        "all_gather(root,f) all_gather(emb,f) all_gather(block,f) all_gather(block,b) "
        "all_gather(emb,b) reduce_scatter(block,b) reduce_scatter(root,b) reduce_scatter(emb,b)"
    )
    assert skipped[0]["records"][1]["trace"] == (
        "all_gather(root,f) all_gather(emb,f) all_gather(block,f) all_gather(block,b) "
        "reduce_scatter(block,b) reduce_scatter(root,b) reduce_scatter(emb,b)"
    )
    for rec in skipped:
        for step in rec["records"]:
            assert_pairs_close(step["grads"], "no unshard in backward grad")
        assert_pairs_close(rec["params"], "no unshard in backward param")


def test_reduce_scatter_unused_params(run):
    for rank, rec in enumerate(scenario_records(run, "unused_params")):
        for step in rec["records"]:
            assert_pairs_close(step["grads"], f"rank {rank} grad")
            # Both ranks reduce-scatter the whole group: a (2, 8) padded a and b, fp32.
            # x has no grad, so neither group's post-backward node fires: both reduce-scatter
            # from the final callback, the root first.
            assert step["rs_bytes"] == [("", 2 * (2 * 8 + 2) * 4), ("branchy", 2 * (8 * 8 + 8) * 4)]
        assert_pairs_close(rec["params"], f"rank {rank} param")
        grad_b = rec["records"][0]["grads"]["branchy.b.weight"][0]
        assert grad_b.abs().sum() > 0
