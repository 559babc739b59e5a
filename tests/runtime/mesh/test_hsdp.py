"""HSDP: ``fully_shard`` on a 2-D ``(replicate, shard)`` mesh of 4 gloo ranks (2 x 2).

Parameters are ``(Replicate(), Shard(0))`` DTensors: sharded over the shard axis,
replicated over the replicate axis. Each step all-gathers over the shard axis (2 ranks),
reduce-scatters over it, then all-reduces the shard-reduced gradients over the replicate
axis (2 ranks), once per group. All four ranks are data-parallel ranks and get their own
slice of the global batch.

References: a single-process model on the global batch (losses, clipped grad norms,
``full_tensor()`` grads and params), and torch's ``fully_shard`` on the same 2-D mesh
(local shards and local grads). One spawn runs every scenario; the parent asserts.
"""

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard

from dtensor_fsdp import CommTrace, fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import (
    assert_pairs_close,
    assert_pairs_equal,
    assert_params_close,
    assert_train_parity,
    local_pairs,
    make_optimizer,
    placements,
    train_against_reference,
)
from tests._pool import GlooPools

WORLD_SIZE, REPLICATE, SHARD = 4, 2, 2
STEPS = 3
PER_RANK_BATCH = 2
HSDP = (Replicate(), Shard(0))


class MLP(nn.Module):
    """Dim-0 sizes 20, 13 and 3 in blocks and a root-owned head of 7 rows: all but 20
    are uneven over the 2-rank shard axis."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(16, 20), nn.Linear(20, 13), nn.Linear(13, 3)])
        self.head = nn.Linear(3, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = F.relu(block(x))
        return self.head(x)


LLAMA = LlamaConfig(
    vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden_dim=88, max_seq_len=16
)


def _build(family: str) -> nn.Module:
    torch.manual_seed(0)
    return MLP() if family == "mlp" else Llama(LLAMA)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.blocks if isinstance(model, MLP) else model.layers)


def _batch(family: str, step: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * (family == "llama") + step)
    if family == "mlp":
        return torch.randn(rows, 16, generator=gen), torch.randint(0, 7, (rows,), generator=gen)
    tokens = torch.randint(0, LLAMA.vocab_size, (rows, 13), generator=gen)  # (rows, T + 1)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(family: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return F.cross_entropy if family == "mlp" else cross_entropy_loss


def _shard(model: nn.Module, mesh: DeviceMesh, shard: Callable = fully_shard) -> nn.Module:
    for block in _blocks(model):
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the 4 data-parallel ranks: replicate-major."""
    return mesh.get_local_rank("replicate") * SHARD + mesh.get_local_rank("shard")


def _local(mesh: DeviceMesh) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: t.chunk(WORLD_SIZE)[_dp_rank(mesh)]


# ---------------------------------------------------------------------------
# Scenarios (run in every rank)
# ---------------------------------------------------------------------------


def _init(mesh: DeviceMesh) -> dict:
    base = _build("mlp")
    model = _shard(copy.deepcopy(base), mesh)
    shard_rank = mesh.get_local_rank("shard")
    expected = {
        name: (HSDP, tuple(p.chunk(SHARD)[shard_rank].shape)) for name, p in base.named_parameters()
    }
    return {"placements": placements(model), "expected": expected}


def _train(mesh: DeviceMesh, family: str) -> list[dict]:
    base = _build(family)
    batches = [_batch(family, step, WORLD_SIZE * PER_RANK_BATCH) for step in range(STEPS)]
    return train_against_reference(
        _shard(copy.deepcopy(base), mesh), base, batches, _local(mesh), _loss(family)
    )


def _accumulate(mesh: DeviceMesh) -> list[dict]:
    """Two micro-batches, the first with ``set_requires_all_reduce(False)``, equal one
    reference step on the global batch; each micro-batch loss is scaled by 1/2."""
    ref = _build("mlp")
    model = _shard(copy.deepcopy(ref), mesh)
    opt, ref_opt = make_optimizer(model.parameters()), make_optimizer(ref.parameters())
    local = _local(mesh)
    records = []
    for step in range(2):
        x, y = _batch("mlp", step, WORLD_SIZE * PER_RANK_BATCH * 2)
        for i, (xi, yi) in enumerate(zip(local(x).chunk(2), local(y).chunk(2), strict=True)):
            model.set_requires_all_reduce(i == 1)
            (F.cross_entropy(model(xi), yi) / 2).backward()
        F.cross_entropy(ref(x), y).backward()
        rec = {"grads": _full_grads(model, ref)}
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        rec["params"] = {
            n: (p.full_tensor(), r.detach().clone())
            for (n, p), r in zip(model.named_parameters(), ref.parameters(), strict=True)
        }
        records.append(rec)
    return records


def _full_grads(model: nn.Module, ref: nn.Module) -> dict:
    return {
        n: (p.grad.full_tensor(), r.grad.clone())
        for (n, p), r in zip(model.named_parameters(), ref.parameters(), strict=True)
    }


def _torch_parity(
    mesh: DeviceMesh, family: str, checks: bool = False, separate: bool = False
) -> list[dict]:
    """Steps of ours and torch's; with ``separate``, both reduce-scatter on a process
    group of their own, and each step records its collectives per process group role."""
    base = _build(family)
    ours = _shard(copy.deepcopy(base), mesh)
    if checks:  # they check every collective, the replicate all-reduce included
        ours.set_divergence_check(True)
        ours.set_nonfinite_grad_check(True)
    theirs = _shard(copy.deepcopy(base), mesh, shard=torch_fully_shard)
    roles = {mesh.get_group("shard").group_name: "shard"}
    roles[mesh.get_group("replicate").group_name] = "replicate"
    if separate:
        for model in (ours, theirs):
            model.set_separate_reduce_scatter_group()
        roles[ours._get_fsdp_state().groups[0].reduction.reduce_scatter_group.group_name] = "separate"
        info = theirs._get_fsdp_state()._fsdp_param_groups[0].mesh_info
        roles[info.reduce_scatter_process_group.group_name] = "separate"
    opts = make_optimizer(ours.parameters()), make_optimizer(theirs.parameters())
    local, loss_fn = _local(mesh), _loss(family)
    records = []
    for step in range(2):
        x, y = _batch(family, step, WORLD_SIZE * PER_RANK_BATCH)
        recorders = C10dRecorder(), C10dRecorder()
        losses = []
        for model, recorder in zip((ours, theirs), recorders, strict=True):
            with recorder:
                losses.append(loss_fn(model(local(x)), local(y)))
                losses[-1].backward()
        rec = {
            "collectives": [
                {roles.get(name, name): kinds for name, kinds in r.by_group().items()}
                for r in recorders
            ],
            "loss": tuple(loss.item() for loss in losses),
            "grads": local_pairs(ours, theirs, grads=True),
            "grad_placements": {
                name: (tuple(p.grad.placements), tuple(q.grad.placements))
                for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True)
            },
        }
        for opt in opts:
            opt.step()
            opt.zero_grad()
        rec["params"] = local_pairs(ours, theirs, grads=False)
        rec["placements"] = (placements(ours), placements(theirs))
        records.append(rec)
    return records


def _render(trace: CommTrace) -> str:
    return "\n".join(
        f"{e.kind:<14} {e.fqn or 'root':<8} over {e.group_size}  {e.nbytes:>5} B  {e.phase}"
        for e in sorted(trace.events, key=lambda e: e.start_s)
    )


def _traces(mesh: DeviceMesh) -> dict[str, str]:
    """One step after a warm-up (lazy init outside the trace); then a micro-batch with
    all-reduce off followed by one with it on."""
    model = _shard(_build("mlp"), mesh)
    x, y = _batch("mlp", 0, PER_RANK_BATCH)

    def step() -> None:
        F.cross_entropy(model(x), y).backward()

    step()
    model.zero_grad()
    out = {}
    for name, requires_all_reduce in (("step", [True]), ("accumulate", [False, True])):
        trace = CommTrace()
        model.set_comm_trace(trace)
        for flag in requires_all_reduce:
            model.set_requires_all_reduce(flag)
            step()
        model.zero_grad()
        out[name] = _render(trace)
    return out


def _all_reduce_overlap(mesh: DeviceMesh) -> list[tuple]:
    """One traced step with one reduction in flight at a time, after a warm-up: per
    all-reduce, (fqn, issued, waited, the reduce-scatters issued in between)."""
    model = _shard(_build("mlp"), mesh)
    model.set_reduce_scatter_max_input_buffers(1)
    x, y = _batch("mlp", 0, PER_RANK_BATCH)
    F.cross_entropy(model(x), y).backward()
    trace = CommTrace()
    model.set_comm_trace(trace)
    F.cross_entropy(model(x), y).backward()
    scatters = [e for e in trace.events if e.kind == "reduce_scatter"]
    return [
        (e.fqn, e.start_s, e.wait_s, [r.fqn for r in scatters if e.start_s < r.start_s < e.wait_s])
        for e in sorted(trace.events, key=lambda e: e.start_s)
        if e.kind == "all_reduce"
    ]


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (REPLICATE, SHARD), mesh_dim_names=("replicate", "shard"))
    return run_scenarios(
        {
            "init": lambda: _init(mesh),
            "train_mlp": lambda: _train(mesh, "mlp"),
            "train_llama": lambda: _train(mesh, "llama"),
            "accumulate": lambda: _accumulate(mesh),
            "torch_mlp": lambda: _torch_parity(mesh, "mlp"),
            "torch_llama": lambda: _torch_parity(mesh, "llama"),
            "torch_mlp_checked": lambda: _torch_parity(mesh, "mlp", checks=True),
            "torch_mlp_separate": lambda: _torch_parity(mesh, "mlp", separate=True),
            "traces": lambda: _traces(mesh),
            "all_reduce_overlap": lambda: _all_reduce_overlap(mesh),
        }
    )


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=180, pool=gloo_pool)


def test_params_are_replicate_shard0_dtensors(run):
    for rank, rec in enumerate(scenario_records(run, "init")):
        assert rec["placements"] == rec["expected"], f"rank {rank}"


@pytest.mark.parametrize("family", ["mlp", "llama"])
def test_training_matches_single_process(run, family):
    assert_train_parity(scenario_records(run, f"train_{family}"), STEPS)


def test_accumulation_without_all_reduce_equals_one_full_batch_step(run):
    for rank, records in enumerate(scenario_records(run, "accumulate")):
        for step, rec in enumerate(records):
            assert_pairs_close(rec["grads"], f"rank {rank} step {step} accumulated grad")
            assert_params_close(rec["params"], f"rank {rank} step {step} param", steps=step + 1)


@pytest.mark.parametrize("family", ["mlp", "llama", "mlp_checked", "mlp_separate"])
def test_matches_torch_fully_shard_on_the_same_mesh(run, family):
    for rank, records in enumerate(scenario_records(run, f"torch_{family}")):
        for step, rec in enumerate(records):
            where = f"rank {rank} step {step}"
            ours, theirs = rec["loss"]
            # Bitwise: [Note: parity tolerances] in _parity.py, item 1.
            assert ours == theirs, where
            for name, (a, b) in rec["grad_placements"].items():
                assert a == b == HSDP, f"{where} grad {name}: {a} vs torch {b}"
            assert_pairs_equal(rec["grads"], f"{where} local grad vs torch")
            assert_pairs_equal(rec["params"], f"{where} local shard vs torch")
            ours_layout, their_layout = rec["placements"]
            assert ours_layout == their_layout, where


def test_separate_reduce_scatter_group_carries_every_reduction_as_torchs_does(run):
    # 4 groups: 4 all-gathers in forward and 3 in backward (the root keeps its params)
    # on the shard axis, each group's reduction on the new group, then its all-reduce
    # on the replicate axis; torch reduce-scatters, ours (gloo) all-to-alls.
    for rank, records in enumerate(scenario_records(run, "torch_mlp_separate")):
        for step, rec in enumerate(records):
            ours, theirs = rec["collectives"]
            expected = {"shard": ["all_gather"] * 7, "replicate": ["all_reduce"] * 4}
            assert theirs == expected | {"separate": ["reduce_scatter"] * 4}, theirs
            assert ours == expected | {"separate": ["all_to_all"] * 4}, f"rank {rank} {step}"


def test_collectives_per_step_by_mesh_axis(run):
    # Per group: an all-gather of W_shard x the padded shard (forward; again in backward
    # for the blocks, the root keeps its params), a reduce-scatter of the same size over
    # the shard axis, then an all-reduce of the padded shard over the replicate axis.
    # Shards (fp32): blocks.0 10x16 + 10 = 170 (680 B), blocks.1 7x20 + 7 = 147
    # (588 B), blocks.2 2x13 + 2 = 28 (112 B), root head 4x3 + 4 = 16 (64 B).
    traces = scenario_records(run, "traces")
    assert all(t == traces[0] for t in traces), "ranks disagree on the schedule"
    assert_expected_inline(
        traces[0]["step"],
        """\
all_gather     root     over 2    128 B  forward
all_gather     blocks.0 over 2   1360 B  forward
all_gather     blocks.1 over 2   1176 B  forward
all_gather     blocks.2 over 2    224 B  forward
all_gather     blocks.2 over 2    224 B  backward
all_gather     blocks.1 over 2   1176 B  backward
reduce_scatter blocks.2 over 2    224 B  backward
all_gather     blocks.0 over 2   1360 B  backward
all_reduce     blocks.2 over 2    112 B  backward
reduce_scatter blocks.1 over 2   1176 B  backward
all_reduce     blocks.1 over 2    588 B  backward
reduce_scatter root     over 2    128 B  backward
all_reduce     root     over 2     64 B  backward
reduce_scatter blocks.0 over 2   1360 B  backward
all_reduce     blocks.0 over 2    680 B  backward""",
    )


def test_no_all_reduce_micro_batch_only_reduce_scatters(run):
    traces = scenario_records(run, "traces")[0]
    assert_expected_inline(
        traces["accumulate"],
        """\
all_gather     root     over 2    128 B  forward
all_gather     blocks.0 over 2   1360 B  forward
all_gather     blocks.1 over 2   1176 B  forward
all_gather     blocks.2 over 2    224 B  forward
all_gather     blocks.2 over 2    224 B  backward
all_gather     blocks.1 over 2   1176 B  backward
reduce_scatter blocks.2 over 2    224 B  backward
all_gather     blocks.0 over 2   1360 B  backward
reduce_scatter blocks.1 over 2   1176 B  backward
reduce_scatter root     over 2    128 B  backward
reduce_scatter blocks.0 over 2   1360 B  backward
all_gather     root     over 2    128 B  forward
all_gather     blocks.0 over 2   1360 B  forward
all_gather     blocks.1 over 2   1176 B  forward
all_gather     blocks.2 over 2    224 B  forward
all_gather     blocks.2 over 2    224 B  backward
all_gather     blocks.1 over 2   1176 B  backward
reduce_scatter blocks.2 over 2    224 B  backward
all_gather     blocks.0 over 2   1360 B  backward
all_reduce     blocks.2 over 2    112 B  backward
reduce_scatter blocks.1 over 2   1176 B  backward
all_reduce     blocks.1 over 2    588 B  backward
reduce_scatter root     over 2    128 B  backward
all_reduce     root     over 2     64 B  backward
reduce_scatter blocks.0 over 2   1360 B  backward
all_reduce     blocks.0 over 2    680 B  backward""",
    )


def test_all_reduce_is_in_flight_while_the_next_group_computes(run):
    # With one reduction in flight at a time (set_reduce_scatter_max_input_buffers(1)):
    # every group's all-reduce is asynchronous, in flight while a later group's
    # reduce-scatter is issued (a synchronous one has none in between), except the
    # last, waited at the end of backward; and never more than one all-reduce in flight
    # when a reduce-scatter is issued.
    for rank, events in enumerate(scenario_records(run, "all_reduce_overlap")):
        assert sorted(fqn for fqn, *_ in events) == sorted(["blocks.2", "blocks.1", "", "blocks.0"])
        *overlapping, last = events
        assert all(between for *_, between in overlapping), (rank, events)
        assert last[-1] == [], (rank, events)
        scatters = {fqn for *_, between in events for fqn in between}
        for fqn in scatters:
            in_flight = sum(fqn in between for *_, between in events)
            assert in_flight <= 1, (rank, fqn, events)

