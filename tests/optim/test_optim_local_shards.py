"""``step_on_local_shards`` in one process, on torch's ``fake`` process group.

An element-wise step needs no collective, so a rank of a fake W=4 mesh steps its
shards for real: the params of a model sharded by torch's ``fully_shard`` and by ours
get the same (seeded) grads, and three runs must end bitwise equal, params and
optimizer state: torch's ``fully_shard`` + ``torch.optim`` (the reference), ours +
``torch.optim`` on the DTensors, and ours + the local-shard step. Fake rank 2 holds
uneven shards (2 of 6 rows, 1 of 3); fake rank 3 holds empty ones. The multi-rank
training parity (losses, checkpoints, GradScaler, CPU offload) is in
tests/optim/test_optim_local_shards_gloo.py.
"""

import inspect
import warnings
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from dtensor_fsdp import fully_shard
from dtensor_fsdp.optim import ELEMENTWISE_OPTIMIZERS, LocalShardStep, step_on_local_shards
from tests._harness import fake_mesh
from tests.optim._optim_cases import CASES, Lion

WORLD_SIZE = 4
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.LayerNorm(6), nn.Linear(6, 3))


def _sharded(mesh: DeviceMesh, shard: Callable[..., object] = fully_shard) -> nn.Module:
    model = _model()
    for layer in model:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def _set_grads(model: nn.Module, step: int) -> None:
    """The same grads, by param order, for every model: random local tensors."""
    generator = torch.Generator().manual_seed(step)
    for p in model.parameters():
        local = torch.randn(p.to_local().shape, generator=generator)
        p.grad = DTensor.from_local(
            local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
        )


def _train(model: nn.Module, case: str, local: bool, steps: int = STEPS) -> torch.optim.Optimizer:
    optimizer, scheduler = CASES[case].build(model.named_parameters())
    if local:
        step_on_local_shards(optimizer, elementwise=CASES[case].elementwise)
    for step in range(steps):
        _set_grads(model, step)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    return optimizer


def _assert_same_state(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    """``state_dict()`` equal in structure (keys, types, DTensor placements, shapes,
    strides) and bitwise in value."""
    a, b = ours.state_dict(), theirs.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert list(a["state"]) == list(b["state"])
    for index, state in b["state"].items():
        assert list(a["state"][index]) == list(state), index
        for name, expected in state.items():
            value = a["state"][index][name]
            assert type(value) is type(expected), (index, name)
            if isinstance(expected, DTensor):
                assert (value.placements, value.shape, value.stride()) == (
                    expected.placements,
                    expected.shape,
                    expected.stride(),
                ), (index, name)
                assert value.device_mesh == expected.device_mesh
                value, expected = value.to_local(), expected.to_local()
            if isinstance(expected, torch.Tensor):
                assert torch.equal(value, expected), (index, name)
            else:
                assert value == expected, (index, name)


def _assert_same_params(ours: nn.Module, theirs: nn.Module) -> None:
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert a.placements == b.placements, name
        assert torch.equal(a.to_local(), b.to_local()), name


def _ids(tensors) -> list[int]:
    return [id(t) for t in tensors]


@pytest.fixture
def mesh() -> Iterator[DeviceMesh]:
    with fake_mesh(WORLD_SIZE, rank=2) as mesh:
        yield mesh


# Parity #


def _train_plain(sharded: nn.Module, case: str) -> list[nn.Parameter]:
    """torch.optim on plain copies of ``sharded``'s local shards, with the same grads:
    the unsharded reference of an element-wise step."""
    named = [
        (n, nn.Parameter(p.to_local().detach().clone())) for n, p in sharded.named_parameters()
    ]
    params = [p for _, p in named]
    optimizer, scheduler = CASES[case].build(named)
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad()
    return params


@pytest.mark.parametrize("case", sorted(CASES))
def test_bitwise_equal_to_dtensor_step_and_torch(mesh: DeviceMesh, case: str) -> None:
    on_locals = _sharded(mesh)
    plain_params = _train_plain(on_locals, case)
    local_optimizer = _train(on_locals, case, local=True)
    for (name, p), expected in zip(on_locals.named_parameters(), plain_params, strict=True):
        assert torch.equal(p.to_local(), expected), name
    # Between steps the optimizer holds the DTensor params, as torch.optim does.
    grouped = [p for g in local_optimizer.param_groups for p in g["params"]]
    assert sorted(map(id, grouped)) == sorted(map(id, on_locals.parameters()))

    reference = _sharded(mesh, torch_fully_shard)
    try:
        reference_optimizer = _train(reference, case, local=False)
    except RuntimeError as error:
        # torch's step on DTensors fails for some (Rprop: a masked index_put_ that
        # DTensor cannot shard); the local step works, as checked above.
        assert "Sharding propagation failed" in str(error)
        return
    on_dtensors = _sharded(mesh)
    dtensor_optimizer = _train(on_dtensors, case, local=False)
    _assert_same_params(on_dtensors, reference)
    _assert_same_params(on_locals, reference)
    _assert_same_state(dtensor_optimizer, reference_optimizer)
    _assert_same_state(local_optimizer, reference_optimizer)


def test_empty_local_shards() -> None:
    """Fake rank 3 of 4 holds no row of the 6- and 3-row weights."""
    with fake_mesh(WORLD_SIZE, rank=3) as mesh:
        reference = _sharded(mesh, torch_fully_shard)
        reference_optimizer = _train(reference, "adamw_foreach", local=False)
        ours = _sharded(mesh)
        optimizer = _train(ours, "adamw_foreach", local=True)
        assert ours[2].weight.to_local().numel() == 0
        _assert_same_params(ours, reference)
        _assert_same_state(optimizer, reference_optimizer)


def test_plain_params_pass_through(mesh: DeviceMesh) -> None:
    """A plain param in the same group (where torch's foreach refuses the mix of
    DTensor and Tensor) is stepped as a plain AdamW steps it alone."""
    model = _sharded(mesh)
    extra = nn.Parameter(torch.randn(5))
    alone = nn.Parameter(extra.detach().clone())
    optimizer = torch.optim.AdamW([*model.parameters(), extra], lr=1e-2, foreach=True)
    step_on_local_shards(optimizer)
    reference = torch.optim.AdamW([alone], lr=1e-2, foreach=True)
    for step in range(STEPS):
        _set_grads(model, step)
        extra.grad = alone.grad = torch.full((5,), float(step + 1))
        optimizer.step()
        reference.step()
    assert torch.equal(extra, alone)
    assert type(optimizer.state[extra]["exp_avg"]) is torch.Tensor
    assert torch.equal(optimizer.state[extra]["exp_avg"], reference.state[alone]["exp_avg"])


def test_params_without_grad_get_no_state(mesh: DeviceMesh) -> None:
    reference = _sharded(mesh, torch_fully_shard)
    ours = _sharded(mesh)
    optimizers = []
    for model, local in ((reference, False), (ours, True)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if local:
            step_on_local_shards(optimizer)
        _set_grads(model, 0)
        model[1].weight.grad = None
        optimizer.step()
        _set_grads(model, 1)
        optimizer.step()
        optimizers.append(optimizer)
    _assert_same_params(ours, reference)
    _assert_same_state(optimizers[1], optimizers[0])


def test_state_dict_round_trip_then_continue(mesh: DeviceMesh) -> None:
    """``load_state_dict`` replaces the state: the next step rebuilds its local view."""
    reference = _sharded(mesh)
    reference_optimizer = _train(reference, "adamw_foreach", local=False, steps=4)
    ours = _sharded(mesh)
    optimizer = _train(ours, "adamw_foreach", local=True, steps=2)
    saved = optimizer.state_dict()
    optimizer.load_state_dict(saved)
    for step in (2, 3):
        _set_grads(ours, step)
        optimizer.step()
    _assert_same_params(ours, reference)
    _assert_same_state(optimizer, reference_optimizer)


def test_replaced_local_tensor_is_followed(mesh: DeviceMesh) -> None:
    """``module.double()`` gives every sharded param a new local tensor (fully_shard
    re-derives its sharded buffer); the local step must update the new one."""
    reference, ours = _sharded(mesh), _sharded(mesh)
    optimizers = []
    for model, local in ((reference, False), (ours, True)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if local:
            step_on_local_shards(optimizer)
        _set_grads(model, 0)
        optimizer.step()
        model.double()
        for p in model.parameters():
            p.grad = DTensor.from_local(
                torch.ones(p.to_local().shape, dtype=torch.float64),
                p.device_mesh,
                p.placements,
                run_check=False,
                shape=p.shape,
                stride=p.stride(),
            )
        optimizer.step()
        optimizers.append(optimizer)
    assert ours[0].weight.dtype == torch.float64
    _assert_same_params(ours, reference)


def test_remove_steps_on_dtensors_again(mesh: DeviceMesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    handle = step_on_local_shards(optimizer)
    assert isinstance(handle, LocalShardStep) and "step" in optimizer.__dict__
    handle.remove()
    assert "step" not in optimizer.__dict__
    step_on_local_shards(optimizer).remove()  # may be installed again after remove


# torch.optim machinery around the step #


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_lr_scheduler_either_order(mesh: DeviceMesh, scheduler_first: bool) -> None:
    """No "optimizer.step() has been overridden" warning, the LR follows the schedule
    and the result is the DTensor step's, with the scheduler built before or after."""
    reference, ours = _sharded(mesh), _sharded(mesh)
    results = []
    for model, local in ((reference, False), (ours, True)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if local and not scheduler_first:
            step_on_local_shards(optimizer)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        if local and scheduler_first:
            step_on_local_shards(optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(STEPS):
                _set_grads(model, step)
                optimizer.step()
                scheduler.step()
        results.append(optimizer.param_groups[0]["lr"])
    assert results == [1e-2 / 2**STEPS] * 2
    _assert_same_params(ours, reference)


def test_step_signature_is_kept(mesh: DeviceMesh) -> None:
    """GradScaler inspects ``optimizer.step``'s signature (``grad_scaler`` kwarg)."""
    optimizer = torch.optim.AdamW(_sharded(mesh).parameters(), lr=1e-2)
    before = inspect.signature(optimizer.step)
    step_on_local_shards(optimizer)
    assert inspect.signature(optimizer.step) == before


def test_closure_sees_dtensors(mesh: DeviceMesh) -> None:
    """The closure runs with the DTensor params in the groups (so its ``zero_grad`` and
    backward reach the model); the grads it leaves are the ones stepped."""
    reference, ours = _sharded(mesh), _sharded(mesh)
    for model, local in ((reference, False), (ours, True)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if local:
            step_on_local_shards(optimizer)

        def closure(model: nn.Module = model, optimizer: torch.optim.Optimizer = optimizer):
            optimizer.zero_grad()
            assert all(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"])
            _set_grads(model, 7)
            return torch.tensor(1.0)

        for _ in range(2):
            assert optimizer.step(closure).item() == 1.0
    _assert_same_params(ours, reference)


def test_error_in_step_restores_the_optimizer(mesh: DeviceMesh) -> None:
    class Failing(Lion):
        def step(self, closure=None):
            super().step(closure)
            raise RuntimeError("boom")

    model = _sharded(mesh)
    params = list(model.parameters())
    optimizer = Failing(params, lr=1e-3)
    step_on_local_shards(optimizer, elementwise=True)
    _set_grads(model, 0)
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step()
    assert _ids(optimizer.param_groups[0]["params"]) == _ids(params)
    assert _ids(optimizer.state) == _ids(params)
    assert all(isinstance(s["exp_avg"], DTensor) for s in optimizer.state.values())


# Errors #


def test_not_elementwise_optimizer_is_refused(mesh: DeviceMesh) -> None:
    params = list(_sharded(mesh).parameters())
    for optimizer in (torch.optim.LBFGS(params), Lion(params)):
        with pytest.raises(TypeError, match="not known to be element-wise.*elementwise=True"):
            step_on_local_shards(optimizer)
        assert "step" not in optimizer.__dict__

    class MyAdamW(torch.optim.AdamW):  # a subclass may override step: opt in explicitly
        pass

    with pytest.raises(TypeError, match="MyAdamW"):
        step_on_local_shards(MyAdamW(params))
    assert torch.optim.AdamW in ELEMENTWISE_OPTIMIZERS
    assert torch.optim.LBFGS not in ELEMENTWISE_OPTIMIZERS


def test_second_registration_is_refused(mesh: DeviceMesh) -> None:
    optimizer = torch.optim.SGD(_sharded(mesh).parameters(), lr=0.1)
    step_on_local_shards(optimizer)
    torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)  # wraps our step
    with pytest.raises(ValueError, match="already steps on local shards"):
        step_on_local_shards(optimizer)


def _dtensor_param(mesh: DeviceMesh, placements: list, shape: tuple[int, ...]) -> nn.Parameter:
    local = torch.ones(shape)
    return nn.Parameter(DTensor.from_local(local, mesh, placements, run_check=False))


def _assert_step_refused(optimizer: torch.optim.Optimizer, error: type, match: str) -> None:
    groups = [_ids(g["params"]) for g in optimizer.param_groups]
    state = optimizer.state
    locals_before = [p.to_local().clone() for g in optimizer.param_groups for p in g["params"]]
    with pytest.raises(error, match=match):
        optimizer.step()
    assert [_ids(g["params"]) for g in optimizer.param_groups] == groups
    assert optimizer.state is state
    locals_after = [p.to_local() for g in optimizer.param_groups for p in g["params"]]
    assert all(torch.equal(a, b) for a, b in zip(locals_before, locals_after, strict=True))


def test_partial_param_is_refused(mesh: DeviceMesh) -> None:
    good = _dtensor_param(mesh, [Shard(0)], (2, 3))
    partial = _dtensor_param(mesh, [Partial()], (2, 3))
    good.grad = torch.zeros_like(good)
    partial.grad = torch.zeros_like(partial)
    optimizer = torch.optim.SGD([{"params": [good]}, {"params": [partial]}], lr=0.1)
    step_on_local_shards(optimizer)
    _assert_step_refused(optimizer, ValueError, r"param_groups\[1\]\['params'\]\[0\].*Partial")


def test_zero_dim_param_is_refused(mesh: DeviceMesh) -> None:
    scalar = nn.Parameter(DTensor.from_local(torch.tensor(1.0), mesh, [Replicate()]))
    scalar.grad = torch.zeros_like(scalar)
    optimizer = torch.optim.SGD([scalar], lr=0.1)
    step_on_local_shards(optimizer)
    _assert_step_refused(optimizer, ValueError, "0-dim")


def test_grad_in_other_placements_is_refused(mesh: DeviceMesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=1e-2)
    step_on_local_shards(optimizer)
    _set_grads(model, 0)
    weight = model[0].weight
    weight.grad = DTensor.from_local(
        torch.zeros(weight.shape), weight.device_mesh, [Replicate()], run_check=False
    )
    _assert_step_refused(optimizer, ValueError, r"grad of '0.weight'.*Replicate")


def test_state_in_other_placements_is_refused(mesh: DeviceMesh) -> None:
    model = _sharded(mesh)
    optimizer = _train(model, "sgd_foreach", local=True, steps=1)
    weight = model[0].weight
    optimizer.state[weight]["momentum_buffer"] = DTensor.from_local(
        torch.zeros(weight.shape), weight.device_mesh, [Replicate()], run_check=False
    )
    _set_grads(model, 1)
    _assert_step_refused(optimizer, ValueError, "'momentum_buffer'.*Replicate")


def test_differentiable_is_refused(mesh: DeviceMesh) -> None:
    model = _sharded(mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, differentiable=True)
    step_on_local_shards(optimizer)
    _set_grads(model, 0)
    _assert_step_refused(optimizer, ValueError, "differentiable=True")
