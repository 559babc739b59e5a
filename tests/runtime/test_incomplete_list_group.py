"""A list group whose forward runs only some of its modules, on torch's ``fully_shard``
and ours, 2 gloo ranks: torchtitan's ``fully_shard([model.norm, model.output])`` with a
forward that stops at the hidden states.

- ``eval``: a ``no_grad`` forward that runs ``norm`` but not ``output``, a per-tensor
  ``torch.optim`` step, then a training forward. The root's post-forward completes the
  group (torch's ``_force_complete_incomplete_states``): it is resharded, so the next
  forward all-gathers the stepped values. Left unsharded, the group would compute with
  the values from before the step. With ``reshard_after_forward=False`` the group stays
  unsharded and ours all-gathers it again at its next forward, because its shards
  changed (torch's computes with the old values: README, differences): the output
  equals ours with ``reshard_after_forward=True``.
- ``chunked``: a forward to the hidden states, then the output head called on its own
  per chunk of a chunked loss, then backward: the collectives of each phase.

Compared with torch: registered parameter types after the evaluation, the training
forward's output and the c10d collectives (kind, bytes, in order; ours' gloo
reduce-scatter is an all-to-all) bitwise, and the local grads bitwise.
"""

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard as ours_fully_shard
from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

DIM = 64
IMPLS = {"ours": ours_fully_shard, "torch": torch_fully_shard}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.ReLU()) for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.output = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor, with_output: bool = True) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.output(x) if with_output else x


def _build(shard: Any, reshard_after_forward: bool = True) -> Net:
    torch.manual_seed(0)
    model = Net()
    mesh = init_device_mesh("cpu", (2,))
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard([model.norm, model.output], mesh=mesh, reshard_after_forward=reshard_after_forward)
    shard(model, mesh=mesh)
    torch.manual_seed(1 + torch.distributed.get_rank())
    return model


def _collectives(recorder: C10dRecorder) -> list[tuple[str, int]]:
    return [
        ("reduce_scatter" if kind == "all_to_all" else kind, nbytes)
        for kind, nbytes in recorder.records
    ]


def _eval_then_step(shard: Any, reshard_after_forward: bool) -> dict[str, Any]:
    model = _build(shard, reshard_after_forward)
    # The sharded params, as the optimizer holds them (after an evaluation the root's and
    # an unsharded group's registered params are the unsharded ones).
    sharded = dict(model.named_parameters())
    # Per-tensor steps write the shards in place, through their version counters.
    optim = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    model(torch.randn(4, DIM)).sum().backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        model(torch.randn(4, DIM), with_output=False)
    registered = {name: type(p).__name__ for name, p in model.named_parameters()}
    # A step of the list group's shards only: the root, kept unsharded after the
    # evaluation, is all-gathered again by ours and not by torch's (README, differences).
    for name, p in sharded.items():
        p.grad = torch.ones_like(p) if name.startswith(("norm.", "output.")) else None
    optim.step()
    optim.zero_grad()
    with C10dRecorder() as recorder:
        out = model(torch.randn(4, DIM))
    return {
        "registered": registered,
        "output": out.detach().clone(),
        "collectives": _collectives(recorder),
    }


def _chunked(shard: Any) -> dict[str, Any]:
    model = _build(shard)
    steps = []
    for _ in range(2):
        with C10dRecorder() as forward:
            hidden = model(torch.randn(4, DIM), with_output=False)
        with C10dRecorder() as chunks:
            loss = sum(model.output(chunk).square().mean() for chunk in hidden.chunk(2))
        with C10dRecorder() as backward:
            loss.backward()
        steps.append(
            {
                "collectives": [_collectives(r) for r in (forward, chunks, backward)],
                "loss": loss.item(),
                "grads": {n: p.grad.to_local().clone() for n, p in model.named_parameters()},
                "sharded": all(isinstance(p, DTensor) for p in model.parameters()),
            }
        )
        model.zero_grad()
    return {"steps": steps}


def _run(rank: int, world_size: int) -> dict[str, tuple[str, Any]]:
    scenarios = {}
    for impl, shard in IMPLS.items():
        for raf in (True, False):
            scenarios[f"eval-raf={raf}-{impl}"] = lambda s=shard, r=raf: _eval_then_step(s, r)
        scenarios[f"chunked-{impl}"] = lambda s=shard: _chunked(s)
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict[str, tuple[str, Any]]]:
    return run_distributed(_run, 2, pool=gloo_pool)


@pytest.mark.parametrize("raf", [True, False], ids=lambda raf: f"raf={raf}")
def test_eval_forward_without_output_then_step(
    run: list[dict[str, tuple[str, Any]]], raf: bool
) -> None:
    ours = scenario_records(run, f"eval-raf={raf}-ours")
    # The stepped values' reference: torch's, which reshards the group (raf=True) and
    # so all-gathers the stepped shards.
    theirs = scenario_records(run, "eval-raf=True-torch")
    for rank, (mine, torchs) in enumerate(zip(ours, theirs)):
        where = f"rank {rank}, reshard_after_forward={raf}"
        if raf:
            # Resharded at the end of the root's forward: sharded params registered.
            assert mine["registered"] == torchs["registered"], where
            assert mine["registered"]["norm.weight"] == "DTensor", where
            assert mine["collectives"] == torchs["collectives"], where
        # The forward after the step computes with the stepped values.
        assert torch.equal(mine["output"], torchs["output"]), (
            f"{where}: max |diff| {(mine['output'] - torchs['output']).abs().max().item()}"
        )


def test_chunked_loss_calls_head_on_its_own(run: list[dict[str, tuple[str, Any]]]) -> None:
    ours, theirs = scenario_records(run, "chunked-ours"), scenario_records(run, "chunked-torch")
    for rank, (mine, torchs) in enumerate(zip(ours, theirs)):
        for step, (a, b) in enumerate(zip(mine["steps"], torchs["steps"], strict=True)):
            where = f"rank {rank}, step {step}"
            phases = ("forward", "chunks", "backward")
            for phase, got, want in zip(phases, a["collectives"], b["collectives"], strict=True):
                assert got == want, f"{where}, {phase}: (ours, torch)\n{got}\n{want}"
            assert a["sharded"] and b["sharded"], where
            assert a["loss"] == b["loss"], where
            for name, grad in a["grads"].items():
                assert torch.equal(grad, b["grads"][name]), f"{where}: grad {name}"
