"""torch's pipeline schedules drive our modules as they drive torch's FSDP2 (issue 21).

pp=2 x dp=2 on 4 gloo ranks (mesh ("pp", "dp"), pp outermost as torchtitan lays it
out), 4 microbatches, each stage a root over two blocks, every block and every stage
root sharded on the dp mesh. The same stages run under torch's ``fully_shard`` and
``PipelineStage`` and under ours with ``dtensor_fsdp.pipelining``: per step, the FSDP
collectives on the dp group counted at the c10d level (the pipeline's own sends and
receives run on the pp group and are counted apart), the losses, the sharded grads and,
after an optimizer step, the sharded params.

All scenarios run in one spawn of 4 ranks (a spawn costs seconds on 2 cores).

Values are compared bitwise: both FSDPs run the same local matmuls on the same shards,
each reduction adds two dp ranks' terms (a + b == b + a exactly; [Note: parity
tolerances] in _parity.py, item 1), and the schedules divide by the microbatch count
alike.
"""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.pipelining import PipelineStage as TorchPipelineStage
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard as fully_shard_ours
from dtensor_fsdp.pipelining import PipelineStage, register_fsdp_actions
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import local_pairs
from tests._pool import GlooPools

PP, DP = 2, 2
MICROBATCHES = 4
BATCH = 8  # rows per dp rank and step: 2 per microbatch
DIM = 16
STEPS = 2  # the first step also runs the stages' metadata inference

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved1f1b": ScheduleInterleaved1F1B,
    "loopedbfs": ScheduleLoopedBFS,
    "interleavedzb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
# The schedules with several stages per rank, and which stages each pp rank holds.
MULTI_STAGE = {"interleaved1f1b", "loopedbfs", "interleavedzb", "zbv", "dualpipev"}
V_SHAPED = {"zbv", "dualpipev"}


def _stage_indices(schedule: str, pp_rank: int) -> list[int]:
    if schedule not in MULTI_STAGE:
        return [pp_rank]
    if schedule in V_SHAPED:  # the V: rank r holds stages r and 2 * PP - 1 - r
        return [pp_rank, 2 * PP - 1 - pp_rank]
    return [pp_rank, pp_rank + PP]  # looped


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class StageModule(nn.Module):
    """Two blocks and a projection of its own, so that the stage root holds a group."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.proj(x)


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _shard(stage: StageModule, shard: Callable, dp_mesh: DeviceMesh, reshard: bool) -> None:
    for block in stage.blocks:
        shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    shard(stage, mesh=dp_mesh)


def _build(
    impl: str,
    modules: dict[int, StageModule],
    num_stages: int,
    mesh: DeviceMesh,
    schedule: str,
    reshard: bool,
) -> tuple[Any, list]:
    """The stages of this rank and their schedule, for ``impl``: "torch" (torch's
    fully_shard and stage), "ours" (ours with the adapter), "ours_plain" (ours under
    torch's stage: the behaviour before the adapter, the control)."""
    shard = torch_fully_shard if impl == "torch" else fully_shard_ours
    stage_cls = PipelineStage if impl == "ours" else TorchPipelineStage
    stages = []
    for index, module in modules.items():
        module = copy.deepcopy(module)
        _shard(module, shard, mesh["dp"], reshard)
        stages.append(
            stage_cls(module, index, num_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        )
    if schedule in MULTI_STAGE:
        sched = SCHEDULES[schedule](stages, MICROBATCHES, loss_fn=_loss)
        if impl == "ours":
            register_fsdp_actions(sched)
    else:
        sched = SCHEDULES[schedule](stages[0], MICROBATCHES, loss_fn=_loss)
    return sched, stages


def _grad_pairs(ours: list, theirs: list) -> dict[str, tuple[Any, Any]]:
    """(ours, torch's) local sharded grad per stage and parameter; None where a
    parameter has no grad (see the zero-bubble case in the test)."""
    pairs = {}
    for o, t in zip(ours, theirs, strict=True):
        for (name, a), (_, b) in zip(
            o.submod.named_parameters(), t.submod.named_parameters(), strict=True
        ):
            pairs[f"{o.stage_index}.{name}"] = tuple(
                None if p.grad is None else p.grad.to_local().clone() for p in (a, b)
            )
    return pairs


def _step(sched: Any, stages: list, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    kwargs: dict[str, Any] = {}
    if any(s.is_last for s in stages):
        kwargs = {"target": y, "losses": []}
    args = (x,) if any(s.is_first for s in stages) else ()
    sched.step(*args, **kwargs)
    return [loss.item() for loss in kwargs.get("losses", [])]


def _reduction_kind(kind: str) -> str:
    # gloo: ours reduce-scatters by all-to-all, torch by reduce_scatter_tensor.
    return "reduce_scatter" if kind == "all_to_all" else kind


def _local_modules(mesh: DeviceMesh, schedule: str) -> dict[int, StageModule]:
    """This pp rank's stage modules, by stage index, of one model seeded alike on every
    rank."""
    indices = _stage_indices(schedule, mesh["pp"].get_local_rank())
    torch.manual_seed(0)
    every = [StageModule() for _ in range(PP * len(indices))]
    return {i: every[i] for i in indices}


def _pipeline(
    mesh: DeviceMesh, schedule: str, reshard: bool, impls: tuple[str, ...] = ("torch", "ours")
) -> dict[str, Any]:
    modules = _local_modules(mesh, schedule)
    num_stages = PP * len(modules)
    dp_rank = mesh["dp"].get_local_rank()
    dp_group, pp_group = mesh["dp"].get_group().group_name, mesh["pp"].get_group().group_name
    built = {impl: _build(impl, modules, num_stages, mesh, schedule, reshard) for impl in impls}
    optimizers = {
        impl: torch.optim.SGD([p for s in stages for p in s.submod.parameters()], lr=0.1)
        for impl, (_, stages) in built.items()
    }
    gen = torch.Generator().manual_seed(dp_rank)  # both pp ranks of a dp rank: one batch
    steps = []
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, DIM, generator=gen), torch.randn(BATCH, DIM, generator=gen)
        rec: dict[str, Any] = {}
        for impl, (sched, stages) in built.items():
            with C10dRecorder() as recorder:
                losses = _step(sched, stages, x, y)
            dp_records = [r for r, g in zip(recorder.records, recorder.groups) if g == dp_group]
            rec[impl] = {
                "losses": losses,
                "all_gathers": [b for k, b in dp_records if k == "all_gather"],
                # gloo: ours reduce-scatters by all-to-all, torch by reduce_scatter_tensor.
                "reductions": sorted(
                    b for k, b in dp_records if k in ("reduce_scatter", "all_to_all")
                ),
                "dp_other": [
                    k
                    for k, _ in dp_records
                    if k not in ("all_gather", "reduce_scatter", "all_to_all")
                ],
                # Every collective in issue order, by group: where the dp all-gathers
                # fall between the pipeline's sends and receives shows when a stage is
                # unsharded (a runtime schedule's UNSHARD comes before its compute).
                "sequence": [
                    ({dp_group: "dp", pp_group: "pp"}.get(g, g), _reduction_kind(k))
                    for (k, _), g in zip(recorder.records, recorder.groups, strict=True)
                ],
            }
        if "torch" in built and "ours" in built:
            rec["grads"] = _grad_pairs(built["ours"][1], built["torch"][1])
        for optimizer in optimizers.values():
            optimizer.step()
            optimizer.zero_grad()
        if "torch" in built and "ours" in built:
            rec["params"] = [
                local_pairs(o.submod, t.submod, grads=False)
                for o, t in zip(built["ours"][1], built["torch"][1], strict=True)
            ]
        steps.append(rec)
    return {"steps": steps}


def _torch_run_post_backward(module: nn.Module) -> None:
    """What torch's ``PipelineStage.perform_reduce_grad`` does to a torch FSDP module,
    through torch-internal state: each group's post-backward, then the final callback."""
    state = torch_fully_shard.state(module)
    for fsdp_state in state._state_ctx.all_states:
        for group in fsdp_state._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


def _run_post_backward(mesh: DeviceMesh) -> dict[str, Any]:
    """``FSDPModule.run_post_backward`` against torch's internal calls, on a stage
    module sharded over dp: before the first forward, after two accumulating
    backwards, a second time, and from a hook in the middle of a backward; then one
    ordinary step. Per call: the dp collectives, the local grads, whether the blocks
    are sharded."""
    torch.manual_seed(0)
    base = StageModule()
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    xs = [torch.randn(BATCH, DIM, generator=gen) for _ in range(4)]
    return {
        "torch": _post_backward_calls(copy.deepcopy(base), "torch", mesh["dp"], xs),
        "ours": _post_backward_calls(copy.deepcopy(base), "ours", mesh["dp"], xs),
    }


def _post_backward_calls(
    model: StageModule, impl: str, dp_mesh: DeviceMesh, xs: list[torch.Tensor]
) -> dict[str, Any]:
    _shard(model, torch_fully_shard if impl == "torch" else fully_shard_ours, dp_mesh, True)
    call = _torch_run_post_backward if impl == "torch" else type(model).run_post_backward
    rec: dict[str, Any] = {}

    def record(what: str, thunk: Callable[[], Any]) -> None:
        with C10dRecorder() as recorder:
            thunk()
        rec[what] = {
            "collectives": recorder.records,
            "grads": [
                None if p.grad is None else p.grad.to_local().clone() for p in model.parameters()
            ],
            "sharded": [isinstance(b.lin.weight, DTensor) for b in model.blocks],
        }

    def call_in_backward(_module: nn.Module, args: tuple) -> None:
        # Fires once the grad of blocks[1]'s input is computed: after the post-backward
        # of proj's (root) and blocks[1]'s groups, before blocks[0]'s backward.
        args[0].register_hook(lambda grad: call(model))

    if impl == "ours":
        # torch's internal calls fail before lazy init (AttributeError: its comm
        # context has no post_forward_order yet); ours does nothing.
        record("before_forward", lambda: call(model))
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False)
    for x in xs[:2]:
        model(x).sum().backward()
    model.set_requires_gradient_sync(True)
    model.set_reshard_after_backward(True)
    record("accumulated", lambda: call(model))
    record("again", lambda: call(model))
    handle = model.blocks[1].register_forward_pre_hook(call_in_backward)
    record("mid_backward", lambda: model(xs[2]).sum().backward())
    handle.remove()
    record("next_step", lambda: model(xs[3]).sum().backward())
    return rec


def _refuses_torchs_stage(mesh: DeviceMesh) -> str | None:
    """``register_fsdp_actions`` on a schedule whose stages are torch's ``PipelineStage``
    over our modules: the message, or None if it was accepted."""
    _, stages = _build("ours_plain", _local_modules(mesh, "interleaved1f1b"), 2 * PP, mesh,
                       "interleaved1f1b", False)  # fmt: skip
    schedule = ScheduleInterleaved1F1B(stages, MICROBATCHES, loss_fn=_loss)
    try:
        register_fsdp_actions(schedule)
    except TypeError as error:
        return str(error)
    return None


CASES = [(s, r) for s in SCHEDULES for r in (False, True)]


def _case_name(schedule: str, reshard: bool) -> str:
    return f"{schedule}-reshard_after_forward={reshard}"


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (PP, DP), mesh_dim_names=("pp", "dp"))
    scenarios = {_case_name(s, r): (lambda s=s, r=r: _pipeline(mesh, s, r)) for s, r in CASES}
    scenarios["control"] = lambda: _pipeline(mesh, "1f1b", False, impls=("torch", "ours_plain"))
    scenarios["run_post_backward"] = lambda: _run_post_backward(mesh)
    scenarios["refuses_torchs_stage"] = lambda: _refuses_torchs_stage(mesh)
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, PP * DP, timeout=300, pool=gloo_pool)


@pytest.mark.parametrize(("schedule", "reshard"), CASES)
def test_schedule_drives_ours_as_torchs(run, schedule, reshard):
    """Per step and rank: the same all-gathers (in issue order, bytes) and reductions on
    the dp group as torch's, the same pp traffic, bitwise losses, grads and params. With
    the zero-bubble schedules (ZBV, interleaved) and blocks resharded after forward,
    torch's FSDP leaves the last stage's blocks without grads (their weight-grad pass
    runs on resharded params); ours, driven the same way, does the same (compared as
    None)."""
    for rank, result in enumerate(scenario_records(run, _case_name(schedule, reshard))):
        for step, rec in enumerate(result["steps"]):
            ours, theirs = rec["ours"], rec["torch"]
            where = f"rank {rank} step {step}"
            assert ours["all_gathers"] == theirs["all_gathers"], (where, ours, theirs)
            assert ours["reductions"] == theirs["reductions"], (where, ours, theirs)
            assert ours["dp_other"] == theirs["dp_other"] == [], (where, ours, theirs)
            assert ours["sequence"] == theirs["sequence"], (where, ours, theirs)
            assert ours["losses"] == theirs["losses"], where
            for name, (a, b) in rec["grads"].items():
                assert (a is None) == (b is None), f"{where} grad {name}"
                assert a is None or torch.equal(a, b), f"{where} grad {name}"
            for stage_pairs in rec["params"]:
                for name, (a, b) in stage_pairs.items():
                    assert torch.equal(a, b), f"{where} param {name}"


def test_without_the_adapter_ours_reduces_every_microbatch(run):
    """The control (the behaviour before ``dtensor_fsdp.pipelining``): under torch's own
    stage ours is a plain module, reducing each of its 3 groups in every one of the 4
    microbatches' backwards (12 reductions where torch issues 3) and re-gathering in
    each; so the counts compared above can differ."""
    for rank, result in enumerate(scenario_records(run, "control")):
        for step, rec in enumerate(result["steps"]):
            plain, theirs = rec["ours_plain"], rec["torch"]
            assert len(theirs["reductions"]) == 3, (rank, step, theirs)
            assert len(plain["reductions"]) == 3 * MICROBATCHES, (rank, step, plain)
            assert len(plain["all_gathers"]) > len(theirs["all_gathers"]), (rank, step)


def test_run_post_backward_matches_torchs_internal_calls(run):
    """After accumulating backwards, a second time with nothing accumulated, and from a
    hook in the middle of a backward, then in the next ordinary step: the same
    collectives (kind, bytes, order) as torch's internal post-backward + final callback,
    bitwise grads, blocks resharded. Before any forward ours issues nothing."""
    for rank, result in enumerate(scenario_records(run, "run_post_backward")):
        ours, theirs = result["ours"], result["torch"]
        assert ours["before_forward"]["collectives"] == [], rank
        expected_reductions = {"accumulated": 3, "again": 0, "mid_backward": 3, "next_step": 3}
        for what, reductions in expected_reductions.items():
            a, b = ours[what], theirs[what]
            kinds = [(_reduction_kind(k), n) for k, n in a["collectives"]]
            assert kinds == b["collectives"], (rank, what, a["collectives"], b["collectives"])
            assert sum(k == "reduce_scatter" for k, _ in kinds) == reductions, (rank, what)
            assert a["sharded"] == b["sharded"] == [True, True], (rank, what)
            for index, (x, y) in enumerate(zip(a["grads"], b["grads"], strict=True)):
                assert x is not None and y is not None and torch.equal(x, y), (rank, what, index)


def test_register_fsdp_actions_refuses_torchs_stage_over_our_modules(run):
    for message in scenario_records(run, "refuses_torchs_stage"):
        assert message is not None and "holds dtensor_fsdp modules" in message, message
        assert "build it with dtensor_fsdp.pipelining.PipelineStage" in message, message
