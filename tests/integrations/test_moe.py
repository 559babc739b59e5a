"""A torchtitan-style MoE under torchtitan's exact ``fully_shard`` calls, on 4 gloo ranks:
ours against torch's ``fully_shard`` and against a single process (issue 21, part 5).

The model (``_moe.py``): a decoder of one dense block and two MoE blocks (router, grouped
expert weights, a shared expert, token dispatch by all-to-all under EP). The calls
(``_titan_fsdp.py``): torchtitan's ``apply_fsdp_to_decoder`` on torchtitan's meshes
(dense ``fsdp`` axis of 4; with EP 2 the sparse ``efsdp`` x ``ep`` axes, 2 x 2). The
cases are torchtitan's four branches for MoE blocks, plus one in bf16 and one variant:

- ``ep1_shard0``: 4 experts on 4 ranks: a plain ``fully_shard(block)``.
- ``ep1_shard1``: 2 experts, fewer than the ranks: a ``shard_placement_fn`` returning
  ``Shard(1)`` for the expert weights (no padding of the expert dim).
- ``ep2_shard0``: EP 2, 4 experts: expert weights are ``Shard(0)`` DTensors over ``ep``;
  the block's ``shard_placement_fn`` returns torch's ``ShardPlacementResult`` on the
  ``efsdp`` mesh for them (``Shard(0)``) and on the dense mesh for the rest, so one
  ``fully_shard`` call makes two parameter groups. Explicit prefetch as torchtitan
  sets it for EP.
- ``ep2_shard1``: EP 2, 2 experts (one per EP rank): ``Shard(1)`` on ``efsdp``.
- ``ep2_shard0_bf16``: ``ep2_shard0`` with ``MixedPrecisionPolicy(bf16, fp32)``.
- ``ep2_shard0_experts_own_call``: ``ep2_shard0`` with the experts sharded by a
  ``fully_shard(experts, mesh=efsdp)`` of their own first (the change to torchtitan's
  code that a library without several meshes per call needs); torchtitan's calls then
  find no expert parameter in the block.

Each case trains ``STEPS`` AdamW steps with torch's ``fully_shard``, ours, and (fp32
cases) a single process on the global batch, from the same initial values and batches.
FSDP sums gradients (torchtitan's ``disable_fsdp_gradient_division``) and each rank's
loss is its share of the global mean, so gradients equal the single process's.

Compared (what a user sees): per-step global losses and the final ``full_tensor()``
parameters; each parameter's placements, device mesh and local shape; the parameter
groups each block gets; and every collective of a step at the c10d level, in order, as
(process group: dense ``fsdp``, ``efsdp`` or ``ep``; kind; bytes). Tolerances: see
``_assert_close_to_torch``. One spawn runs every case (each implementation in its own
scenario, so that a failure of one does not hide the other's results).
"""

from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

import dtensor_fsdp
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import (
    ATOL,
    RTOL,
    adamw_param_atol,
    assert_pairs_close,
    assert_pairs_equal,
    make_optimizer,
)
from tests._pool import GlooPools
from tests.integrations._moe import Decoder, MoEConfig, apply_expert_parallel, build, loss_sum
from tests.integrations._titan_fsdp import Impl, apply_fsdp_to_decoder, titan_meshes

pytestmark = pytest.mark.skipif(
    not hasattr(DeviceMesh, "_unflatten"), reason="torchtitan's meshes need DeviceMesh._unflatten"
)

WORLD_SIZE = 4
STEPS = 3
BATCH = 2  # sequences per rank
SEQ = 8
SEED = 0

IMPLS = {
    "torch": Impl("torch", torch_fully_shard, TorchFSDPModule, TorchMixedPrecisionPolicy),
    "ours": Impl(
        "ours", dtensor_fsdp.fully_shard, dtensor_fsdp.FSDPModule, dtensor_fsdp.MixedPrecisionPolicy
    ),
}


@dataclass(frozen=True)
class Case:
    ep: int  # expert-parallel degree
    experts: int
    param_dtype: torch.dtype = torch.float32
    # The experts get a fully_shard call of their own on the efsdp mesh before
    # torchtitan's calls (which then see no expert parameter in the block).
    experts_own_call: bool = False


CASES = {
    "ep1_shard0": Case(ep=1, experts=4),
    "ep1_shard1": Case(ep=1, experts=2),
    "ep2_shard0": Case(ep=2, experts=4),
    "ep2_shard1": Case(ep=2, experts=2),
    "ep2_shard0_bf16": Case(ep=2, experts=4, param_dtype=torch.bfloat16),
    "ep2_shard0_experts_own_call": Case(ep=2, experts=4, experts_own_call=True),
}
FP32_CASES = [name for name, c in CASES.items() if c.param_dtype == torch.float32]


def _config(case: str) -> MoEConfig:
    return MoEConfig(num_experts=CASES[case].experts)


def _batch() -> torch.Tensor:
    """The global batch: (WORLD_SIZE * BATCH, SEQ + 1) tokens, the same every step
    (random tokens have nothing to learn across batches; a falling loss shows training)."""
    gen = torch.Generator().manual_seed(100)
    return torch.randint(0, MoEConfig.vocab_size, (WORLD_SIZE * BATCH, SEQ + 1), generator=gen)


GLOBAL_TOKENS = WORLD_SIZE * BATCH * SEQ


# ---------------------------------------------------------------------------
# Child side
# ---------------------------------------------------------------------------


def _shard(case: str, impl: Impl) -> tuple[Decoder, dict[str, str]]:
    """The case's model under torchtitan's EP and FSDP calls; and the role of each
    process group name ("fsdp", "efsdp", "ep")."""
    c = CASES[case]
    meshes = titan_meshes(WORLD_SIZE, c.ep)
    model = build(_config(case), SEED)
    roles = {meshes.dp.get_group().group_name: "fsdp"}
    if c.ep > 1:
        apply_expert_parallel(model, meshes.ep)
        roles[meshes.efsdp.get_group().group_name] = "efsdp"
        roles[meshes.ep.get_group().group_name] = "ep"
    if c.experts_own_call:
        mp_policy = impl.mp_policy(param_dtype=c.param_dtype, reduce_dtype=torch.float32)
        for block in model.layers.values():
            if block.moe_enabled:
                experts = block.moe.routed_experts.inner_experts
                impl.fully_shard(experts, mesh=meshes.efsdp, mp_policy=mp_policy)
    apply_fsdp_to_decoder(
        model, meshes.dp, impl, c.param_dtype, torch.float32, ep_degree=c.ep, edp_mesh=meshes.efsdp
    )
    return model, roles


def _param_groups(model: Decoder, impl: Impl) -> dict[str, list[list[int]]]:
    """Per block: its parameter groups, each as the ranks of its shard process group."""
    out = {}
    for name, block in model.layers.items():
        if impl.name == "torch":
            groups = torch_fully_shard.state(block)._fsdp_param_groups
            out[name] = [
                dist.get_process_group_ranks(g.mesh_info.shard_process_group) for g in groups
            ]
        else:
            groups = block._get_fsdp_state().groups
            out[name] = [dist.get_process_group_ranks(g.mesh_info.shard_group) for g in groups]
    return out


def _layout(model: nn.Module) -> dict[str, tuple]:
    """Per FQN: placements, mesh axis names, mesh ranks, local shape, dtype."""
    out = {}
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        mesh = p.device_mesh
        out[name] = (
            tuple(p.placements),
            mesh.mesh_dim_names,
            mesh.mesh.tolist(),
            tuple(p.to_local().shape),
            p.dtype,
        )
    return out


def _collectives(recorder: C10dRecorder, roles: dict[str, str]) -> list[tuple]:
    return [
        (roles.get(group, group), kind, size)
        for (kind, size), group in zip(recorder.records, recorder.groups, strict=True)
    ]


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def _train_sharded(case: str, impl: Impl) -> dict[str, Any]:
    model, roles = _shard(case, impl)
    rec: dict[str, Any] = {"layout": _layout(model), "groups": _param_groups(model, impl)}
    optim = make_optimizer(model.parameters())
    rank = dist.get_rank()
    rec["losses"], rec["collectives"] = [], []
    for step in range(STEPS):
        tokens = _batch().chunk(WORLD_SIZE)[rank]  # this rank's (BATCH, SEQ + 1)
        with C10dRecorder() as recorder:
            loss = loss_sum(model, tokens, GLOBAL_TOKENS)
            loss.backward()
        rec["collectives"].append(_collectives(recorder, roles))
        if step == 0:
            rec["grads"] = {n: _local(p.grad) for n, p in model.named_parameters()}
        optim.step()
        optim.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the global mean loss
        rec["losses"].append(total.item())
    rec["shards"] = {n: _local(p) for n, p in model.named_parameters()}
    rec["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return rec


def _train_single_process(case: str) -> dict[str, Any]:
    model = build(_config(case), SEED)
    optim = make_optimizer(model.parameters())
    losses = []
    for _ in range(STEPS):
        loss = loss_sum(model, _batch(), GLOBAL_TOKENS)
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _worker(rank: int, world_size: int) -> dict:
    scenarios = {}
    for case in CASES:
        for name, impl in IMPLS.items():
            scenarios[f"{name}/{case}"] = lambda c=case, i=impl: _train_sharded(c, i)
    for case in FP32_CASES:
        scenarios[f"single/{case}"] = lambda c=case: _train_single_process(c)
    return run_scenarios(scenarios)


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=300, pool=gloo_pool)


def _assert_matches_single_process(sharded: dict, single: dict, where: str) -> None:
    # [Note: parity tolerances] in _parity.py: items 2 (losses) and 3 (AdamW params).
    for step, (loss, ref) in enumerate(zip(sharded["losses"], single["losses"], strict=True)):
        assert loss == pytest.approx(ref, rel=RTOL, abs=ATOL), f"{where} step {step} loss"
    pairs = {n: (p, single["params"][n]) for n, p in sharded["params"].items()}
    assert_pairs_close(pairs, f"{where} param", atol=adamw_param_atol(STEPS), rtol=RTOL)


@pytest.mark.parametrize("case", FP32_CASES)
def test_torch_matches_single_process(run, case):
    # The premise: torchtitan's calls under torch's fully_shard train the model right.
    single = scenario_records(run, f"single/{case}")[0]
    for rank, rec in enumerate(scenario_records(run, f"torch/{case}")):
        _assert_matches_single_process(rec, single, f"torch {case} rank {rank}")
    assert single["losses"][-1] < single["losses"][0], single["losses"]


@pytest.mark.parametrize("case", FP32_CASES)
def test_ours_matches_single_process(run, case):
    single = scenario_records(run, f"single/{case}")[0]
    for rank, rec in enumerate(scenario_records(run, f"ours/{case}")):
        _assert_matches_single_process(rec, single, f"ours {case} rank {rank}")


@pytest.mark.parametrize("case", list(CASES))
def test_layout_and_groups_match_torch(run, case):
    theirs = scenario_records(run, f"torch/{case}")
    for rank, ours in enumerate(scenario_records(run, f"ours/{case}")):
        where = f"{case} rank {rank}"
        for name, layout in ours["layout"].items():
            assert layout == theirs[rank]["layout"][name], f"{where} {name}: ours {layout}"
        assert ours["groups"] == theirs[rank]["groups"], where


@pytest.mark.parametrize("case", list(CASES))
def test_collectives_match_torch(run, case):
    theirs = scenario_records(run, f"torch/{case}")
    for rank, ours in enumerate(scenario_records(run, f"ours/{case}")):
        for step, (a, b) in enumerate(
            zip(ours["collectives"], theirs[rank]["collectives"], strict=True)
        ):
            # On gloo, ours reduces by an all-to-all and a local sum where torch calls
            # reduce_scatter_tensor (collectives.py): same buffer, same bytes.
            b = [(g, "all_to_all" if k == "reduce_scatter" else k, n) for g, k, n in b]
            assert a == b, f"{case} rank {rank} step {step}:\nours  {a}\ntorch {b}"


@pytest.mark.parametrize("case", list(CASES))
def test_values_match_torch(run, case):
    theirs = scenario_records(run, f"torch/{case}")
    for rank, ours in enumerate(scenario_records(run, f"ours/{case}")):
        _assert_close_to_torch(ours, theirs[rank], f"{case} rank {rank}")


def _assert_close_to_torch(ours: dict, theirs: dict, where: str) -> None:
    """Step 0 runs the same arithmetic up to each gradient reduction: the loss is
    bitwise equal, and so is every gradient reduced over 2 ranks (the experts' on
    ``efsdp``: a + b == b + a). Over the 4 ranks of the dense mesh, torch's gloo
    reduce-scatter (an all-reduce) and ours (an all-to-all, then a local sum) add the
    same 4 terms in another order: last-ulp differences ([Note: parity tolerances] in
    _parity.py, item 1), which the later steps carry into the losses (item 2) and AdamW
    amplifies in the parameters (item 3)."""
    assert ours["losses"][0] == theirs["losses"][0], f"{where}: first loss"
    for name, grad in ours["grads"].items():
        pair = {name: (grad, theirs["grads"][name])}
        if "efsdp" in ours["layout"][name][1]:
            assert_pairs_equal(pair, f"{where} step 0 grad (2-rank reduction)")
        else:
            assert_pairs_close(pair, f"{where} step 0 grad (4-rank reduction)")
    for step, (loss, their_loss) in enumerate(zip(ours["losses"], theirs["losses"], strict=True)):
        assert loss == pytest.approx(their_loss, rel=RTOL, abs=ATOL), f"{where} step {step} loss"
    pairs = {n: (s, theirs["shards"][n]) for n, s in ours["shards"].items()}
    assert_pairs_close(pairs, f"{where} shard", atol=adamw_param_atol(STEPS), rtol=RTOL)
