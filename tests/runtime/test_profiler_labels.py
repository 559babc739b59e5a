"""FSDP's steps in ``torch.profiler`` traces, labelled as torch's FSDP2 labels them.

A step of the same model under torch's profiler (CPU), sharded by torch's
``fully_shard`` and by ours, on the fake process group in this process: every group's
``FSDP::<step> (<fqn>)`` ranges appear in ours as often as in torch's (all-gathers,
copy-outs, pre/post forward and backward, the reduce-scatter's issue, the prefetches),
each all-gather, copy-out and reduce-scatter inside the step that issues it; after the
profiler, no group holds labels (a step then pays no call for them: docs/observe.md).
"""

from collections import Counter

import pytest
import torch
from torch import nn
from torch.autograd.profiler_util import FunctionEvent
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.profiler import ProfilerActivity, profile

import dtensor_fsdp
from dtensor_fsdp import MixedPrecisionPolicy, fully_shard
from dtensor_fsdp.runtime.state import state_of
from tests._harness import fake_mesh

GROUPS = ("0", "1", "2", "")  # the blocks' fqns, then the root's
# torch's labels of a group's steps, each ours too (torch's post_backward_accumulate
# and post_backward_reshard are one post_backward range in ours).
STEPS = (
    "pre_forward",
    "all_gather",
    "all_gather_copy_out",
    "post_forward",
    "pre_backward",
    "post_backward_reduce",
)
POLICIES = {"ours": MixedPrecisionPolicy, "torch": TorchMixedPrecisionPolicy}


def _model(shard, policy) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)))
    model.append(nn.Linear(8, 8))  # the root's own parameters
    kwargs = {} if policy is None else {"mp_policy": policy}
    for block in model[:3]:
        shard(block, **kwargs)
    shard(model, **kwargs)
    return model


def _step(model: nn.Module) -> None:
    model(torch.randn(4, 8)).sum().backward()


def _profiled(impl: str, mixed: bool) -> list[FunctionEvent]:
    shard = fully_shard if impl == "ours" else torch_fully_shard
    policy = POLICIES[impl](torch.bfloat16, torch.float32) if mixed else None
    model = _model(shard, policy)
    _step(model)  # lazy init outside the trace
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _step(model)
    _step(model)  # after the profiler: ours takes its labels back
    if impl == "ours":
        groups = [g for m in model.modules() if state_of(m) for g in state_of(m).groups]
        assert len(groups) == 4 and all(g.labels is None for g in groups)
    return [e for e in prof.events() if e.name.startswith("FSDP::")]


def _label(step: str, fqn: str) -> str:
    return f"FSDP::{step} ({fqn})" if fqn else f"FSDP::{step}"


@pytest.fixture(scope="module", params=[False, True], ids=["fp32", "bf16"])
def events(request: pytest.FixtureRequest) -> dict[str, list[FunctionEvent]]:
    with fake_mesh(2):
        return {impl: _profiled(impl, request.param) for impl in POLICIES}


def test_every_groups_steps_are_labelled_as_often_as_torchs(events) -> None:
    ours = Counter(e.name for e in events["ours"])
    theirs = Counter(e.name for e in events["torch"])
    for fqn in GROUPS:
        for step in STEPS:
            label = _label(step, fqn)
            assert ours[label] == theirs[label], (label, ours[label], theirs[label])
        assert ours[_label("post_backward", fqn)] == 1, fqn
    prefetches = {name for name in theirs | ours if "_prefetch for " in name}
    assert prefetches == {f"FSDP::backward_prefetch for {f}" for f in ("2", "1", "0")}
    assert all(ours[name] == theirs[name] == 1 for name in prefetches), (ours, theirs)
    # Every group all-gathers in forward; the blocks again in backward (the root keeps
    # its parameters), and each reduce-scatters once.
    assert [ours[_label("all_gather", f)] for f in GROUPS] == [2, 2, 2, 1]
    assert [ours[_label("post_backward_reduce", f)] for f in GROUPS] == [1, 1, 1, 1]


def _inside(inner: FunctionEvent, outer: FunctionEvent) -> bool:
    return (
        outer.time_range.start <= inner.time_range.start
        and inner.time_range.end <= outer.time_range.end
    )


@pytest.mark.parametrize(
    "inner, outers",
    [
        ("all_gather", ("pre_forward", "pre_backward", "forward_prefetch", "backward_prefetch")),
        ("all_gather_copy_out", ("pre_forward", "pre_backward")),
        ("post_backward_reduce", ("post_backward",)),
    ],
    ids=["all_gather", "all_gather_copy_out", "post_backward_reduce"],
)
def test_ranges_nest_as_torchs(events, inner: str, outers: tuple[str, ...]) -> None:
    """A copy-in and issue runs inside a group's pre-forward or pre-backward, or inside
    a prefetch's range; a copy-out inside the pre-forward or pre-backward that needs
    it; a reduce-scatter's issue inside its group's post-backward."""
    ours = events["ours"]
    enclosing = [e for e in ours if any(e.name.startswith(f"FSDP::{o}") for o in outers)]
    for event in (e for e in ours if e.name.split(" ")[0] == f"FSDP::{inner}"):
        assert any(_inside(event, outer) for outer in enclosing), event.name



def _graph_mode_labels(bucketing: bool) -> tuple[Counter, Counter]:
    """The labels of a compiled forward, then of its backward."""
    model = _model(fully_shard, None)
    dtensor_fsdp.compile(model, backend="aot_eager", bucketing=bucketing)
    _step(model)  # compiles
    labels = []
    loss = None
    for phase in ("forward", "backward"):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            if phase == "forward":
                loss = model(torch.randn(4, 8)).sum()
            else:
                loss.backward()
        labels.append(Counter(e.name for e in prof.events() if e.name.startswith("FSDP::")))
    return labels[0], labels[1]


@pytest.mark.parametrize("bucketing", [False, True], ids=["unbucketed", "bucketed"])
def test_graph_mode_labels_each_groups_gather_and_reduction_where_dynamo_keeps_them(
    bucketing: bool,
) -> None:
    """Graph mode has no hooks: its compiled graphs carry the all-gathers and the
    reductions, with their labels when dynamo is told to capture ``record_function``
    (``capture_profiler_record_function``) and the backend keeps them (aot_eager;
    inductor drops them in torch 2.13)."""
    torch._dynamo.reset()
    with fake_mesh(2), torch._dynamo.config.patch(capture_profiler_record_function=True):
        forward, backward = _graph_mode_labels(bucketing)
    torch._dynamo.reset()
    for fqn in GROUPS:
        assert forward[_label("all_gather", fqn)] == 1, (fqn, forward)
        assert backward[_label("post_backward_reduce", fqn)] == 1, (fqn, backward)
