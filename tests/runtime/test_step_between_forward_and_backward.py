"""An optimizer step between a forward and its backward (in one process, torch's fake
process group): plain PyTorch raises at the backward, from the version counters
autograd saved; torch's FSDP2 computes the gradients silently, mixing the values before
and after the step; ours raises plain PyTorch's error at the backward, naming the
parameters. A foreach or fused step bumps no version counter of a DTensor and is not
seen (docs/differences.md).
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from tests._harness import fake_mesh

PHRASE = "modified by an inplace operation"
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, foreach=False),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1),  # the default on CPU
}


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))


def _step_between_forward_and_backward(model: nn.Module, optimizer_name: str) -> None:
    optim = OPTIMIZERS[optimizer_name](model.parameters())
    x = torch.randn(4, 8)
    model(x).sum().backward()  # grads to step with
    loss = model(x).sum()
    optim.step()  # the misuse: the forward above computed with the old values
    loss.backward()


def _shard(model: nn.Sequential, shard, mesh, reshard_after_forward: bool) -> nn.Sequential:
    # The root holds no parameter: each Linear's group is resharded after forward and
    # all-gathered again in backward, or kept unsharded, as ``reshard_after_forward``.
    for index in (0, 2, 4):
        shard(model[index], mesh=mesh, reshard_after_forward=reshard_after_forward)
    shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("reshard_after_forward", [True, False], ids=["reshard", "keep"])
def test_ours_raises_plain_pytorchs_error(optimizer_name: str, reshard_after_forward: bool) -> None:
    with pytest.raises(RuntimeError, match=PHRASE):
        _step_between_forward_and_backward(_model(), optimizer_name)
    with fake_mesh(2) as mesh:
        theirs = _shard(_model(), torch_fully_shard, mesh, reshard_after_forward)
        _step_between_forward_and_backward(theirs, optimizer_name)  # silent
        ours = _shard(_model(), fully_shard, mesh, reshard_after_forward)
        with pytest.raises(RuntimeError, match=PHRASE) as error:
            _step_between_forward_and_backward(ours, optimizer_name)
    # The first group in backward, the head, raises.
    assert "the sharded parameters ['4.weight', '4.bias'] of '4' changed between its " in str(
        error.value
    )
    assert "call backward before updating the parameters" in str(error.value)


def test_no_step_between_trains_as_before() -> None:
    with fake_mesh(2) as mesh:
        model = _shard(_model(), fully_shard, mesh, reshard_after_forward=True)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            optim.step()
            optim.zero_grad()
