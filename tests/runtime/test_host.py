"""What the host-overhead shortcuts could change, against torch's ``fully_shard`` on 2
gloo ranks (issue 20, part 3).

- Sharded grads are built by wrapping the reduce-scattered chunk in a prebuilt
  ``DTensorSpec`` (no ``DTensor.from_local``): after backward, ``sharded_param.grad`` is a
  DTensor of the same placements, shape, stride and dtype as torch's, with
  ``requires_grad=False`` and no ``grad_fn``, and the same values; a second backward
  without ``zero_grad`` adds into it, as torch's does.
- One version-counter guard per group over a cached tuple: the unsharded params that
  autograd saved in forward have, after the backward re-gather, the version counters
  torch's have, so autograd's saved-tensor check behaves the same (and a
  ``reshard_after_forward=True`` backward runs without its "modified by an inplace
  operation" error).

Each with and without mixed precision (bf16 params, fp32 reduce); the model has an
uneven parameter (3 rows over 2 ranks: a padded shard) and an all-gather cast.
"""

import importlib
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools

WORLD_SIZE = 2
IMPL_MODULES = {"ours": "dtensor_fsdp", "torch": "torch.distributed.fsdp"}  # --fsdp-impl
MODES = ("fp32", "bf16")


def _model() -> nn.Module:
    torch.manual_seed(0)
    # Linear(4, 3): 3 weight rows and 3 bias elements over 2 ranks, rank 1's shard padded.
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3), nn.Linear(3, 4))


def _shard(model: nn.Module, shard: Any, policy_type: type, mesh: DeviceMesh, mode: str) -> None:
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": True}
    if mode == "bf16":
        kwargs["mp_policy"] = policy_type(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2], model[3]):
        shard(layer, **kwargs)
    shard(model, **kwargs)


def _grad_view(grad: torch.Tensor) -> dict[str, Any]:
    assert isinstance(grad, DTensor)
    return {
        "type": type(grad).__name__,
        "placements": tuple(grad.placements),
        "mesh": grad.device_mesh.mesh.tolist(),
        "shape": tuple(grad.shape),
        "stride": grad.stride(),
        "dtype": grad.dtype,
        "requires_grad": grad.requires_grad,
        "grad_fn": grad.grad_fn,
        "local_shape": tuple(grad._local_tensor.shape),
        "local_requires_grad": grad._local_tensor.requires_grad,
        "local_grad_fn": grad._local_tensor.grad_fn,
        "local": grad.to_local().detach().clone(),
    }


def _one_impl(impl: str, rank: int, mesh: DeviceMesh, impls: dict, mode: str) -> dict[str, Any]:
    model = _model()
    policy_type = TorchMixedPrecisionPolicy if impl == "torch" else impls["policy"]
    _shard(model, impls[impl], policy_type, mesh, mode)
    # The unsharded params registered during each Linear's forward (FSDP's pre-forward
    # hook runs first: it is prepended), and their versions then.
    saved: list[tuple[str, nn.Parameter, int]] = []

    def record(module: nn.Module, args: Any) -> None:
        for name, param in module.named_parameters(recurse=False):
            saved.append((name, param, param._version))

    for layer in (model[0], model[2], model[3]):
        layer.register_forward_pre_hook(record)
    torch.manual_seed(1 + rank)
    inputs = [torch.randn(2, 4) for _ in range(2)]
    grads = []
    for x in inputs:  # the second backward accumulates into the first one's grads
        model(x).float().pow(2).sum().backward()
        grads.append({n: _grad_view(p.grad) for n, p in model.named_parameters()})
    return {
        "grads": grads,
        "versions": [(name, at_forward, param._version) for name, param, at_forward in saved],
    }


def _run(rank: int, world_size: int, impl: str) -> dict[str, Any]:
    module = importlib.import_module(IMPL_MODULES[impl])
    impls = {"ours": module.fully_shard, "torch": torch_fully_shard}
    impls["policy"] = module.MixedPrecisionPolicy
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            mode: lambda mode=mode: {
                impl: _one_impl(impl, rank, mesh, impls, mode) for impl in ("ours", "torch")
            }
            for mode in MODES
        }
    )


@pytest.fixture(scope="module")
def run(fsdp_impl: str, gloo_pool: GlooPools) -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, fsdp_impl, timeout=120, pool=gloo_pool)


@pytest.mark.parametrize("mode", MODES)
def test_sharded_grads_are_the_dtensors_torch_builds(run, mode: str) -> None:
    for rank, rec in enumerate(scenario_records(run, mode)):
        ours, theirs = rec["ours"]["grads"], rec["torch"]["grads"]
        assert len(ours) == len(theirs) == 2
        for step, (ours_step, theirs_step) in enumerate(zip(ours, theirs, strict=True)):
            assert ours_step.keys() == theirs_step.keys()
            for name, view in ours_step.items():
                expected = theirs_step[name]
                where = f"rank {rank}, backward {step}, {name}"
                assert expected["grad_fn"] is None and not expected["requires_grad"], (
                    f"torch's premise: {where}"
                )
                for key in expected:
                    if key != "local":
                        assert view[key] == expected[key], f"{where}: {key}"
                # The same reduce-scatter of the same values (a sum of 2 terms, then a
                # division by 2, or fp32 after bf16 compute): bitwise.
                assert torch.equal(view["local"], expected["local"]), where


@pytest.mark.parametrize("mode", MODES)
def test_saved_unsharded_params_keep_torchs_version_counters(run, mode: str) -> None:
    for rank, rec in enumerate(scenario_records(run, mode)):
        ours, theirs = rec["ours"]["versions"], rec["torch"]["versions"]
        # 3 Linears x (weight, bias), one forward each per step, 2 steps.
        assert len(theirs) == 12, f"torch's premise: {theirs}"
        assert ours == theirs, f"rank {rank}"
