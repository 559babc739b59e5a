"""Shared by the feature tests on 2 gloo ranks (tests/runtime/test_step_features.py,
test_param_kinds.py, comm/test_setters.py, tests/optim/test_torch_clip_and_grad_scaler.py):
the global batch, a lockstep trainer of a sharded model next to a single-process
reference on it, and the parity assertion.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dtensor_fsdp import (
    CommTrace,
    FSDPModule,
)
from tests._parity import assert_pairs_close, full, full_pairs, mean_over_world

WORLD_SIZE = 2


STEPS = 2


BATCH = 4  # rows per rank


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD_SIZE * BATCH, 8, generator=gen), torch.randn(WORLD_SIZE * BATCH, 3, generator=gen)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(WORLD_SIZE)[rank]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _lockstep(
    rank: int,
    model: nn.Module,
    ref: nn.Module,
    *,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    after_step: Callable[[], None] | None = None,
    steps: int = STEPS,
) -> list[dict[str, Any]]:
    """SGD steps of ours on this rank's rows and the reference on the global batch;
    per step the mean loss pair and full grads and params next to the reference's."""
    loss = loss or (lambda m, x, y: F.mse_loss(m(x), y))
    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for step in range(steps):
        x, y = _batch(step)
        ours = loss(model, _local(x, rank), _local(y, rank))
        ours.backward()
        theirs = F.mse_loss(ref(x), y)
        theirs.backward()
        rec = {"loss": (mean_over_world(ours), theirs.item()), "grads": full_pairs(model, ref, grads=True)}
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        if after_step is not None:
            after_step()
        rec["params"] = full_pairs(model, ref, grads=False)
        records.append(rec)
    return records


def _render(trace: CommTrace) -> str:
    return " ".join(
        f"{e.kind}({e.fqn or 'root'},{e.phase[0]})"
        for e in sorted(trace.events, key=lambda e: e.start_s)
    )


def _unsharded_bytes(model: nn.Module) -> int:
    return sum(
        p.unsharded_param.untyped_storage().nbytes()
        for m in model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state().groups
        for p in m._get_fsdp_state().fsdp_params()
    )


def _trainable_grads(model: nn.Module, ref: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    ref_params = dict(ref.named_parameters())
    return {
        n: (full(p.grad), ref_params[n].grad.clone())
        for n, p in model.named_parameters()
        if p.grad is not None
    }


def _assert_parity(records: list[dict[str, Any]], what: str, grad_scale: float = 1.0) -> None:
    for step, rec in enumerate(records):
        if "loss" in rec:
            ours, ref = rec["loss"]
            assert ours == pytest.approx(ref, rel=1e-5), f"{what} step {step} loss"
        scaled = {n: (a, grad_scale * b) for n, (a, b) in rec["grads"].items()}
        assert_pairs_close(scaled, f"{what} step {step} grad")
        if "params" in rec:
            assert_pairs_close(rec["params"], f"{what} step {step} param")
