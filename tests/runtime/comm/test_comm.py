"""The exact collectives and lifecycle of a training step, as golden traces.

Each scenario trains a 3-group MLP (two blocks and the root) on 2 gloo ranks with a
``CommTrace`` installed and renders, on rank 0, the lifecycle schedule and every
collective (kind, group, bytes, phase) in issue order. One spawn runs every scenario.

Byte counts: block 0 is Linear(8, 16) (16x8 + 16 = 144 fp32 = 576 B), block 1 is
Linear(16, 16) (272 fp32 = 1088 B), the root's head Linear(16, 3) is 3x16 + 3 = 51
values, padded to 2 rows per rank: 2 x (2x16 + 2) = 68 fp32 = 272 B. All-gather bytes
are the output buffer, reduce-scatter bytes the input buffer; both are W x the padded
shard.
"""

from typing import Any

import pytest
import torch
import torch.nn as nn
from expecttest import assert_expected_inline
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import CommTrace, fully_shard
from tests._harness import run_distributed

WORLD_SIZE = 2


def _model(mesh: Any, shard: Any = fully_shard, **kwargs: Any) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
    shard(model[0], mesh=mesh, **kwargs)
    shard(model[2], mesh=mesh, **kwargs)
    shard(model, mesh=mesh)
    return model


def _render(trace: CommTrace, with_group_size: bool = False) -> str:
    schedule = [f"{event:<13} {fqn or 'root':<5} {phase}" for event, fqn, phase in trace.schedule()]
    comms = [
        f"{e.kind:<14} {e.fqn or 'root':<5} {e.nbytes:>5} B  {e.phase}"
        + (f"  over {e.group_size} ranks" if with_group_size else "")
        for e in sorted(trace.events, key=lambda e: e.start_s)
    ]
    return "\n".join(schedule + ["--"] + comms)


def _step(model: nn.Module, rank: int) -> None:
    torch.manual_seed(rank)
    model(torch.randn(4, 8)).pow(2).mean().backward()


def _scenarios(rank: int, world_size: int) -> dict[str, str]:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, str] = {}

    def traced(name: str, model: nn.Module, run: Any) -> None:
        _step(model, rank)  # warm-up: lazy init happens here, outside the trace
        model.zero_grad()
        trace = CommTrace()
        model.set_comm_trace(trace)
        run(model)
        out[name] = _render(trace)

    traced("default", _model(mesh), lambda m: _step(m, rank))
    traced("no_reshard", _model(mesh, reshard_after_forward=False), lambda m: _step(m, rank))

    def explicit(model: nn.Module) -> None:
        model[0].set_modules_to_forward_prefetch([model[2]])
        model.set_modules_to_backward_prefetch([model[2], model[0]])
        model[2].set_modules_to_backward_prefetch([])
        _step(model, rank)

    traced("explicit_prefetch", _model(mesh), explicit)

    # Same numbers under the explicit schedule as under the default one.
    grads = []
    for schedule in (lambda m: _step(m, rank), explicit):
        model = _model(mesh)
        schedule(model)
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    out["explicit_max_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(*grads))

    def no_grad_forward(model: nn.Module) -> None:
        with torch.no_grad():
            model(torch.randn(4, 8))

    traced("no_grad", _model(mesh), no_grad_forward)

    def accumulate(model: nn.Module) -> None:
        model.set_requires_gradient_sync(False)
        _step(model, rank)

    traced("no_sync", _model(mesh), accumulate)

    # set_is_last_backward(False), with any number of reduce-scatters in flight: as in
    # torch, every sharded grad has landed when backward returns, and the next last
    # backward accumulates onto them.
    reference = _model(mesh)
    _step(reference, rank)
    for impl, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        for max_buffers in (2, 1):
            model = _model(mesh, shard)
            model.set_reduce_scatter_max_input_buffers(max_buffers)
            model.set_is_last_backward(False)
            _step(model, rank)
            out[f"without_grad_{impl}_{max_buffers}"] = sorted(
                name for name, p in model.named_parameters() if p.grad is None
            )
            model.set_is_last_backward(True)
            _step(model, rank)
            out[f"accumulated_diff_{impl}_{max_buffers}"] = max(
                (p.grad.full_tensor() - 2 * q.grad.full_tensor()).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True)
            )

    model = _model(mesh)
    trace = CommTrace()
    model.set_comm_trace(trace)
    handle = model[2].unshard(async_op=True)
    handle.wait()
    out["unshard_registers"] = type(model[2].weight.data).__name__
    _step(model, rank)  # block 2's forward finds it unsharded: no second all-gather
    out["explicit_unshard"] = _render(trace)
    return out


def _hpz(rank: int, world_size: int) -> dict[str, Any]:
    """reshard_after_forward=2 on 4 ranks: backward all-gathers run over 2 ranks, and
    training matches the default schedule exactly."""
    mesh = init_device_mesh("cpu", (world_size,))
    hpz, default = _model(mesh, reshard_after_forward=2), _model(mesh)
    trace = CommTrace()
    hpz.set_comm_trace(trace)
    max_diff = 0.0
    for model in (hpz, default):
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            _step(model, rank)
            optim.step()
            optim.zero_grad()
    for p, q in zip(hpz.parameters(), default.parameters(), strict=True):
        max_diff = max(max_diff, (p.full_tensor() - q.full_tensor()).abs().max().item())
    steps = len(trace.events) // 8
    trace.events[:] = trace.events[-8:]  # the last step
    trace.lifecycle[:] = trace.lifecycle[-len(trace.lifecycle) // steps :]
    return {"trace": _render(trace, with_group_size=True), "max_diff": max_diff}


@pytest.fixture(scope="module")
def traces() -> dict[str, str]:
    return run_distributed(_scenarios, WORLD_SIZE)[0]


@pytest.fixture(scope="module")
def hpz() -> dict[str, Any]:
    return run_distributed(_hpz, 4)[0]


def test_hpz_backward_all_gathers_over_the_smaller_mesh(hpz: dict[str, Any]) -> None:
    # Blocks keep 1/2 of their unsharded params after forward (W=4, k=2), so their
    # backward all-gathers move the same bytes over 2 ranks: (k-1)/k of them on the
    # wire instead of (W-1)/W, and on an intra-node group in a real deployment.
    assert hpz["max_diff"] == 0.0
    assert_expected_inline(hpz["trace"], """\
unshard       root  forward
unshard       0     forward
reshard_post_forward 0     forward
unshard       2     forward
reshard_post_forward 2     forward
pre_backward  root  backward
unshard       2     backward
pre_backward  2     backward
unshard       0     backward
post_backward 2     backward
reshard       2     backward
pre_backward  0     backward
post_backward root  backward
reshard       root  backward
post_backward 0     backward
reshard       0     backward
--
all_gather     root    272 B  forward  over 4 ranks
all_gather     0       576 B  forward  over 4 ranks
all_gather     2      1088 B  forward  over 4 ranks
all_gather     2      1088 B  backward  over 2 ranks
all_gather     0       576 B  backward  over 2 ranks
reduce_scatter 2      1088 B  backward  over 4 ranks
reduce_scatter root    272 B  backward  over 4 ranks
reduce_scatter 0       576 B  backward  over 4 ranks""")


def test_default_schedule(traces: dict[str, str]) -> None:
    # Forward: one all-gather per group; the root keeps its params, and block 0 is
    # resharded only once block 2's forward is done. Block 2, last in forward and first
    # in backward, stays unsharded into backward: no all-gather for it there. Block 2's
    # pre-backward prefetches block 0; one reduce-scatter per group; the root's (its
    # inputs have no grad) runs at the end.
    assert_expected_inline(traces["default"], """\
unshard       root  forward
unshard       0     forward
reshard       0     forward
unshard       2     forward
reshard       2     forward
pre_backward  root  backward
unshard       2     backward
pre_backward  2     backward
unshard       0     backward
post_backward 2     backward
reshard       2     backward
pre_backward  0     backward
post_backward root  backward
reshard       root  backward
post_backward 0     backward
reshard       0     backward
--
all_gather     root    272 B  forward
all_gather     0       576 B  forward
all_gather     2      1088 B  forward
all_gather     2      1088 B  backward
all_gather     0       576 B  backward
reduce_scatter 2      1088 B  backward
reduce_scatter root    272 B  backward
reduce_scatter 0       576 B  backward""")


def test_no_reshard_after_forward_skips_backward_all_gathers(traces: dict[str, str]) -> None:
    assert_expected_inline(traces["no_reshard"], """\
unshard       root  forward
unshard       0     forward
unshard       2     forward
pre_backward  root  backward
pre_backward  2     backward
post_backward 2     backward
reshard       2     backward
pre_backward  0     backward
post_backward root  backward
reshard       root  backward
post_backward 0     backward
reshard       0     backward
--
all_gather     root    272 B  forward
all_gather     0       576 B  forward
all_gather     2      1088 B  forward
reduce_scatter 2      1088 B  backward
reduce_scatter root    272 B  backward
reduce_scatter 0       576 B  backward""")


def test_explicit_prefetch(traces: dict[str, str]) -> None:
    # Block 0's forward issues block 2's all-gather before block 0 computes; the root's
    # backward prefetches both blocks at once, and block 2 prefetches nothing.
    assert_expected_inline(traces["explicit_prefetch"], """\
unshard       root  forward
unshard       0     forward
unshard       2     forward
reshard       0     forward
reshard       2     forward
pre_backward  root  backward
unshard       2     backward
unshard       0     backward
pre_backward  2     backward
post_backward 2     backward
reshard       2     backward
pre_backward  0     backward
post_backward root  backward
reshard       root  backward
post_backward 0     backward
reshard       0     backward
--
all_gather     root    272 B  forward
all_gather     0       576 B  forward
all_gather     2      1088 B  forward
all_gather     2      1088 B  backward
all_gather     0       576 B  backward
reduce_scatter 2      1088 B  backward
reduce_scatter root    272 B  backward
reduce_scatter 0       576 B  backward""")


def test_explicit_prefetch_gives_the_same_gradients(traces: dict[str, Any]) -> None:
    assert traces["explicit_max_grad_diff"] == 0.0


def test_no_grad_forward_keeps_the_root_unsharded(traces: dict[str, str]) -> None:
    # As torch's: the next forward of an evaluation loop all-gathers the blocks only
    # (compared with torch's collectives in test_eval_generate.py).
    assert_expected_inline(traces["no_grad"], """\
unshard       root  forward
unshard       0     forward
reshard       0     forward
unshard       2     forward
reshard       2     forward
--
all_gather     root    272 B  forward
all_gather     0       576 B  forward
all_gather     2      1088 B  forward""")


def test_no_gradient_sync_issues_no_reduce_scatter(traces: dict[str, str]) -> None:
    assert_expected_inline(traces["no_sync"], """\
unshard       root  forward
unshard       0     forward
reshard       0     forward
unshard       2     forward
reshard       2     forward
pre_backward  root  backward
unshard       2     backward
pre_backward  2     backward
unshard       0     backward
post_backward 2     backward
reshard       2     backward
pre_backward  0     backward
post_backward root  backward
reshard       root  backward
post_backward 0     backward
reshard       0     backward
--
all_gather     root    272 B  forward
all_gather     0       576 B  forward
all_gather     2      1088 B  forward
all_gather     2      1088 B  backward
all_gather     0       576 B  backward""")


def test_explicit_async_unshard(traces: dict[str, str]) -> None:
    assert traces["unshard_registers"] == "Tensor"  # the unsharded param, not the DTensor
    assert_expected_inline(traces["explicit_unshard"], """\
unshard       2     explicit
unshard       root  forward
unshard       0     forward
reshard       0     forward
reshard       2     forward
pre_backward  root  backward
unshard       2     backward
pre_backward  2     backward
unshard       0     backward
post_backward 2     backward
reshard       2     backward
pre_backward  0     backward
post_backward root  backward
reshard       root  backward
post_backward 0     backward
reshard       0     backward
--
all_gather     2      1088 B  explicit
all_gather     root    272 B  forward
all_gather     0       576 B  forward
all_gather     2      1088 B  backward
all_gather     0       576 B  backward
reduce_scatter 2      1088 B  backward
reduce_scatter root    272 B  backward
reduce_scatter 0       576 B  backward""")


@pytest.mark.parametrize("impl", ["ours", "torch"])
@pytest.mark.parametrize("max_buffers", [1, 2])
def test_not_last_backward_still_lands_every_grad(
    traces: dict[str, Any], impl: str, max_buffers: int
) -> None:
    assert traces[f"without_grad_{impl}_{max_buffers}"] == []
    # Two identical steps accumulate twice the reference grads (one fp32 add).
    assert traces[f"accumulated_diff_{impl}_{max_buffers}"] < 1e-6
