"""``load_state_dict`` with a bad value (issue 11 item 4), against torch's ``fully_shard``.

One process plays rank 0 of 2 on torch's ``fake`` process group: every value here is
this rank's shard or a plain tensor, so no collective moves data. A bad value must
raise ``nn.Module``'s ``RuntimeError`` with torch's phrase, naming the key, before
anything is copied: every local tensor of the model keeps its bits. torch's
``fully_shard`` raises the same type after copying the values before the bad one
(torch 2.13's ``load_state_dict`` is not atomic: it leaves a half-loaded model): each
case shows that too, so the test would catch a copy-first implementation. NaN values are not bad: they load, as in torch.
"""

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from dtensor_fsdp import fully_shard
from tests._harness import fake_mesh

BAD_KEY = "2.weight"  # the third Linear: the first two load before it in torch


def _model(impl: Callable[..., Any], mesh: DeviceMesh) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4))
    for layer in (model[0], model[2]):
        impl(layer, mesh=mesh)
    impl(model, mesh=mesh)
    return model


def _local(value: torch.Tensor) -> torch.Tensor:
    return (value.to_local() if isinstance(value, DTensor) else value).detach().clone()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {key: _local(value) for key, value in model.state_dict().items()}


def _changed(before: dict[str, torch.Tensor], model: nn.Module) -> list[str]:
    after = _snapshot(model)
    return [k for k, v in before.items() if not torch.equal(v, after[k])]


def _sharded_like(model: nn.Module, fill: float) -> dict[str, Any]:
    """A state dict of the model's own form (DTensors with its placements): floating
    values ``fill``, the integer counter 7."""
    return {
        key: (
            DTensor.from_local(
                torch.full_like(value.to_local(), fill), value.device_mesh, value.placements
            )
            if isinstance(value, DTensor)
            else torch.full_like(value, fill if value.is_floating_point() else 7)
        )
        for key, value in model.state_dict().items()
    }


def _bad_values(mesh: DeviceMesh) -> dict[str, tuple[Any, bool, str]]:
    """case -> (value for BAD_KEY, assign, torch's phrase in our message)."""
    local = torch.zeros(2, 4)  # rank 0's rows of a (4, 4) weight sharded over 2 ranks

    def sharded(tensor: torch.Tensor) -> DTensor:
        return DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False)

    return {
        "meta": (sharded(local.to("meta")), False, "Cannot copy out of meta tensor"),
        "list": ([[0.0] * 4] * 4, False, "expected torch.Tensor .* received <class 'list'>"),
        "int": (3, False, "expected torch.Tensor .* received <class 'int'>"),
        "uncastable_dtype": (
            sharded(torch.zeros(2, 4, dtype=torch.uint1)),
            False,
            "copy_.* not implemented for 'UInt1'",
        ),
        "assign_int": (
            sharded(local.to(torch.int64)),
            True,
            "Only Tensors of floating point and complex dtype can require gradients",
        ),
    }


@pytest.mark.parametrize("case", ["meta", "list", "int", "uncastable_dtype", "assign_int"])
def test_bad_value_loads_nothing_where_torch_half_loads(case: str) -> None:
    with fake_mesh(2) as mesh:
        value, assign, phrase = _bad_values(mesh)[case]
        results = {}
        for name, impl in (("torch", torch_fully_shard), ("ours", fully_shard)):
            model = _model(impl, mesh)
            before = _snapshot(model)
            state_dict = {**_sharded_like(model, 1.0), BAD_KEY: value}
            with pytest.raises(RuntimeError) as info:
                model.load_state_dict(state_dict, assign=assign)
            results[name] = (str(info.value), _changed(before, model))
    _, torch_changed = results["torch"]
    ours_message, ours_changed = results["ours"]
    assert torch_changed, "torch's fully_shard no longer half-loads: update the notes"
    assert ours_changed == [], f"changed before raising: {ours_changed}"
    assert "Error(s) in loading state_dict for Sequential (nothing was loaded)" in ours_message
    assert f"'{BAD_KEY}'" in ours_message
    assert re.search(phrase, ours_message), ours_message


def test_plain_values_checked_too() -> None:
    """Ours also takes plain full tensors (torch's does not): the same checks apply, and a
    DTensor for a plain buffer is refused instead of failing mid-copy."""
    with fake_mesh(2) as mesh:
        model = _model(fully_shard, mesh)
        before = _snapshot(model)
        full = {k: torch.ones(v.shape) for k, v in model.state_dict().items()}
        cases = {
            "2.weight": (torch.empty(4, 4, device="meta"), "Cannot copy out of meta tensor"),
            "0.bias": ("x", "received <class 'str'>"),
            "1.running_mean": (
                DTensor.from_local(torch.zeros(2), mesh, [Shard(0)], run_check=False),
                r"mixed torch.Tensor and DTensor\): pass value.full_tensor\(\)",
            ),
        }
        with pytest.raises(RuntimeError) as info:
            model.load_state_dict({**full, **{k: v for k, (v, _) in cases.items()}})
        assert _changed(before, model) == []
    for key, (_, phrase) in cases.items():  # every bad key is named, not only the first
        assert re.search(f"'{re.escape(key)}': .*{phrase}", str(info.value)), (key, info.value)


@pytest.mark.parametrize("form", ["sharded", "full"])
def test_nan_values_load(form: str) -> None:
    """Finiteness is not checked: a NaN checkpoint loads, as in torch."""
    with fake_mesh(2) as mesh:
        loaded = {}
        impls = (("torch", torch_fully_shard), ("ours", fully_shard))
        for name, impl in impls if form == "sharded" else impls[1:]:
            model = _model(impl, mesh)
            nan = _sharded_like(model, float("nan"))
            if form == "full":
                nan = {k: torch.full(v.shape, float("nan")) for k, v in model.state_dict().items()}
                nan["1.num_batches_tracked"] = torch.tensor(7)
            model.load_state_dict(nan)
            loaded[name] = _snapshot(model)
    for name, state in loaded.items():
        floats = {k: v for k, v in state.items() if v.is_floating_point()}
        assert floats and all(v.isnan().all() for v in floats.values()), name
        assert state["1.num_batches_tracked"].item() == 7, name


def test_load_with_assign_keeps_the_registered_parameters_for_the_optimizer() -> None:
    # load_state_dict(assign=True): both FSDPs train on the loaded values; torch
    # registers new Parameter objects, so an optimizer built before the load steps
    # parameters the model no longer uses; ours copies into the registered sharded
    # params, which stay the same objects (README, differences).
    with fake_mesh(2) as mesh:
        registered = {}
        for name, impl in (("torch", torch_fully_shard), ("ours", fully_shard)):
            model = _model(impl, mesh)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            before = dict(model.named_parameters())
            model.load_state_dict(_sharded_like(model, 0.5), assign=True)
            after = dict(model.named_parameters())
            assert all(
                torch.equal(_local(p), torch.full_like(_local(p), 0.5)) for p in after.values()
            ), name
            assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in after.values())
            model(torch.randn(3, 4)).sum().backward()
            in_optimizer = {id(p) for p in optimizer.param_groups[0]["params"]}
            registered[name] = {
                "same objects": [after[k] is before[k] for k in after],
                "optimizer steps them": [id(p) in in_optimizer for p in after.values()],
                "grads": [p.grad is not None for p in after.values()],
            }
        n = len(registered["ours"]["grads"])
        assert registered["ours"] == {
            "same objects": [True] * n, "optimizer steps them": [True] * n, "grads": [True] * n,
        }
        assert registered["torch"]["optimizer steps them"] == [False] * n
        assert registered["torch"]["grads"] == [True] * n
