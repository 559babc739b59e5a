"""Lightning Fabric's FSDP2 strategy (``ModelParallelStrategy``) driving our modules
after ``use_dtensor_fsdp()``: gradient accumulation with ``fabric.no_backward_sync``.

Fabric finds the FSDP modules to silence with ``isinstance(m, FSDPModule)`` of torch's
class (lightning/fabric/strategies/model_parallel.py, ``_FSDPNoSync``). The same script
runs with torch's ``fully_shard`` and with ours switched in: the ``parallelize_fn``
calls ``torch.distributed.fsdp.fully_shard``, which the switch replaces. Without the
switch our modules fail the check, and every micro-batch reduces (the control below).
"""

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from tests._c10d import C10dRecorder, count_of
from tests._harness import run_distributed
from tests._mlp import mlp
from tests.integrations._lightning import (
    launch_fabric,
    parallelize_with_ours,
    parallelize_with_torch_names,
)

pytest.importorskip("lightning", reason="Lightning Fabric is not installed (pip install lightning)")

STEPS, MICRO_BATCHES = 3, 2


def _train(parallelize_fn: Callable[[nn.Module, Any], nn.Module]) -> dict[str, Any]:

    fabric = launch_fabric(parallelize_fn)
    model = fabric.setup_module(mlp())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(1 + fabric.global_rank)
    batches = [torch.randn(4, 8) for _ in range(STEPS * MICRO_BATCHES)]
    losses, recorder = [], C10dRecorder()
    with recorder:
        for step in range(STEPS):
            for micro in range(MICRO_BATCHES):
                is_last = micro == MICRO_BATCHES - 1
                with fabric.no_backward_sync(model, enabled=not is_last):
                    loss = model(batches[step * MICRO_BATCHES + micro]).sum() / MICRO_BATCHES
                    fabric.backward(loss)
                losses.append(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
    import dtensor_fsdp

    return {
        "ours": isinstance(model.module, dtensor_fsdp.FSDPModule),  # inside Fabric's wrapper
        "reductions": count_of(recorder.records, "reduce_scatter")
        + count_of(recorder.records, "all_to_all"),
        "losses": losses,
        "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
    }


def _run(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    # Fabric's LightningEnvironment: processes were created outside it (the harness
    # has already joined the gloo group, which Fabric then keeps).
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world_size))
    from dtensor_fsdp.integrations import use_dtensor_fsdp

    results = {"torch": _train(parallelize_with_torch_names), "ours_unswitched": _train(parallelize_with_ours)}
    with use_dtensor_fsdp():
        results["ours"] = _train(parallelize_with_torch_names)
    return results


def test_no_backward_sync_reduces_on_the_last_micro_batch_only():
    for rank in run_distributed(_run, 2, timeout=300):
        torch_run, ours = rank["torch"], rank["ours"]
        assert not torch_run["ours"] and ours["ours"]
        # 3 groups (two blocks and the root) reduce once per step, as torch's.
        assert torch_run["reductions"] == 3 * STEPS
        assert ours["reductions"] == torch_run["reductions"]
        # The control: without the switch Fabric does not see our modules, and every
        # micro-batch reduces.
        assert rank["ours_unswitched"]["ours"]
        assert rank["ours_unswitched"]["reductions"] == 3 * STEPS * MICRO_BATCHES
        # Two ranks: one sum per element, the same bits whichever order (a+b == b+a).
        for mine, theirs in zip(ours["losses"], torch_run["losses"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        assert ours["params"].keys() == torch_run["params"].keys()
        for name, param in ours["params"].items():
            torch.testing.assert_close(param, torch_run["params"][name], rtol=0, atol=0, msg=name)
