"""accelerate's FSDP2 preparation (``fsdp2_prepare_model``) sharding with ours after
``use_dtensor_fsdp()``: it imports ``fully_shard`` and torch's policies from
``torch.distributed.fsdp`` when called, and skips modules that already are
``isinstance(m, FSDPModule)``. accelerate turns FSDP on only for accelerator devices
(``AcceleratorState``: MULTI_GPU and the like, never MULTI_CPU), so the test calls
``fsdp2_prepare_model`` itself with the accelerator fields it reads; the same script
runs with torch's ``fully_shard`` (no switch) and ours.
"""

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.fsdp as torch_fsdp

from tests._c10d import C10dRecorder, count_of
from tests._harness import run_distributed
from tests._mlp import mlp

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")

STEPS = 3


def _prepare_and_train() -> dict[str, Any]:
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    import dtensor_fsdp

    # Linear(16, 16) and Linear(8, 16) have >= 100 parameters: each is wrapped, then
    # the root (Linear(16, 3) with 51 stays in it), as in tests/_mlp.py.
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="size_based_wrap",
        min_num_params=100,
        cpu_ram_efficient_loading=False,
    )
    accelerator = SimpleNamespace(
        state=SimpleNamespace(fsdp_plugin=plugin),
        device=torch.device("cpu"),
        mixed_precision="no",
        is_main_process=dist.get_rank() == 0,
    )
    model = fsdp2_prepare_model(accelerator, mlp())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1 + dist.get_rank())
    losses, recorder = [], C10dRecorder()
    with recorder:
        for _ in range(STEPS):
            loss = model(torch.randn(4, 8)).sum()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return {
        "ours": isinstance(model, dtensor_fsdp.FSDPModule),
        "sharded": [n for n, m in model.named_modules() if isinstance(m, torch_fsdp.FSDPModule)],
        "reductions": count_of(recorder.records, "reduce_scatter")
        + count_of(recorder.records, "all_to_all"),
        "losses": losses,
        "params": {n: p.to_local().clone() for n, p in model.named_parameters()},
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    from dtensor_fsdp.integrations import use_dtensor_fsdp

    results = {"torch": _prepare_and_train()}
    with use_dtensor_fsdp():
        results["ours"] = _prepare_and_train()
    return results


def test_fsdp2_prepare_model_shards_with_ours():
    for rank in run_distributed(_run, 2, timeout=300):
        torch_run, ours = rank["torch"], rank["ours"]
        assert not torch_run["ours"] and ours["ours"]
        assert ours["sharded"] == torch_run["sharded"] == ["", "0", "2"]
        assert ours["reductions"] == torch_run["reductions"] == 3 * STEPS
        # Two ranks: one sum per element, the same bits whichever order (a+b == b+a).
        for mine, theirs in zip(ours["losses"], torch_run["losses"], strict=True):
            torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
        for name, param in ours["params"].items():
            torch.testing.assert_close(param, torch_run["params"][name], rtol=0, atol=0, msg=name)
