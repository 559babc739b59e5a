"""One script, run on torch's ``fully_shard`` and on ours: the scenario files' shared parts.

The standing guard of issue 37: each ``test_scenarios_<family>.py`` holds our own
equivalents of one family of torch's FSDP2 tests (``test_fully_shard_<family>.py``).
A *case* is a function ``case(side, mesh)`` that builds a model, shards it with
``side.fully_shard``, trains it and returns plain records (losses, every local grad,
every local shard after each optimizer step, the c10d collectives of a phase, dtypes).
The file's one spawn of 2 gloo ranks runs every case once per side; the tests compare
the two sides' records with ``assert_same``: structures equal, tensors bitwise (dtype
and values), ``None`` exactly where torch's is ``None``.

Why bitwise: on 2 ranks both sides run the same local arithmetic on the same shards
and every reduction adds two terms (a + b == b + a exactly), so any difference is a
behaviour difference ([Note: parity tolerances] in ``tests/_parity.py``, item 1).
A case whose arithmetic differs says so and compares with a tolerance.

A scenario file defines ``CASES`` (name -> case) and gets its spawn as the fixture
``run = cases_fixture(__name__)``. Child side: ``run_cases``, the record helpers
``local``, ``local_grads``, ``local_shards``, ``collectives``, ``rank_input``,
``rank_tokens`` and ``train``. Parent side: ``side_records``, ``checked``,
``assert_same`` and ``known_difference``.

``--fsdp-impl torch`` (tests/conftest.py) puts torch's ``fully_shard`` on both sides,
which checks the cases themselves: they must be deterministic.
"""

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from tests._c10d import C10dRecorder
from tests._harness import run_distributed, run_scenarios, scenario_records

SIDES = ("ours", "torch")
WORLD_SIZE = 2
_MODULES = {"ours": "dtensor_fsdp", "torch": "torch.distributed.fsdp"}


@dataclass(frozen=True)
class Side:
    """One implementation's public FSDP2 API, as a case uses it."""

    name: str  # "ours" or "torch": the side this runs as (not which library it is)
    fully_shard: Callable[..., Any]
    MixedPrecisionPolicy: type
    FSDPModule: type
    register_fsdp_forward_method: Callable[..., Any]
    CPUOffloadPolicy: type


def _side(name: str, library: str) -> Side:
    module = importlib.import_module(_MODULES[library])
    return Side(
        name,
        module.fully_shard,
        module.MixedPrecisionPolicy,
        module.FSDPModule,
        module.register_fsdp_forward_method,
        module.CPUOffloadPolicy,
    )


Case = Callable[[Side, DeviceMesh], Any]


def run_cases(fsdp_impl: str, cases: dict[str, Case]) -> dict[str, tuple[str, Any]]:
    """Child side: every case on both sides, as scenarios ``"<case>-ours"`` and
    ``"<case>-torch"`` (in that order), on a 1-D mesh over the world."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sides = {name: _side(name, "torch" if fsdp_impl == "torch" else name) for name in SIDES}
    return run_scenarios(
        {
            f"{case}-{side}": functools.partial(fn, sides[side], mesh)
            for case, fn in cases.items()
            for side in SIDES
        }
    )


def _run_module_cases(rank: int, world_size: int, fsdp_impl: str, module: str) -> dict:
    return run_cases(fsdp_impl, importlib.import_module(module).CASES)


def cases_fixture(module: str) -> Any:
    """The module-scoped fixture ``run``: one spawn of ``WORLD_SIZE`` gloo ranks running
    every case of ``module``'s ``CASES`` on both sides; per rank, every scenario's
    record."""

    @pytest.fixture(scope="module")
    def run(fsdp_impl: str) -> list[dict[str, Any]]:
        return run_distributed(_run_module_cases, WORLD_SIZE, fsdp_impl, module, timeout=300.0)

    return run


# ---------------------------------------------------------------------------
# Child side: records
# ---------------------------------------------------------------------------


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's local tensor of ``t`` (a DTensor's local shard), detached and cloned."""
    if t is None:
        return None
    return (t.to_local() if isinstance(t, DTensor) else t).detach().clone()


def local_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {name: local(p.grad) for name, p in model.named_parameters()}


def local_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: local(p) for name, p in model.named_parameters()}


def collectives(recorder: C10dRecorder) -> list[tuple[str, int]]:
    """The recorded collectives, in issue order; on gloo ours reduce-scatters with an
    all-to-all, counted as the reduce-scatter it stands for."""
    return [
        ("reduce_scatter" if kind == "all_to_all" else kind, nbytes)
        for kind, nbytes in recorder.records
    ]


def rank_input(step: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """This rank's batch for ``step``: the same on both sides, different per rank."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randn(*shape, generator=generator).to(dtype)


def rank_tokens(step: int, vocab: int, *shape: int) -> torch.Tensor:
    """This rank's token ids for ``step`` (as ``rank_input``)."""
    generator = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    return torch.randint(0, vocab, shape, generator=generator)


def train(
    model: nn.Module, steps: int, loss_fn: Callable[[int], torch.Tensor], lr: float = 1e-2
) -> list[dict[str, Any]]:
    """``steps`` Adam steps of ``loss_fn(step)`` (it runs the forward; the backward is
    ``loss.backward()``); per step the loss, the collectives of forward + backward, every
    local grad, then every local shard after the step. ``zero_grad`` alternates
    ``set_to_none`` True/False, as torch's tests do, so both accumulate paths run."""
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    records = []
    for step in range(steps):
        with C10dRecorder() as recorder:
            loss = loss_fn(step)
            loss.backward()
        record = {
            "loss": loss.detach().clone(),
            "collectives": collectives(recorder),
            "grads": local_grads(model),
        }
        optim.step()
        optim.zero_grad(set_to_none=step % 2 == 0)
        record["shards"] = local_shards(model)
        records.append(record)
    return records


# ---------------------------------------------------------------------------
# Parent side
# ---------------------------------------------------------------------------


def known_difference(reason: str) -> pytest.MarkDecorator:
    """A behaviour of ours that differs from torch's, found by these cases and reported
    to the lead: strict, so the test fails once the difference is gone. Only when ours
    plays "ours" (with ``--fsdp-impl torch`` both sides are torch's and agree)."""
    return pytest.mark.xfail(
        "config.getoption('--fsdp-impl') == 'ours'", reason=reason, strict=True
    )


def side_records(run: list, case: str) -> list[tuple[Any, Any]]:
    """Per rank, (ours, torch's) records of ``case``; fails with a side's traceback."""
    return list(zip(scenario_records(run, f"{case}-ours"), scenario_records(run, f"{case}-torch")))


def assert_same(ours: Any, theirs: Any, where: str) -> None:
    """Equal structures; tensors bitwise (dtype, shape and values), ``None`` where torch's
    is ``None``."""
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and ours.keys() == theirs.keys(), (
            f"{where}: keys {sorted(ours)} != {sorted(theirs)}"
        )
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{where}.{key}")
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), (
            f"{where}: {ours!r} != {theirs!r}"
        )
        for index, (mine, torchs) in enumerate(zip(ours, theirs)):
            assert_same(mine, torchs, f"{where}[{index}]")
    elif isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torch.Tensor), f"{where}: {ours!r} where torch has a tensor"
        assert (ours.dtype, ours.shape) == (theirs.dtype, theirs.shape), (
            f"{where}: {ours.dtype}{tuple(ours.shape)} != {theirs.dtype}{tuple(theirs.shape)}"
        )
        if not torch.equal(ours, theirs):
            diff = (ours.double() - theirs.double()).abs().max().item()
            raise AssertionError(f"{where}: not bitwise torch's (max abs diff {diff:.3g})")
    else:
        assert ours == theirs, f"{where}: {ours!r} != {theirs!r}"


def assert_pairs_same(pairs: list[tuple[Any, Any]]) -> None:
    """``assert_same`` on every rank's (ours, torch's) records."""
    for rank, (ours, theirs) in enumerate(pairs):
        assert_same(ours, theirs, f"rank {rank}")


def checked(run: list, case: str) -> list[tuple[Any, Any]]:
    """``case``'s records, every rank's equal to torch's (``assert_same``) and not
    vacuous (``assert_trained`` on its steps: the record, or its ``"steps"``)."""
    pairs = side_records(run, case)
    assert_pairs_same(pairs)
    for rank, (ours, _) in enumerate(pairs):
        assert_trained(ours["steps"] if isinstance(ours, dict) else ours, f"rank {rank}")
    return pairs


def assert_trained(steps: list[dict[str, Any]], where: str) -> None:
    """The comparison is not vacuous: some grad is there, and the shards moved (unless
    this rank holds only empty shards)."""
    assert any(g is not None for step in steps for g in step["grads"].values()), where
    first, last = steps[0]["shards"], steps[-1]["shards"]
    held = [name for name in first if first[name].numel()]
    assert not held or any(not torch.equal(first[n], last[n]) for n in held), where
