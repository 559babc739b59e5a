"""``CommPrecisionPolicy`` validation and ``FSDPModule.set_comm_precision``'s argument check.

dtensor_fsdp only: torch has no quantized communication, so there is no torch behaviour
to compare with; the policy follows ``MixedPrecisionPolicy``'s conventions (a frozen
dataclass validated on construction), which the last tests check against torch's.
The communication itself is tested in tests/comm_precision/test_comm_precision.py.
"""

import dataclasses
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy

from dtensor_fsdp import CommPrecisionPolicy, FSDPModule, fully_shard
from dtensor_fsdp.runtime.comm_math import quantized_send_rows
from tests._harness import fake_mesh


def test_default_is_exact_communication() -> None:
    policy = CommPrecisionPolicy()
    assert policy.all_gather is None and policy.reduce_scatter is None
    assert policy.block_size == 256
    assert not policy.error_feedback and not policy.replicate_only


@pytest.mark.parametrize("fmt", [None, "bf16", "int8", "fp8_e4m3"])
def test_all_gather_formats(fmt: str | None) -> None:
    assert CommPrecisionPolicy(all_gather=fmt).all_gather == fmt


@pytest.mark.parametrize("fmt", [None, "bf16", "int8"])
def test_reduce_scatter_formats(fmt: str | None) -> None:
    assert CommPrecisionPolicy(reduce_scatter=fmt).reduce_scatter == fmt


@pytest.mark.parametrize(
    "field, value, allowed",
    [
        ("all_gather", "fp16", "None, 'bf16', 'int8' or 'fp8_e4m3'"),
        ("all_gather", "INT8", "None, 'bf16', 'int8' or 'fp8_e4m3'"),
        ("all_gather", torch.int8, "None, 'bf16', 'int8' or 'fp8_e4m3'"),
        # fp8 gradients are not offered: their 3 mantissa bits lose too much of a sum.
        ("reduce_scatter", "fp8_e4m3", "None, 'bf16' or 'int8'"),
        ("reduce_scatter", "int4", "None, 'bf16' or 'int8'"),
    ],
)
def test_unknown_format_names_the_allowed_ones(field: str, value: Any, allowed: str) -> None:
    with pytest.raises(ValueError) as info:
        CommPrecisionPolicy(**{field: value})
    message = str(info.value)
    assert f"CommPrecisionPolicy.{field}" in message
    assert allowed in message
    assert repr(value) in message


@pytest.mark.parametrize("block_size", [64.0, "256", True, None])
def test_block_size_not_an_int(block_size: Any) -> None:
    with pytest.raises(TypeError, match="block_size must be an int"):
        CommPrecisionPolicy(all_gather="int8", block_size=block_size)


@pytest.mark.parametrize("block_size", [0, -4, 2, 6, 258])
def test_block_size_not_a_positive_multiple_of_4(block_size: int) -> None:
    with pytest.raises(ValueError, match=f"positive multiple of 4, got {block_size}"):
        CommPrecisionPolicy(all_gather="int8", block_size=block_size)


@pytest.mark.parametrize("block_size", [4, 32, 128, 1024])
def test_block_size_multiple_of_4(block_size: int) -> None:
    assert (
        CommPrecisionPolicy(reduce_scatter="int8", block_size=block_size).block_size == block_size
    )


@pytest.mark.parametrize("all_gather", [None, "int8"])
def test_error_feedback_needs_a_reduce_scatter_format(all_gather: str | None) -> None:
    with pytest.raises(ValueError, match="it needs a reduce_scatter format"):
        CommPrecisionPolicy(all_gather=all_gather, error_feedback=True)
    assert CommPrecisionPolicy(reduce_scatter="int8", error_feedback=True).error_feedback


def test_error_feedback_does_not_cover_the_replicate_leg() -> None:
    # Only the shard-axis reduce-scatter keeps an error: with replicate_only it would
    # silently do nothing.
    with pytest.raises(ValueError, match="replicate_only=False"):
        CommPrecisionPolicy(reduce_scatter="int8", error_feedback=True, replicate_only=True)


@pytest.mark.parametrize(
    "fields",
    [
        {"replicate_only": True},  # no format for the all-reduce
        {"replicate_only": True, "all_gather": "int8"},
        {"replicate_only": True, "all_gather": "bf16", "reduce_scatter": "int8"},
    ],
)
def test_replicate_only_needs_reduce_scatter_and_no_all_gather(fields: dict) -> None:
    with pytest.raises(
        ValueError, match="replicate_only=True.*set reduce_scatter.*all_gather None"
    ):
        CommPrecisionPolicy(**fields)


def test_replicate_only_with_a_reduce_scatter_format() -> None:
    policy = CommPrecisionPolicy(reduce_scatter="bf16", replicate_only=True)
    assert policy.replicate_only and policy.all_gather is None


def test_frozen_like_torch_mixed_precision_policy() -> None:
    ours, theirs = CommPrecisionPolicy(all_gather="int8"), TorchMixedPrecisionPolicy()
    for policy, field in ((ours, "all_gather"), (theirs, "param_dtype")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(policy, field, None)
    # Hashable and compared by value, as torch's policy.
    assert ours == CommPrecisionPolicy(all_gather="int8") and hash(ours) == hash(
        CommPrecisionPolicy(all_gather="int8")
    )
    assert theirs == TorchMixedPrecisionPolicy()


def test_replace_validates_again() -> None:
    policy = CommPrecisionPolicy(all_gather="int8")
    assert dataclasses.replace(policy, block_size=64).block_size == 64
    with pytest.raises(ValueError, match="positive multiple of 4"):
        dataclasses.replace(policy, block_size=10)


def test_default_param_filter_selects_matrices() -> None:
    select = CommPrecisionPolicy().param_filter
    assert select("layers.0.weight", nn.Parameter(torch.empty(4, 3)))
    assert select("tok_embeddings.weight", nn.Parameter(torch.empty(10, 4)))
    assert select("conv.weight", nn.Parameter(torch.empty(2, 3, 3, 3)))
    assert not select("layers.0.bias", nn.Parameter(torch.empty(4)))
    assert not select("norm.weight", nn.Parameter(torch.empty(4)))
    assert not select("scalar", nn.Parameter(torch.empty(())))


def test_custom_param_filter_is_kept() -> None:
    def only_attention(fqn: str, param: nn.Parameter) -> bool:
        return "attention" in fqn

    assert CommPrecisionPolicy(all_gather="int8", param_filter=only_attention).param_filter is (
        only_attention
    )


@pytest.mark.parametrize("bad", ["int8", {"all_gather": "int8"}, TorchMixedPrecisionPolicy(), 8])
def test_set_comm_precision_rejects_other_types(bad: Any) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with fake_mesh(2) as mesh:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model, FSDPModule)
        with pytest.raises(TypeError, match="expects a CommPrecisionPolicy or None, got"):
            model.set_comm_precision(bad)
        with pytest.raises(TypeError, match="expects a CommPrecisionPolicy or None"):
            model[0].set_comm_precision(bad, recurse=False)


def test_set_comm_precision_accepts_a_policy_and_none() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with fake_mesh(2) as mesh:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        model.set_comm_precision(CommPrecisionPolicy(all_gather="int8", reduce_scatter="int8"))
        model[0].set_comm_precision(None)
        model.set_comm_precision(None, recurse=False)


def test_set_comm_precision_between_forward_and_backward_raises() -> None:
    """The backward all-gather of a group kept unsharded (or hpZ-resharded) after
    forward must read the layout its forward wrote: changing the policy in between is
    refused, and allowed again once the iteration is over."""
    with fake_mesh(2) as mesh:
        torch.manual_seed(0)
        model = fully_shard(nn.Linear(8, 8), mesh=mesh, reshard_after_forward=False)
        loss = model(torch.randn(2, 8)).sum()
        with pytest.raises(RuntimeError, match="between its forward and its backward"):
            model.set_comm_precision(CommPrecisionPolicy(all_gather="int8"))
        loss.backward()
        model.set_comm_precision(CommPrecisionPolicy(all_gather="int8"))


def test_error_feedback_drops_the_error_of_a_non_finite_block() -> None:
    """A block with an inf decodes to non-finite values; its error must not be carried
    into later steps (it would poison the block for good), while the other blocks keep
    theirs. The residual is computed before the collective (comm_math.py): no group."""
    grad = torch.randn(4, 8)  # 2 rows per rank: blocks of 4 elements, 4 per chunk
    grad[0, 0] = float("inf")
    residual = torch.zeros(2, 16)
    quantized_send_rows([grad], [True], torch.float32, 1.0, 2, "int8", 4, [residual])
    assert torch.isfinite(residual).all()
    assert torch.equal(residual[0, :4], torch.zeros(4)), "the inf block's error is dropped"
    assert residual[0, 4:].abs().sum() > 0 and residual[1].abs().sum() > 0
