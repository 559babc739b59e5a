"""Misuse of the communication setters (share_comm_ctx, set_reduce_scatter_max_input_buffers,
set_custom_all_gather/reduce_scatter, set_all_reduce_hook's stream) raises torch's
exception with torch's key phrase."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx

from dtensor_fsdp import (
    AllGather,
    ReduceScatter,
    fully_shard,
    share_comm_ctx,
)
from tests._harness import fake_mesh
from tests._rejected import _mlp

# share_comm_ctx #


@pytest.mark.parametrize("which", ["plain_module", "string"])
def test_share_comm_ctx_refuses_what_is_not_an_fsdp_module(which: str) -> None:
    with fake_mesh(2) as mesh:
        impls = ((fully_shard, share_comm_ctx), (torch_fully_shard, torch_share_comm_ctx))
        for impl, share in impls:
            root = impl(_mlp(), mesh=mesh)
            bad = nn.Linear(2, 2) if which == "plain_module" else "model"
            share([])  # nothing to share: fine in both
            share([root])
            with pytest.raises(ValueError, match="Expects list of FSDPModules"):
                share([root, bad])


# set_reduce_scatter_max_input_buffers #


@pytest.mark.parametrize(
    "bad, error, phrase",
    [
        (True, TypeError, "max_input_buffers must be an int, got bool"),
        (2.0, TypeError, "max_input_buffers must be an int, got float"),
        (0, ValueError, "max_input_buffers must be a positive int, got 0"),
        (-1, ValueError, "max_input_buffers must be a positive int, got -1"),
    ],
)
def test_reduce_scatter_max_input_buffers_refuses_what_torch_refuses(
    bad: Any, error: type, phrase: str
) -> None:
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            root = impl(_mlp(), mesh=mesh)
            with pytest.raises(error, match=phrase):
                root.set_reduce_scatter_max_input_buffers(bad)


# Communication setters #


class _NoAllGather(AllGather):
    """A custom all-gather that is never called: only set_* calls are under test."""

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        raise AssertionError("not called in these tests")


class _NoReduceScatter(ReduceScatter):
    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        raise AssertionError("not called in these tests")


def _custom_all_gather(root: nn.Module) -> None:
    root.set_custom_all_gather(_NoAllGather())


def _custom_reduce_scatter(root: nn.Module) -> None:
    root.set_custom_reduce_scatter(_NoReduceScatter())


SETTER_MISUSES: dict[str, tuple[Callable[[nn.Module], None] | None, Callable, type, str]] = {
    # name: (set up first, the call, torch's exception type, torch's key phrase)
    "allocate_after_a_custom_all_gather": (
        _custom_all_gather,
        lambda root: root.set_allocate_memory_from_process_group_for_comm(True),
        AssertionError,
        "cannot call set_allocate_memory_from_process_group() when all gather comm is "
        "custom: _NoAllGather",
    ),
    "allocate_after_a_custom_reduce_scatter": (
        _custom_reduce_scatter,
        lambda root: root.set_allocate_memory_from_process_group_for_comm(False),
        AssertionError,
        "cannot call set_allocate_memory_from_process_group() when reduce scatter comm is "
        "custom: _NoReduceScatter",
    ),
    "symm_mem_after_a_custom_all_gather": (
        _custom_all_gather,
        lambda root: root.set_symm_mem_for_comm(),
        AssertionError,
        "cannot call set_symm_mem() when all gather comm is custom: _NoAllGather",
    ),
    "symm_mem_unknown_backend": (
        None,
        lambda root: root.set_symm_mem_for_comm("GLOO"),
        RuntimeError,
        "SymmetricMemory does not find allocation backend GLOO",
    ),
}


@pytest.mark.parametrize("name", list(SETTER_MISUSES))
def test_comm_setter_misuse_raises_torchs_exception_and_key_phrase(name: str) -> None:
    set_up, call, torch_error, phrase = SETTER_MISUSES[name]
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            root = impl(_mlp(), mesh=mesh)
            if set_up is not None:
                set_up(root)
            with pytest.raises(torch_error) as raised:
                call(root)
            assert phrase in str(raised.value), f"{impl.__module__}: {raised.value}"
            if impl is fully_shard:
                assert isinstance(raised.value, ValueError)  # a user mistake, too


def test_all_reduce_hook_stream_is_refused_for_native_hsdp() -> None:
    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("r", "s"))
        for impl in (torch_fully_shard, fully_shard):
            root = impl(_mlp(), mesh=mesh)
            with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
                root.set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream())
        # Without a stream the hook is accepted on HSDP (it runs after the all-reduce).
        root.set_all_reduce_hook(lambda t: None)


def test_all_reduce_hook_stream_without_a_hook() -> None:
    phrase = "all reduce hook stream is specified but hook itself is missing"
    with fake_mesh(2) as mesh:
        # torch accepts the call and raises at the first backward; ours at the call.
        theirs = torch_fully_shard(_mlp(), mesh=mesh)
        theirs.set_all_reduce_hook(None, stream=torch.cpu.Stream())
        with pytest.raises(AssertionError, match=phrase):
            theirs(torch.randn(2, 4)).sum().backward()
        ours = fully_shard(_mlp(), mesh=mesh)
        with pytest.raises(AssertionError, match=phrase):
            ours.set_all_reduce_hook(None, stream=torch.cpu.Stream())
        ours(torch.randn(2, 4)).sum().backward()  # nothing was set
