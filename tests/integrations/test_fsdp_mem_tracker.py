"""torch's FSDPMemTracker on our modules (use_dtensor_fsdp()), against torch's fully_shard.

One process, torch's fake process group at W=2: collectives move no data, but every
buffer is allocated as on a real group, and ours uses ``reduce_scatter_tensor`` there
as torch does (on gloo ours uses an all-to-all, whose receive buffer torch's tracker
does not categorize). Byte counts are exact: the two FSDPs allocate the same tensors
but for the differences asserted below.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.fsdp._fully_shard._fully_shard as torch_fully_shard_module
from torch import nn
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import dtensor_fsdp
from dtensor_fsdp.integrations import use_dtensor_fsdp
from tests._harness import end_watchdog, fake_mesh, run_distributed
from tests._pool import GlooPools

_FORWARD_STATES = (
    "Before Pre-Forward",
    "After Pre-Forward",
    "Before Post-Forward",
    "After Post-Forward",
)
_BACKWARD_STATES = (
    "Before Pre-Backward",
    "After Pre-Backward",
    "Before Post-Backward",
    "After Post-Backward",
    "Peak Backward",
)
# One block: Linear(64, 128) + Linear(128, 64), fp32, even over 2 ranks.
_BLOCK_UNSHARDED_BYTES = (64 * 128 + 128 + 128 * 64 + 64) * 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64)) for _ in range(3)]
    )


def _tracked_step(
    fully_shard: Callable[..., Any], mesh: DeviceMesh, after: list | None = None
) -> tuple[dict, dict]:
    """One Adam step under FSDPMemTracker: the peak snapshot, and each block's
    snapshots by state, as {category name: bytes}. ``after`` gets what a second step,
    after the tracker put the hooks back, sees: its loss and the hook counts."""
    model = _model()
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(8, 64)
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
    tracker = FSDPMemTracker(model, optim)
    tracker.track_inputs((x,))
    with tracker:
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
    peak = _by_name(tracker.get_tracker_snapshot("peak"))
    if after is not None:
        loss = model(x).sum()
        loss.backward()
        after.append(loss.item())
        after.append(
            hooks == [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()]
        )
    modules = {
        stats.mod_fqn: {
            state.value: [_by_name(s) for s in snaps] for state, snaps in stats.snapshots.items()
        }
        for stats in tracker.memory_tracking.values()
        if hasattr(stats, "snapshots")  # FSDP modules' stats; plain modules' have no states
    }
    end_watchdog(model)
    return peak, modules


def _by_name(snapshot: dict) -> dict[str, int]:
    (per_device,) = snapshot.values()  # CPU only
    return {getattr(k, "value", k): v for k, v in per_device.items()}


@pytest.fixture(scope="module")
def both() -> tuple[tuple[dict, dict], tuple[dict, dict]]:
    """(torch's, ours) results of ``_tracked_step`` on the fake group."""
    with fake_mesh(2) as mesh:
        theirs = _tracked_step(torch_fully_shard_module.fully_shard, mesh)
    with fake_mesh(2) as mesh, use_dtensor_fsdp():
        ours = _tracked_step(torch.distributed.fsdp.fully_shard, mesh)
    return theirs, ours


def test_peak_by_category_as_torchs(both):
    (theirs, _), (ours, _) = both
    # The peak is the optimizer step's (Adam's states appear): the same bytes.
    assert ours["Total"] == theirs["Total"] == 432944
    # Our reduce-scatter lands a group's sharded grads after the group's post-backward
    # (when the next group's reduce-scatter makes room, or at the end of backward); the
    # tracker tags sharded grads only right after each group's post-backward, so ours
    # stay in "Temp". The same tensors, another label.
    assert ours["Sharded Grad"] == 0
    assert ours["Temp"] == theirs["Temp"] + theirs["Sharded Grad"]
    same = set(theirs) - {"Total", "Sharded Grad", "Temp"}
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}


def test_forward_snapshots_per_module_as_torchs(both):
    (_, theirs), (_, ours) = both
    blocks = [f"FSDPSequential.{i}" for i in range(3)]
    assert set(blocks) <= set(ours)
    for fqn in blocks:
        for state in _FORWARD_STATES:
            for t, o in zip(theirs[fqn][state], ours[fqn][state], strict=True):
                # torch all-gathers into a separate output and copies it out to the
                # unsharded params, keeping the output until the next group's copy-out;
                # ours all-gathers into the unsharded params' buffer: no all-gather
                # output held apart, one block's unsharded bytes less.
                # (Before the first block's all-gather torch holds none either.)
                held = (
                    0 if (fqn, state) == (blocks[0], _FORWARD_STATES[0]) else _BLOCK_UNSHARDED_BYTES
                )
                assert t["All Gather"] == held, (fqn, state)
                assert o["All Gather"] == 0, (fqn, state)
                assert o["Total"] == t["Total"] - held, (fqn, state)
                rest = set(t) - {"All Gather", "Total"}
                assert {k: o[k] for k in rest} == {k: t[k] for k in rest}, (fqn, state)
        # The unsharded params are counted once unsharded, as torch's.
        assert ours[fqn]["After Pre-Forward"][0]["Unsharded Param"] == _BLOCK_UNSHARDED_BYTES


def test_backward_snapshots_per_module_as_torchs(both):
    (_, theirs), (_, ours) = both
    for fqn in [f"FSDPSequential.{i}" for i in range(3)]:
        for state in _BACKWARD_STATES:
            for t, o in zip(theirs[fqn][state], ours[fqn][state], strict=True):
                # Ours labels no sharded grad (see test_peak_by_category_as_torchs) and
                # no all-gather buffer: its backward prefetch all-gathers into the next
                # group's unsharded buffer from our hook, outside the group's
                # pre_backward the tracker wraps, so that buffer counts as "Temp" where
                # torch's prefetch output counts as "All Gather".
                assert o["Sharded Grad"] == o["All Gather"] == 0, (fqn, state)
                if state == "After Pre-Backward":
                    # torch prefetches inside the group's pre_backward, ours just after
                    # it returns: at this snapshot ours holds no prefetch yet.
                    assert o["Temp"] == t["Temp"] + t["Sharded Grad"], (fqn, state)
                    assert o["Total"] == t["Total"] - t["All Gather"], (fqn, state)
                else:
                    assert o["Temp"] == t["Temp"] + t["Sharded Grad"] + t["All Gather"], (
                        fqn,
                        state,
                    )
                    assert o["Total"] == t["Total"], (fqn, state)
                rest = set(t) - {"Sharded Grad", "All Gather", "Temp", "Total"}
                assert {k: o[k] for k in rest} == {k: t[k] for k in rest}, (fqn, state)


def test_state_torch_cannot_describe_is_refused():
    # torch's state has one module's hooks; fully_shard([a, b]) has two.
    with fake_mesh(2) as mesh, use_dtensor_fsdp():
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        dtensor_fsdp.fully_shard([model[0], model[1]], mesh=mesh)
        dtensor_fsdp.fully_shard(model, mesh=mesh)
        error = r"_pre_forward_hook_handle.*has 2.*MemTracker"
        with pytest.raises(NotImplementedError, match=error), FSDPMemTracker(model):
            pass


def test_names_leave_with_the_switch():
    with fake_mesh(2) as mesh:
        with use_dtensor_fsdp():
            pass
        model = dtensor_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
        with pytest.raises(AttributeError, match="no attribute '_fsdp_param_group'"):
            _ = model._get_fsdp_state()._fsdp_param_group


def _gloo_steps(rank: int, world_size: int) -> tuple[tuple[int, int], list, list]:
    mesh = init_device_mesh("cpu", (world_size,))
    theirs_after: list = []
    ours_after: list = []
    _, theirs = _tracked_step(torch_fully_shard_module.fully_shard, mesh, theirs_after)
    with use_dtensor_fsdp():
        _, ours = _tracked_step(torch.distributed.fsdp.fully_shard, mesh, ours_after)
    return (_backward_peak(theirs), _backward_peak(ours)), theirs_after, ours_after


def _backward_peak(modules: dict) -> int:
    return max(s["Total"] for stats in modules.values() for s in stats["Peak Backward"])


@pytest.fixture(scope="module")
def gloo_run(gloo_pool: GlooPools) -> list:
    return run_distributed(_gloo_steps, 2, timeout=300, pool=gloo_pool)


def test_gloo_training_goes_on_after_the_tracker(gloo_run):
    # The tracker removes our forward hooks, wraps them, and puts them back on exit
    # (through FSDPState.forward_hook_handles): the next step is torch's, bitwise (two
    # ranks: each reduction is one sum), with as many hooks as before.
    for _, theirs, ours in gloo_run:
        assert theirs == [theirs[0], True]
        assert ours == theirs


def test_gloo_backward_peak_differs_by_the_all_to_all_receive_buffer(gloo_run):
    # On gloo ours reduces with an all-to-all and a local sum (runtime/collectives.py):
    # its receive buffer holds W chunks where torch's reduce-scatter output holds one,
    # (W - 1) / W of a block's gradient bytes more while it is in flight. The tracker
    # sees no reduce-scatter op from ours, so no "Reduce Scatter" label either.
    # Ours' peak is the same on every rank; torch's is not always: one CI run measured
    # 439,176 B on rank 0 against 412,168 B on rank 1 (and 412,168 on both in others),
    # so ours is compared with torch's lowest, and each torch peak is bounded by ours.
    theirs = [peaks[0] for peaks, _, _ in gloo_run]
    ours = {peaks[1] for peaks, _, _ in gloo_run}
    assert len(ours) == 1, ours
    assert ours.pop() - min(theirs) == _BLOCK_UNSHARDED_BYTES // 2, theirs
    assert all(peak <= min(theirs) + _BLOCK_UNSHARDED_BYTES // 2 for peak in theirs), theirs
