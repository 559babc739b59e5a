"""MixedPrecisionPolicy on 2 gloo ranks: dtypes, bytes on the wire, and parity.

One spawn runs every scenario. The model is test_comm.py's 3-group MLP (block 0
Linear(8, 16), block 2 Linear(16, 16), the root's head Linear(16, 3)), so the fp32
byte counts are the ones explained there: all-gathers of 576 + 1088 + 272 = 1936 B per
forward. Under ``param_dtype=bf16`` each shard is cast before the all-gather, so the
all-gathers carry exactly half of that; the reduce-scatters carry ``reduce_dtype``.

References, as STYLE.md section 7 asks:

1. torch's own ``fully_shard`` with the same policy, compared tightly (bit for bit
   with an fp32 reduction: both sum the same bf16 gradients in fp32 and divide by 2).
2. A single-process fp32 model on the global batch, compared loosely (bf16 rounding).
"""

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import CommTrace, MixedPrecisionPolicy, fully_shard
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import adamw_param_atol, full, make_optimizer, mean_over_world
from tests._pool import GlooPools

WORLD_SIZE = 2
STEPS = 3
BATCH = 4  # rows per rank
BF16 = torch.bfloat16
FP32_AG_BYTES = {"": 272, "0": 576, "2": 1088}  # per group, see the module docstring


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD_SIZE * BATCH, 8, generator=gen), torch.randn(WORLD_SIZE * BATCH, 3, generator=gen)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(WORLD_SIZE)[rank]


def _train_three(rank: int, mesh: Any, policy: MixedPrecisionPolicy) -> dict[str, Any]:
    """Ours, torch's fully_shard (same policy) and an fp32 single-process reference in
    lockstep; per step: losses, and ours/torch's local grads and shards."""
    base = mlp()
    ref = copy.deepcopy(base)
    theirs = shard_mlp(
        copy.deepcopy(base),
        mesh,
        torch_fully_shard,
        mp_policy=TorchMixedPrecisionPolicy(
            param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype
        ),
    )
    ours = shard_mlp(base, mesh, mp_policy=policy)
    trace = CommTrace()
    ours.set_comm_trace(trace)
    models = (ours, theirs, ref)
    optims = [make_optimizer(m.parameters()) for m in models]
    steps = []
    for step in range(STEPS):
        x, y = _batch(step)
        losses = [_loss(m(_local(x, rank)), _local(y, rank)) for m in (ours, theirs)]
        losses.append(_loss(ref(x), y))
        for loss in losses:
            loss.backward()
        rec: dict[str, Any] = {
            "loss": [mean_over_world(losses[0]), mean_over_world(losses[1]), losses[2].item()],
            "grad_dtypes": {n: p.grad.dtype for n, p in ours.named_parameters()},
            "local_grads": {
                n: (p.grad.to_local().clone(), q.grad.to_local().clone())
                for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True)
            },
            "full_grads": {
                n: (full(p.grad), q.grad.clone())
                for (n, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True)
            },
        }
        for optim in optims:
            optim.step()
            optim.zero_grad()
        rec["local_params"] = {
            n: (p.to_local().detach().clone(), q.to_local().detach().clone())
            for (n, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True)
        }
        rec["full_params"] = {
            n: (full(p), q.detach().clone())
            for (n, p), q in zip(ours.named_parameters(), ref.parameters(), strict=True)
        }
        rec["param_dtypes"] = {n: p.dtype for n, p in ours.named_parameters()}
        steps.append(rec)
    first_step = trace.events[: len(trace.events) // STEPS]
    comms = [(e.kind, e.fqn, e.nbytes) for e in sorted(first_step, key=lambda e: e.start_s)]
    return {"steps": steps, "comms": comms}


class Probe(nn.Module):
    """A Linear that records the dtypes it sees and casts its input itself, so it runs
    with and without ``cast_forward_inputs``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 4)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        self.seen.append((x.dtype, w.dtype))
        return F.linear(x.to(w.dtype), w, self.linear.bias)


def _dtypes_seen(mesh: Any, policy: MixedPrecisionPolicy) -> dict[str, Any]:
    torch.manual_seed(0)
    probe = fully_shard(Probe(), mesh=mesh, mp_policy=policy)
    out = probe(torch.randn(2, 8))
    out.float().sum().backward()
    return {
        "input_and_param": probe.seen[0],
        "output": out.dtype,
        "sharded_param": probe.linear.weight.dtype,
        "sharded_grad": probe.linear.weight.grad.dtype,
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios({
        "fp32": lambda: _train_three(rank, mesh, MixedPrecisionPolicy()),
        "bf16_fp32_reduce": lambda: _train_three(
            rank, mesh, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32)
        ),
        "bf16_bf16_reduce": lambda: _train_three(rank, mesh, MixedPrecisionPolicy(param_dtype=BF16)),
        "cast_inputs": lambda: _dtypes_seen(mesh, MixedPrecisionPolicy(param_dtype=BF16)),
        "no_cast_inputs": lambda: _dtypes_seen(
            mesh, MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False)
        ),
        "output_fp32": lambda: _dtypes_seen(
            mesh, MixedPrecisionPolicy(param_dtype=BF16, output_dtype=torch.float32)
        ),
    })


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, pool=gloo_pool)


def _max_diff(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> float:
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs.values())


def _is_bf16_exact(t: torch.Tensor) -> bool:
    return torch.equal(t.to(BF16).float(), t.float())


def test_all_gather_carries_param_dtype_and_reduce_scatter_reduce_dtype(run):
    fp32, bf16_fp32, bf16_bf16 = (
        scenario_records(run, name)[0]["comms"]
        for name in ("fp32", "bf16_fp32_reduce", "bf16_bf16_reduce")
    )
    assert fp32 == [
        ("all_gather", "", 272), ("all_gather", "0", 576), ("all_gather", "2", 1088),
        ("all_gather", "2", 1088), ("all_gather", "0", 576),
        ("reduce_scatter", "2", 1088), ("reduce_scatter", "", 272), ("reduce_scatter", "0", 576),
    ]
    halve = lambda comms, kinds: [(k, f, n // 2 if k in kinds else n) for k, f, n in comms]
    # bf16 all-gathers are half the bytes; an fp32 reduction keeps fp32 reduce-scatters.
    assert bf16_fp32 == halve(fp32, {"all_gather"})
    assert sum(n for k, _, n in bf16_fp32 if k == "all_gather") == (1936 + 1088 + 576) // 2
    # reduce_dtype=None reduces in param_dtype: everything halves.
    assert bf16_bf16 == halve(fp32, {"all_gather", "reduce_scatter"})


@pytest.mark.parametrize("name", ["bf16_fp32_reduce", "bf16_bf16_reduce"])
def test_sharded_params_and_grads_stay_fp32(run, name):
    for rec in scenario_records(run, name)[0]["steps"]:
        assert set(rec["param_dtypes"].values()) == {torch.float32}
        assert set(rec["grad_dtypes"].values()) == {torch.float32}


def test_fp32_policy_matches_torch_bit_for_bit(run):
    for records in scenario_records(run, "fp32"):
        for rec in records["steps"]:
            for what in ("local_grads", "local_params"):
                for name, (ours, theirs) in rec[what].items():
                    assert torch.equal(ours, theirs), f"{what} {name}"


def test_bf16_with_fp32_reduce_matches_torch_bit_for_bit(run):
    for rank, records in enumerate(scenario_records(run, "bf16_fp32_reduce")):
        for step, rec in enumerate(records["steps"]):
            ours, theirs, _ = rec["loss"]
            assert ours == theirs, f"rank {rank} step {step}"
            for what in ("local_grads", "local_params"):
                for name, (a, b) in rec[what].items():
                    assert torch.equal(a, b), f"rank {rank} step {step} {what} {name}"


def test_fp32_reduce_keeps_more_than_bf16_precision(run):
    # The sum of two bf16 grads, in fp32, has bits that bf16 cannot hold: proof that the
    # reduction ran in fp32 (below, a bf16 reduction leaves only bf16 values).
    grads = scenario_records(run, "bf16_fp32_reduce")[0]["steps"][0]["local_grads"]
    assert not all(_is_bf16_exact(ours) for ours, _ in grads.values())


def test_bf16_reduce_rounds_to_bf16_and_stays_close_to_torch(run):
    for records in scenario_records(run, "bf16_bf16_reduce"):
        rec = records["steps"][0]
        # Reduced in bf16, then divided by 2 (exact): every grad value is a bf16 value.
        assert all(_is_bf16_exact(ours) for ours, _ in rec["local_grads"].values())
        # torch's reduction may order or divide differently: one bf16 ulp apart at most.
        for name, (ours, theirs) in rec["local_grads"].items():
            torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=8e-3, msg=name)


@pytest.mark.parametrize("name", ["bf16_fp32_reduce", "bf16_bf16_reduce"])
def test_bf16_loosely_matches_fp32_single_process(run, name):
    fp32_max_diff = _max_diff(scenario_records(run, "fp32")[0]["steps"][0]["full_grads"])
    for records in scenario_records(run, name):
        for step, rec in enumerate(records["steps"]):
            ours, _, ref = rec["loss"]
            assert ours == pytest.approx(ref, rel=5e-3), f"step {step}"
            assert ours != ref  # bf16 compute did happen
            # AdamW moves each value by about lr (1e-2) per step whatever the grad's
            # size, so a bf16-rounded tiny grad of the other sign costs up to 2 * lr
            # ([Note: parity tolerances] in _parity.py, item 3).
            assert _max_diff(rec["full_params"]) < adamw_param_atol(step + 1)
        # Same params, so the step-0 grads differ by bf16 rounding only (measured 5e-3
        # on grads of up to 0.2), and by far more than fp32 reduction order does.
        step0 = _max_diff(records["steps"][0]["full_grads"])
        assert 10 * fp32_max_diff < step0 < 1e-2


def test_fp32_matches_single_process(run):
    for records in scenario_records(run, "fp32"):
        for step, rec in enumerate(records["steps"]):
            ours, _, ref = rec["loss"]
            assert ours == pytest.approx(ref, rel=1e-6)
            assert _max_diff(rec["full_grads"]) < 1e-6
            # AdamW: [Note: parity tolerances] in _parity.py, item 3.
            assert _max_diff(rec["full_params"]) < adamw_param_atol(step + 1)


def test_forward_casts(run):
    cast, no_cast, output_fp32 = (
        scenario_records(run, name)[0] for name in ("cast_inputs", "no_cast_inputs", "output_fp32")
    )
    # The unsharded param is bf16; the input is cast to it unless asked not to.
    assert cast["input_and_param"] == (BF16, BF16)
    assert no_cast["input_and_param"] == (torch.float32, BF16)
    assert cast["output"] == BF16 and output_fp32["output"] == torch.float32
    for rec in (cast, no_cast, output_fp32):
        assert rec["sharded_param"] == rec["sharded_grad"] == torch.float32
