"""A sharded parameter replaced after fully_shard that cannot be adopted is refused at lazy
init, before anything is adopted; what can be is adopted (in one process)."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_fsdp import (
    fully_shard,
)
from tests._harness import fake_mesh
from tests._rejected import _mlp

# A sharded parameter replaced after fully_shard #
#
# torch's FSDP2 adopts a replacing nn.Parameter(DTensor) with the sharded param's layout
# at lazy init, and so do we (tests/runtime/test_replaced_param.py). What cannot be adopted
# torch fails on inside its padding code (an AttributeError or a RuntimeError), or, for
# a tie made after fully_shard, accepts: it then all-gathers the tied values twice, with
# a wrong result when the shard is padded. Ours refuses each with a ValueError at lazy
# init that says what the replacement must be, before adopting anything.


def _replace_with_plain(model: nn.Module, mesh: DeviceMesh) -> None:
    model[0].bias = nn.Parameter(torch.zeros(6))


def _replace_with_replicate(model: nn.Module, mesh: DeviceMesh) -> None:
    model[0].bias = nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Replicate()]))


def _replace_with_other_shape(model: nn.Module, mesh: DeviceMesh) -> None:
    model[0].bias = nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)]))


def _tie(model: nn.Module, mesh: DeviceMesh) -> None:
    model[2].weight = model[0].weight


def _square_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


REPLACEMENTS: dict[str, tuple[Callable[[], nn.Module], bool, Callable[..., None], Any, str]] = {
    # name: (model, shard model[0] on its own, replacement, torch's outcome, our phrase)
    "plain_parameter": (
        _mlp, False, _replace_with_plain, AttributeError,
        "'0.bias' was replaced after fully_shard by a Parameter, not an nn.Parameter "
        "wrapping a DTensor",
    ),
    "replicated_dtensor": (
        _mlp, False, _replace_with_replicate, RuntimeError,
        "'0.bias' was replaced after fully_shard by a DTensor of global shape \\(6,\\), "
        "local shape \\(6,\\), placements \\(Replicate\\(\\),\\).*local shape \\(3,\\), "
        "placements \\(Shard\\(dim=0\\),\\)",
    ),
    "other_global_shape": (
        _mlp, False, _replace_with_other_shape, RuntimeError,
        "'0.bias' was replaced after fully_shard by a DTensor of global shape \\(8,\\).*"
        "global shape \\(6,\\)",
    ),
    "tie_within_a_group": (
        _square_mlp, False, _tie, None,
        "'2.weight' was replaced after fully_shard by the sharded parameter '0.weight' "
        "\\(a tie made after fully_shard\\). Tie parameters before fully_shard",
    ),
    "tie_across_groups": (
        _square_mlp, True, _tie, None,
        "'2.weight' was replaced after fully_shard by the sharded parameter '0.weight'",
    ),
}


@pytest.mark.parametrize("name", list(REPLACEMENTS))
def test_replaced_parameter_that_cannot_be_adopted(name: str) -> None:
    build, nested, replace, torch_outcome, phrase = REPLACEMENTS[name]
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        models = {}
        for impl in (torch_fully_shard, fully_shard):
            model = build()
            if nested:
                impl(model[0], mesh=mesh)
            models[impl] = impl(model, mesh=mesh)
            replace(model, mesh)
        theirs = None
        try:
            models[torch_fully_shard](inp)
        except Exception as error:
            theirs = type(error)
        assert theirs is torch_outcome, f"torch's premise: {theirs}"
        model = models[fully_shard]
        registered = [m._parameters.copy() for m in model.modules()]
        sharded = [
            p.sharded_param for s in model._fsdp_states(True) for p in s.fsdp_params()
        ]
        with pytest.raises(ValueError, match=phrase):
            model(inp)
        # Nothing adopted: the user's replacement is still registered, FSDP's own
        # sharded params are unchanged, and no state became a root.
        assert [m._parameters.copy() for m in model.modules()] == registered
        states = model._fsdp_states(True)
        assert [p.sharded_param for s in states for p in s.fsdp_params()] == sharded
        assert all(s.ctx is None for s in states)


def test_replaced_parameter_with_the_sharded_layout_is_adopted_after_a_refusal() -> None:
    """The fix the message names: an nn.Parameter(DTensor) with the sharded layout."""
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        model = fully_shard(_mlp(), mesh=mesh)
        _replace_with_replicate(model, mesh)
        with pytest.raises(ValueError, match="was replaced after fully_shard"):
            model(inp)
        fixed = nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Shard(0)]))
        model[0].bias = fixed
        model(inp).sum().backward()
        assert model[0].bias is fixed and fixed.grad is not None


def test_tie_across_groups_made_after_lazy_init_is_refused() -> None:
    """The same tie as ``tie_across_groups``, made after the first step: torch's accepts
    it (and all-gathers the tied values in both groups); ours refuses it at the next
    all-gather, naming the owner, as at lazy init."""
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            model = _square_mlp()
            impl(model[0], mesh=mesh)
            impl(model, mesh=mesh)
            model(inp).sum().backward()
            _tie(model, mesh)
            if impl is torch_fully_shard:
                model(inp).sum().backward()  # torch's premise: accepted
                continue
            with pytest.raises(ValueError, match="'2.weight' was replaced after fully_shard "
                               "by the sharded parameter '0.weight'"):
                model(inp)


def test_parameter_replaced_while_kept_unsharded_is_adopted() -> None:
    """After a no_grad forward the root keeps its unsharded params (as torch's). A
    sharded-layout replacement registered then is adopted at the next forward; torch's
    computes with it beside its own unsharded params and fails."""
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            model = _square_mlp()
            impl(model[0], mesh=mesh)
            impl(model, mesh=mesh)
            with torch.no_grad():
                model(inp)
            fixed = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
            model[2].weight = fixed
            if impl is torch_fully_shard:
                with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                    model(inp)
                continue
            model(inp).sum().backward()
            assert model[2].weight is fixed and fixed.grad is not None
            assert torch.equal(fixed.to_local(), torch.ones(2, 4))
