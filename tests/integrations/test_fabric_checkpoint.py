"""Lightning Fabric's checkpoints with its FSDP2 strategy (``ModelParallelStrategy``):
``fabric.save(path, state)`` of the model and optimizer (a distributed checkpoint:
torch's ``get_model_state_dict``/``get_optimizer_state_dict``), then
``fabric.load(path, state)`` into a new Fabric, with torch's ``fully_shard`` and with
ours. The resumed run continues bitwise as the uninterrupted one, and the checkpoint
holds the same keys, shapes and chunks as torch's.

Fabric finds the model to checkpoint by its DTensor parameters
(``_has_dtensor_modules``), not by torch's ``FSDPModule`` class: a ``parallelize_fn``
that calls ``dtensor_fsdp.fully_shard`` works without the switch (a control below);
one written for torch (``torch.distributed.fsdp.fully_shard``) needs it.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from tests._harness import run_distributed
from tests._mlp import mlp
from tests.integrations._lightning import (
    checkpoint_structure,
    launch_fabric,
    lightning_environment,
    parallelize_with_ours,
    parallelize_with_torch_names,
)

pytest.importorskip("lightning", reason="Lightning Fabric is not installed (pip install lightning)")

STEPS, SAVED_AT = 4, 2  # the checkpoint is taken after step 2


def _setup(parallelize_fn: Callable[[nn.Module, Any], nn.Module]) -> tuple[Any, Any, Any]:

    lightning_environment(dist.get_rank(), dist.get_world_size())
    fabric = launch_fabric(parallelize_fn)
    model = fabric.setup_module(mlp())
    # Adam: the checkpoint holds optimizer state (exp_avg, exp_avg_sq, step).
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), lr=0.01))
    return fabric, model, optimizer


def _steps(model: Any, optimizer: Any, steps: range) -> list[torch.Tensor]:
    # Each rank's batch of each step, the same whichever run takes the step.
    losses = []
    for step in steps:
        generator = torch.Generator().manual_seed(100 * step + dist.get_rank())
        loss = model(torch.randn(4, 8, generator=generator)).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses


def _params(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.to_local().clone() for n, p in model.named_parameters()}


def _train(parallelize_fn: Callable[[nn.Module, Any], nn.Module], path: Path) -> dict[str, Any]:
    import dtensor_fsdp

    _, model, optimizer = _setup(parallelize_fn)
    losses = _steps(model, optimizer, range(STEPS))
    # The same run in two: SAVED_AT steps, fabric.save, then a new Fabric loading it.
    fabric, model_a, optimizer_a = _setup(parallelize_fn)
    split_losses = _steps(model_a, optimizer_a, range(SAVED_AT))
    fabric.save(path, {"model": model_a, "optimizer": optimizer_a, "step": SAVED_AT})
    fabric, model_b, optimizer_b = _setup(parallelize_fn)
    state = {"model": model_b, "optimizer": optimizer_b, "step": 0}
    fabric.load(path, state)
    split_losses += _steps(model_b, optimizer_b, range(state["step"], STEPS))
    return {
        "ours": isinstance(model.module, dtensor_fsdp.FSDPModule),  # inside Fabric's wrapper
        "torch_class": isinstance(model.module, torch_fsdp.FSDPModule),
        "losses": losses,
        "params": _params(model),
        "split_losses": split_losses,
        "resumed_params": _params(model_b),
        "checkpoint": checkpoint_structure(path),
    }


def _run(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from dtensor_fsdp.integrations import use_dtensor_fsdp

    results = {
        "torch": _train(parallelize_with_torch_names, Path(root, "torch")),
        "ours_unswitched": _train(parallelize_with_ours, Path(root, "ours_unswitched")),
    }
    with use_dtensor_fsdp():
        results["ours"] = _train(parallelize_with_torch_names, Path(root, "ours"))
    return results


def _assert_bitwise(mine: Any, theirs: Any, what: str) -> None:
    # Two ranks: one sum per element, the same bits whichever order (a+b == b+a).
    if isinstance(mine, dict):
        assert mine.keys() == theirs.keys(), what
        mine, theirs = list(mine.values()), [theirs[name] for name in mine]
    assert len(mine) == len(theirs), what
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{what} [{i}]")


def test_save_then_load_continues_as_torch(tmp_path: Path) -> None:
    for rank in run_distributed(_run, 2, str(tmp_path), timeout=300):
        torch_run, ours = rank["torch"], rank["ours"]
        assert not torch_run["ours"] and torch_run["torch_class"]
        assert ours["ours"] and ours["torch_class"]
        assert len(torch_run["losses"]) == STEPS
        for name in ("ours", "ours_unswitched"):
            run = rank[name]
            _assert_bitwise(run["losses"], torch_run["losses"], f"{name} losses")
            _assert_bitwise(run["params"], torch_run["params"], f"{name} params")
            # Loaded from the checkpoint, it continues as the uninterrupted run.
            _assert_bitwise(run["split_losses"], run["losses"], f"{name} resumed losses")
            _assert_bitwise(run["resumed_params"], run["params"], f"{name} resumed params")
            assert run["checkpoint"] == torch_run["checkpoint"], name
        # The control: ours called directly needs no switch, but is not torch's class.
        assert rank["ours_unswitched"]["ours"] and not rank["ours_unswitched"]["torch_class"]
