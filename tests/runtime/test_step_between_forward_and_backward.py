"""An optimizer step between a forward and its backward (in one process, torch's fake
process group): plain PyTorch raises at the backward, from the version counters
autograd saved; torch's FSDP2 computes the gradients silently, mixing the values before
and after the step; ours raises plain PyTorch's error at the backward, naming the
parameters, for every kind of step: per-tensor (it bumps the DTensor's version
counter), foreach and fused (they bump none: FSDP sees the step through torch's global
optimizer step hook) and ``step_on_local_shards`` (it bumps the local tensor's).
A fused step bumps no version counter of a plain tensor either: plain PyTorch is silent
there, ours raises. A step that leaves the awaiting params unchanged (they have no
gradient, so ``torch.optim`` skips them: a GAN's one optimizer over both models) raises
nowhere, as in plain PyTorch and torch's FSDP2 (its numerics against torch's on gloo:
tests/observe/test_no_false_alarm.py).
"""

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from dtensor_fsdp.optim import step_on_local_shards
from tests._harness import fake_mesh

PHRASE = "modified by an inplace operation"


def _on_local_shards(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    step_on_local_shards(optimizer)
    return optimizer


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, foreach=False),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.1),  # the default on CPU
    # The default on an accelerator: no version counter of a DTensor param is bumped.
    "sgd-foreach": lambda params: torch.optim.SGD(params, lr=0.1, foreach=True),
    "adamw-foreach": lambda params: torch.optim.AdamW(params, lr=0.1, foreach=True),
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=0.1, fused=True),  # CPU too
    "adamw-local-shards": lambda params: _on_local_shards(
        torch.optim.AdamW(params, lr=0.1, foreach=True)
    ),
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
    if optimizer_name == "adamw-fused":  # its kernel bumps no version counter at all
        _step_between_forward_and_backward(_model(), optimizer_name)  # plain: silent too
    elif "local-shards" not in optimizer_name:  # it needs DTensor params
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
    seen_by_hook = {"sgd-foreach": "SGD", "adamw-foreach": "AdamW", "adamw-fused": "AdamW"}
    if optimizer_name in seen_by_hook:  # no version counter: the optimizer hook saw it
        assert f"({seen_by_hook[optimizer_name]}.step() ran)" in str(error.value)


def _train(model: nn.Module, optim: torch.optim.Optimizer, pattern: str) -> None:
    """Usual loops, each with its optimizer step where it belongs."""
    x = torch.randn(4, 8)
    for _ in range(2):
        if pattern == "step-after-backward":
            model(x).sum().backward()
        elif pattern == "no-sync-micro-batches":
            for micro_batch in range(3):
                model.set_requires_gradient_sync(micro_batch == 2)
                model(x).sum().backward()
        elif pattern == "two-forwards-one-backward":
            (model(x).sum() + model(2 * x).sum()).backward()
        elif pattern == "eval-then-step":
            model(x).sum().backward()
            with torch.no_grad():
                model(x)
        optim.step()
        optim.zero_grad()


@pytest.mark.parametrize(
    "pattern",
    [
        "step-after-backward",
        "no-sync-micro-batches",
        "two-forwards-one-backward",
        "eval-then-step",
    ],
)
@pytest.mark.parametrize("optimizer_name", ["adamw", "adamw-foreach", "adamw-local-shards"])
def test_step_after_backward_raises_nothing(pattern: str, optimizer_name: str) -> None:
    """No error, as with torch's FSDP2 (the fake process group's values are garbage:
    only the behaviour is compared; the numerics of these loops are tested on gloo)."""
    with fake_mesh(2) as mesh:
        for shard in (torch_fully_shard, fully_shard):
            model = _shard(_model(), shard, mesh, reshard_after_forward=True)
            name = optimizer_name
            if shard is torch_fully_shard:  # step_on_local_shards is ours
                name = optimizer_name.replace("-local-shards", "-foreach")
            _train(model, OPTIMIZERS[name](model.parameters()), pattern)


def test_step_of_other_params_is_not_an_error() -> None:
    """An optimizer over other parameters (a second model) may step in between."""
    with fake_mesh(2) as mesh:
        model = _shard(_model(), fully_shard, mesh, reshard_after_forward=True)
        other = nn.Linear(2, 2)
        other(torch.randn(1, 2)).sum().backward()
        other_optim = torch.optim.AdamW(other.parameters(), lr=0.1, foreach=True)
        loss = model(torch.randn(4, 8)).sum()
        other_optim.step()
        loss.backward()


def _gan(shard, mesh) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    discriminator = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    if shard is not None:
        for model in (generator, discriminator):
            shard(model[0], mesh=mesh)
            shard(model[2], mesh=mesh)
            shard(model, mesh=mesh)
    return generator, discriminator


def _dcgan_steps(generator: nn.Module, discriminator: nn.Module, name: str, set_to_none: bool):
    """DCGAN's loop with one optimizer over both models' param groups: the
    discriminator's step runs while the generator's forward awaits its backward."""
    optim = OPTIMIZERS[name](
        [{"params": generator.parameters()}, {"params": discriminator.parameters(), "lr": 0.05}]
    )
    real = torch.randn(4, 8)
    for _ in range(2):
        fake = generator(torch.randn(4, 8))
        optim.zero_grad(set_to_none=set_to_none)
        (discriminator(fake.detach()).mean() - discriminator(real).mean()).backward()
        optim.step()  # the generator's grads: None (skipped), or zeros (stepped)
        optim.zero_grad(set_to_none=set_to_none)
        (-discriminator(fake).mean()).backward()  # the generator's backward
        optim.step()


GAN_OPTIMIZERS = ["adamw", "adamw-foreach", "adamw-fused", "sgd-foreach"]


@pytest.mark.parametrize("optimizer_name", GAN_OPTIMIZERS)
def test_a_step_that_skips_the_awaiting_params_raises_nothing(optimizer_name: str) -> None:
    _dcgan_steps(*_gan(None, None), optimizer_name, set_to_none=True)  # plain PyTorch
    with fake_mesh(2) as mesh:
        for shard in (torch_fully_shard, fully_shard):
            _dcgan_steps(*_gan(shard, mesh), optimizer_name, set_to_none=True)


@pytest.mark.parametrize("optimizer_name", GAN_OPTIMIZERS)
def test_a_step_that_changes_the_awaiting_params_raises(optimizer_name: str) -> None:
    """With zeroed (not None) grads the step updates the generator too (weight decay,
    momentum): a real step between its forward and backward."""
    if optimizer_name in ("adamw", "sgd-foreach"):  # plain PyTorch sees the per-tensor write
        with pytest.raises(RuntimeError, match=PHRASE):
            _dcgan_steps(*_gan(None, None), optimizer_name, set_to_none=False)
    with fake_mesh(2) as mesh, pytest.raises(RuntimeError, match=PHRASE) as error:
        _dcgan_steps(*_gan(fully_shard, mesh), optimizer_name, set_to_none=False)
    assert "the sharded parameters ['2.weight', '2.bias'] of '2' changed" in str(error.value)
