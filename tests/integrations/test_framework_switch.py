"""``use_dtensor_fsdp()`` itself (dtensor_fsdp/integrations/frameworks.py), in one
process on torch's fake process group: what a framework sees of our modules through
torch's names, the clear errors for torch's private parts, and that the switch is
idempotent and reversible. The frameworks themselves: test_fabric.py,
test_hf_trainer.py."""

import copy
import pickle
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard._fully_shard as torch_fully_shard_module
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import dtensor_fsdp
from dtensor_fsdp.integrations import use_dtensor_fsdp
from dtensor_fsdp.integrations.frameworks import TorchOnlyMethodError
from tests._harness import fake_mesh


def torchs_fully_shard() -> Callable[..., Any]:
    """torch's own fully_shard, from the module that defines it, which the switch
    leaves alone: it replaces every other module-level binding of it, a constant of
    this file included."""
    return torch_fully_shard_module.fully_shard


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh(2) as mesh:
        yield mesh


@pytest.fixture
def switched() -> Iterator[None]:
    with use_dtensor_fsdp():
        yield


def test_ours_pass_torchs_isinstance_and_keep_our_methods(mesh, switched):
    model = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    assert isinstance(model, dtensor_fsdp.FSDPModule)
    assert isinstance(model, torch_fsdp.FSDPModule)
    # Ours first, then the original class at index 2 (our __new__ and load_state_dict
    # read it there, as torch's does), torch's class after it.
    mro = type(model).__mro__
    assert mro[1:3] == (dtensor_fsdp.FSDPModule, nn.Linear)
    assert mro.index(torch_fsdp.FSDPModule) > mro.index(nn.Module)
    assert type(model).reshard is dtensor_fsdp.FSDPModule.reshard


def test_undo_leaves_new_modules_plain(mesh):
    with use_dtensor_fsdp():
        before = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    after = dtensor_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    assert isinstance(before, torch_fsdp.FSDPModule)
    assert not isinstance(after, torch_fsdp.FSDPModule)
    assert torch_fsdp.fully_shard is torchs_fully_shard()


@pytest.mark.parametrize("name", ["_set_unshard_async_op"])
def test_torch_only_methods_raise_naming_the_call(mesh, switched, name):
    if not hasattr(torch_fsdp.FSDPModule, name):
        pytest.skip(f"this torch has no FSDPModule.{name}")
    model = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(NotImplementedError, match=rf"FSDPLinear\.{name}\(\) is a private method"):
        getattr(model, name)(True)


def test_every_torch_method_is_ours_or_refused(mesh, switched):
    model = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    for name, value in vars(torch_fsdp.FSDPModule).items():
        if not callable(value) or name.startswith("__"):
            continue
        resolved = getattr(type(model), name)
        refused = getattr(resolved, "__qualname__", "").endswith("_refuse.<locals>.refused")
        assert hasattr(dtensor_fsdp.FSDPModule, name) or refused, name


def test_torch_private_state_raises_naming_the_call(mesh, switched):
    model = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh)
    with pytest.raises(TorchOnlyMethodError, match=r"fully_shard\.state\(FSDPLinear\)"):
        torch_fsdp.fully_shard.state(model)
    # Frameworks reach torch's state's private fields: a named AttributeError, not
    # torch's code on our state (the few FSDPMemTracker reads have our meaning:
    # tests/integrations/test_fsdp_mem_tracker.py).
    with pytest.raises(AttributeError, match=r"no attribute '_state_ctx'.*_get_fsdp_state"):
        _ = model._get_fsdp_state()._state_ctx


def test_deepcopy_pickle_and_new_as_without_the_switch(mesh):
    def behaviour(model: nn.Module) -> tuple[type, type, type]:
        errors = []
        for action in (copy.deepcopy, pickle.dumps):
            with pytest.raises(Exception) as caught:
                action(model)
            errors.append(caught.type)
        # Constructing an FSDP class builds the original module, as in torch.
        return (*errors, type(type(model)(3, 5)))

    theirs = behaviour(torchs_fully_shard()(nn.Linear(4, 4), mesh=mesh))
    plain = behaviour(dtensor_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh))
    with use_dtensor_fsdp():
        switched = behaviour(torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh))
    assert switched == plain == theirs == (AssertionError, pickle.PicklingError, nn.Linear)


def test_torch_policies_become_ours(mesh, switched):
    policy = torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    model = torch_fsdp.fully_shard(nn.Linear(4, 4), mesh=mesh, mp_policy=policy)
    assert isinstance(model, dtensor_fsdp.FSDPModule)
    assert model(torch.randn(2, 4)).dtype == torch.bfloat16


def test_idempotent_and_reversible_for_bound_names():
    theirs = torchs_fully_shard()
    framework = ModuleType("a_framework")  # binds torch's names at import, aliased too
    framework.fully_shard = theirs
    framework.fsdp2 = theirs
    sys.modules[framework.__name__] = framework
    try:
        first = use_dtensor_fsdp()
        ours = torch_fsdp.fully_shard
        assert ours is not theirs
        assert framework.fully_shard is ours and framework.fsdp2 is ours
        switched = torch_fsdp.register_fsdp_forward_method
        assert switched.__wrapped__ is dtensor_fsdp.register_fsdp_forward_method
        second = use_dtensor_fsdp()  # already on: changes nothing
        assert torch_fsdp.fully_shard is ours
        second.undo()
        assert torch_fsdp.fully_shard is ours  # the first call's switch still holds
        first.undo()
        first.undo()
        assert framework.fully_shard is theirs and framework.fsdp2 is theirs
        assert torch_fsdp.fully_shard is theirs
    finally:
        del sys.modules[framework.__name__]


def test_undo_reaches_modules_imported_while_on():
    """A module imported while the switch was on bound ours by name (``from
    torch.distributed.fsdp import fully_shard``): undo gives it torch's back, and leaves
    a name bound to dtensor_fsdp's own functions alone."""
    theirs = torchs_fully_shard()
    framework = ModuleType("a_framework_imported_late")
    sys.modules[framework.__name__] = framework
    try:
        with use_dtensor_fsdp():
            framework.fully_shard = torch_fsdp.fully_shard  # its import, while on
            framework.forward_method = torch_fsdp.register_fsdp_forward_method
            framework.share = torch_fsdp.share_comm_ctx
            framework.ours = dtensor_fsdp.register_fsdp_forward_method  # imported from us
            assert framework.fully_shard is not theirs
        assert framework.fully_shard is theirs
        assert framework.forward_method is torch_fully_shard_module.register_fsdp_forward_method
        assert framework.share is torch_fully_shard_module.share_comm_ctx
        assert framework.ours is dtensor_fsdp.register_fsdp_forward_method
    finally:
        del sys.modules[framework.__name__]


def test_transformers_bound_name_is_replaced():
    tfsdp = pytest.importorskip("transformers.distributed.fsdp", reason="transformers missing")
    assert tfsdp.fully_shard is torchs_fully_shard()
    with use_dtensor_fsdp():
        assert tfsdp.fully_shard is torch_fsdp.fully_shard is not torchs_fully_shard()
    assert tfsdp.fully_shard is torchs_fully_shard()
