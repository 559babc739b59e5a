"""A training step's collectives and the lifecycle of its parameters, as properties.

Each scenario trains a 3-group MLP (two blocks and the root) on torch's ``fully_shard``
and on ours, on the same ranks, and records one step: every collective at the c10d level
(``tests/_c10d.py``: kind, bytes and the size of its group, in issue order) and, at each
use of a ``Linear`` (its forward, and its backward once FSDP's pre-backward ran), which
``Linear``s have their parameters registered unsharded, with the number of collectives
issued so far. What the tests assert:

- every parameter is all-gathered before its use (its module is unsharded at each of
  its probes) and resharded after the step;
- the collectives, and where they fall between the modules' computations (an explicit
  prefetch issues an all-gather before the preceding module computes), equal torch's;
- which modules are unsharded at each use equals torch's (what ``reshard_after_forward``
  and prefetching leave registered).

Nothing here reads our internal lifecycle verbs: a schedule that differs from torch's
in any collective or any registered state fails, whatever our code calls it.
"""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard
from tests._c10d import C10dRecorder
from tests._harness import run_distributed
from tests._pool import GlooPools

WORLD_SIZE = 2
IMPLS = {"ours": fully_shard, "torch": torch_fully_shard}
LINEARS = ("0", "2", "root")


def _model(mesh: Any, shard: Any = fully_shard, **kwargs: Any) -> nn.Sequential:
    """Blocks 0 and 2 each a ``Sequential`` around one ``Linear`` (so that a probe on the
    ``Linear``'s output runs after its group's pre-backward), and the root's head."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(8, 16)),
        nn.ReLU(),
        nn.Sequential(nn.Linear(16, 16)),
        nn.ReLU(),
        nn.Linear(16, 3),
    )
    shard(model[0], mesh=mesh, **kwargs)
    shard(model[2], mesh=mesh, **kwargs)
    shard(model, mesh=mesh)
    return model


def _linears(model: nn.Sequential) -> dict[str, nn.Linear]:
    return {"0": model[0][0], "2": model[2][0], "root": model[4]}


class _Log:
    """The step's c10d collectives and the probes between them."""

    def __init__(self) -> None:
        self.recorder = C10dRecorder()
        self.probes: list[tuple[str, str, tuple[str, ...], int]] = []
        self.enabled = False

    def probe(self, phase: str, name: str, model: nn.Sequential) -> None:
        if self.enabled:
            unsharded = tuple(
                n for n, m in _linears(model).items() if not isinstance(m.weight, DTensor)
            )
            self.probes.append((phase, name, unsharded, len(self.recorder.records)))

    def collectives(self) -> list[tuple[str, int, int]]:
        """(kind, bytes, group size) in issue order; a reduction is a reduce-scatter
        whether torch's reduce_scatter or ours (an all-to-all on gloo) carries it."""
        return [
            ("reduce_scatter" if kind == "all_to_all" else kind, nbytes, _group_size(group))
            for (kind, nbytes), group in zip(
                self.recorder.records, self.recorder.groups, strict=True
            )
        ]


def _group_size(name: str | None) -> int:
    assert name is not None
    return dist.distributed_c10d._resolve_process_group(name).size()


class _BackwardProbe(torch.autograd.Function):
    """Identity whose backward logs: it runs once the module's output grad arrived, so
    after its group's pre-backward and before the module's own backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, log: Callable[[], None]) -> torch.Tensor:
        ctx.log = log
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.log()
        return grad, None


def _install_probes(model: nn.Sequential, log: _Log) -> None:
    for name, linear in _linears(model).items():
        linear.register_forward_pre_hook(lambda *_, name=name: log.probe("forward", name, model))
        linear.register_forward_hook(
            lambda _m, _i, out, name=name: _BackwardProbe.apply(
                out, lambda: log.probe("backward", name, model)
            )
        )


def _step(model: nn.Module, rank: int) -> None:
    torch.manual_seed(rank)
    model(torch.randn(4, 8)).pow(2).mean().backward()


def _recorded(
    model: nn.Sequential, run: Callable[[nn.Sequential], None], rank: int, warm_up: bool = True
) -> dict[str, Any]:
    """``run`` recorded, after a warm-up step (lazy init outside the record) if asked."""
    log = _Log()
    _install_probes(model, log)
    if warm_up:
        _step(model, rank)
        model.zero_grad()
    log.enabled = True
    with log.recorder:
        run(model)
    log.enabled = False
    return {
        "collectives": log.collectives(),
        "probes": log.probes,
        "unsharded_after": sorted(
            n for n, m in _linears(model).items() if not isinstance(m.weight, DTensor)
        ),
    }


def _explicit_prefetch(model: nn.Sequential, rank: int) -> None:
    model[0].set_modules_to_forward_prefetch([model[2]])
    model.set_modules_to_backward_prefetch([model[2], model[0]])
    model[2].set_modules_to_backward_prefetch([])
    _step(model, rank)


def _no_grad_forward(model: nn.Sequential, rank: int) -> None:
    with torch.no_grad():
        model(torch.randn(4, 8))


def _no_sync(model: nn.Sequential, rank: int) -> None:
    model.set_requires_gradient_sync(False)
    _step(model, rank)


def _explicit_unshard(model: nn.Sequential, rank: int) -> None:
    model[2].unshard(async_op=True).wait()
    # The unsharded param is registered (a Tensor, not the DTensor), and block 2's
    # forward finds it unsharded: no second all-gather.
    assert type(model[2][0].weight.data) is torch.Tensor
    _step(model, rank)


# name -> (fully_shard kwargs for the blocks, the recorded run, whether lazy init runs
# in a warm-up step before it)
SCENARIOS: dict[str, tuple[dict[str, Any], Callable[[nn.Sequential, int], None], bool]] = {
    "default": ({}, _step, True),
    "no_reshard": ({"reshard_after_forward": False}, _step, True),
    "explicit_prefetch": ({}, _explicit_prefetch, True),
    "no_grad": ({}, _no_grad_forward, True),
    "no_sync": ({}, _no_sync, True),
    "explicit_unshard": ({}, _explicit_unshard, False),
}


def _record(
    mesh: Any, impl: str, kwargs: dict[str, Any], run: Any, warm_up: bool, rank: int
) -> dict[str, Any]:
    model = _model(mesh, IMPLS[impl], **kwargs)
    return _recorded(model, lambda m: run(m, rank), rank, warm_up)


def _scenarios(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {
        name: {impl: _record(mesh, impl, kwargs, run, warm_up, rank) for impl in IMPLS}
        for name, (kwargs, run, warm_up) in SCENARIOS.items()
    }

    # Same numbers under the explicit schedule as under the default one.
    grads = []
    for schedule in (_step, _explicit_prefetch):
        model = _model(mesh)
        schedule(model, rank)
        grads.append([p.grad.full_tensor() for p in model.parameters()])
    out["explicit_max_grad_diff"] = max((a - b).abs().max().item() for a, b in zip(*grads))

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

    return out


def _hpz(rank: int, world_size: int) -> dict[str, Any]:
    """reshard_after_forward=2 on 4 ranks, recorded on both libraries; and training
    matches the default schedule exactly."""
    mesh = init_device_mesh("cpu", (world_size,))
    out: dict[str, Any] = {
        impl: _record(mesh, impl, {"reshard_after_forward": 2}, _step, True, rank) for impl in IMPLS
    }
    hpz, default = _model(mesh, reshard_after_forward=2), _model(mesh)
    max_diff = 0.0
    for model in (hpz, default):
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            _step(model, rank)
            optim.step()
            optim.zero_grad()
    for p, q in zip(hpz.parameters(), default.parameters(), strict=True):
        max_diff = max(max_diff, (p.full_tensor() - q.full_tensor()).abs().max().item())
    out["max_diff"] = max_diff
    return out


@pytest.fixture(scope="module")
def records(gloo_pool: GlooPools) -> dict[str, Any]:
    return run_distributed(_scenarios, WORLD_SIZE, pool=gloo_pool)[0]


@pytest.fixture(scope="module")
def hpz(gloo_pool: GlooPools) -> dict[str, Any]:
    return run_distributed(_hpz, 4, pool=gloo_pool)[0]


def _assert_used_unsharded_and_resharded_after(record: dict[str, Any], backward: bool) -> None:
    """Each module's params are all-gathered before each use, and resharded after the
    step (the root keeps its params after a forward without backward, as torch's)."""
    for phase, name, unsharded, _ in record["probes"]:
        assert name in unsharded, (phase, name, record["probes"])
    assert record["unsharded_after"] == ([] if backward else ["root"]), record["unsharded_after"]


def _assert_as_torch(record: dict[str, Any]) -> None:
    ours, theirs = record["ours"], record["torch"]
    assert ours["collectives"] == theirs["collectives"]
    assert ours["probes"] == theirs["probes"]
    assert ours["unsharded_after"] == theirs["unsharded_after"]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_each_parameter_is_gathered_before_use_and_resharded_after(records, name: str) -> None:
    for impl in IMPLS:
        _assert_used_unsharded_and_resharded_after(records[name][impl], backward=name != "no_grad")


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_collectives_and_registered_params_at_each_use_equal_torchs(records, name: str) -> None:
    _assert_as_torch(records[name])


def test_default_schedule_collectives(records) -> None:
    # Bytes: block 0 is Linear(8, 16) (144 fp32 = 576 B), block 2 Linear(16, 16) (1088 B),
    # the root's head Linear(16, 3), 51 values padded to 2 x 34 (272 B). Forward: one
    # all-gather per group; block 2, last in forward and first in backward, stays
    # unsharded into backward; one reduce-scatter per group.
    kinds = [(kind, nbytes) for kind, nbytes, _ in records["default"]["ours"]["collectives"]]
    gathers = [("all_gather", n) for n in (272, 576, 1088, 1088, 576)]
    assert sorted(kinds) == sorted(gathers + [("reduce_scatter", n) for n in (1088, 272, 576)])


def test_no_reshard_after_forward_skips_backward_all_gathers(records) -> None:
    for impl in IMPLS:
        collectives = records["no_reshard"][impl]["collectives"]
        assert [kind for kind, *_ in collectives] == ["all_gather"] * 3 + ["reduce_scatter"] * 3


def test_explicit_prefetch_gathers_block_2_before_block_0_computes(records) -> None:
    for impl in IMPLS:
        probes = records["explicit_prefetch"][impl]["probes"]
        # (phase, name, unsharded, collectives issued so far)
        issued_at_block_0 = next(
            n for phase, name, _, n in probes if (phase, name) == ("forward", "0")
        )
        assert issued_at_block_0 == 3, probes  # the root's, block 0's and block 2's
        default = records["default"][impl]["probes"]
        assert next(n for phase, name, _, n in default if (phase, name) == ("forward", "0")) == 2


def test_explicit_prefetch_gives_the_same_gradients(records) -> None:
    assert records["explicit_max_grad_diff"] == 0.0


def test_no_gradient_sync_issues_no_reduce_scatter(records) -> None:
    for impl in IMPLS:
        kinds = [kind for kind, *_ in records["no_sync"][impl]["collectives"]]
        assert kinds == ["all_gather"] * 5, kinds


@pytest.mark.full
def test_hpz_backward_all_gathers_over_the_smaller_mesh(hpz: dict[str, Any]) -> None:
    # Blocks keep 1/2 of their unsharded params after forward (W=4, k=2), so their
    # backward all-gathers move the same bytes over 2 ranks: (k-1)/k of them on the
    # wire instead of (W-1)/W, and on an intra-node group in a real deployment.
    assert hpz["max_diff"] == 0.0
    _assert_used_unsharded_and_resharded_after(hpz["ours"], backward=True)
    _assert_as_torch(hpz)
    sizes = [(kind, size) for kind, _, size in hpz["ours"]["collectives"]]
    assert sorted(sizes) == sorted(
        [("all_gather", 4)] * 3 + [("all_gather", 2)] * 2 + [("reduce_scatter", 4)] * 3
    ), sizes


@pytest.mark.parametrize("impl", ["ours", "torch"])
@pytest.mark.parametrize("max_buffers", [1, 2])
def test_not_last_backward_still_lands_every_grad(
    records: dict[str, Any], impl: str, max_buffers: int
) -> None:
    assert records[f"without_grad_{impl}_{max_buffers}"] == []
    # Two identical steps accumulate twice the reference grads (one fp32 add).
    assert records[f"accumulated_diff_{impl}_{max_buffers}"] < 1e-6
