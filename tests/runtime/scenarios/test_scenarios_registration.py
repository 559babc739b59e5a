"""Which parameters a module has registered after forward and after backward, per
``reshard_after_forward``: torch's ``TestFullyShardRegisteredParams``
(test_fully_shard_training.py) run on torch's ``fully_shard`` and on ours.

A group that resharded registers its sharded ``DTensor`` parameters; one that kept its
parameters unsharded registers plain tensors (the all-gather outputs). Torch's rules,
asserted for both implementations and compared state for state:

- after a grad-enabled forward with no backward: ``True`` and an int (reshard to a
  smaller world) reshard every group; ``False`` none; ``None`` every group but the root;
- after ``reshard()`` on every FSDP module, and after backward: every group is sharded;
- either way the values are the original ones (``full_tensor()`` of the sharded ones).

Like torch's, these run on torch's threaded process group (``FSDPTestMultiThread``,
4 ranks as threads of this process), which is cheap enough for one test per setting.
"""

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import FSDPModule, fully_shard
from tests._harness import MLP, FSDPTestMultiThread, instantiate_parametrized_tests, parametrize

WORLD_SIZE = 4  # so that reshard_after_forward=2 reshards to a real sub-world
IMPLS = {"torch": (torch_fully_shard, TorchFSDPModule), "ours": (fully_shard, FSDPModule)}
RESHARD_AFTER_FORWARD = [True, False, 2, None]


def _broadcast_from_rank0(model: nn.Module) -> nn.Module:
    """The ranks are threads sharing one RNG: make their models equal explicitly."""
    with torch.no_grad():
        for param in model.parameters():
            dist.broadcast(param, src=0)
    return model


def _registered(model: nn.Module, ref: nn.Module) -> dict[str, tuple[str, bool]]:
    """Per FQN: whether the registered param is a DTensor or a plain tensor, and whether
    its (full) value is the reference's."""
    ref_params = dict(ref.named_parameters())
    out = {}
    for name, param in model.named_parameters():
        value = param.full_tensor() if isinstance(param, DTensor) else param
        out[name] = (
            "DTensor" if isinstance(param, DTensor) else "Tensor",
            torch.equal(value.detach(), ref_params[name].detach()),
        )
    return out


def _shard_root_only(shard, model: nn.Sequential, reshard_after_forward) -> set[str]:
    shard(
        model,
        mesh=init_device_mesh("cpu", (WORLD_SIZE,)),
        reshard_after_forward=reshard_after_forward,
    )
    return set()


def _shard_nested(shard, model: nn.Sequential, reshard_after_forward) -> set[str]:
    """torch's layout: the first MLP's two Linears are groups, the root has the rest."""
    mesh = init_device_mesh("cpu", (WORLD_SIZE,))
    for linear in (model[0].in_proj, model[0].out_proj):
        shard(linear, mesh=mesh, reshard_after_forward=reshard_after_forward)
    shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return {name for name, _ in model[0].named_parameters(prefix="0")}


LAYOUTS = {"root_only": _shard_root_only, "nested": _shard_nested}


def _diff(got: dict, expected: dict) -> str:
    """The FQNs whose (kind, value-matches) differ, for the failure message."""
    return ", ".join(
        f"{n}: {got.get(n)} != {expected.get(n)}" for n in expected if got.get(n) != expected[n]
    )


def _expected_after_forward(name: str, non_root: set[str], reshard_after_forward) -> str:
    if reshard_after_forward is None:  # the root keeps its params for backward
        return "DTensor" if name in non_root else "Tensor"
    return "DTensor" if reshard_after_forward else "Tensor"


class TestParamRegistration(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return WORLD_SIZE

    def _models(self, dim: int, n_mlps: int) -> tuple[nn.Module, dict[str, nn.Module]]:
        torch.manual_seed(42)
        ref = _broadcast_from_rank0(nn.Sequential(*(MLP(dim) for _ in range(n_mlps))))
        return ref, {impl: copy.deepcopy(ref) for impl in IMPLS}

    def _input(self, dim: int) -> torch.Tensor:
        return torch.randn((2, dim), generator=torch.Generator().manual_seed(self.rank))

    @parametrize("layout", list(LAYOUTS))
    @parametrize("reshard_after_forward", RESHARD_AFTER_FORWARD, name_fn=str)
    def test_param_registration_after_forward(self, layout: str, reshard_after_forward) -> None:
        """A grad-enabled forward with no backward, then ``reshard()`` by hand."""
        ref, models = self._models(3, 1 if layout == "root_only" else 2)
        after_forward, after_reshard = {}, {}
        for impl, (shard, fsdp_module) in IMPLS.items():
            model = models[impl]
            non_root = LAYOUTS[layout](shard, model, reshard_after_forward)
            initial = _registered(model, ref)
            sharded = {n: ("DTensor", True) for n in initial}
            self.assertEqual(
                initial, sharded, msg=f"{impl} after fully_shard: {_diff(initial, sharded)}"
            )
            model(self._input(3))
            after_forward[impl] = _registered(model, ref)
            expected = {
                n: (_expected_after_forward(n, non_root, reshard_after_forward), True)
                for n in initial
            }
            self.assertEqual(
                after_forward[impl],
                expected,
                msg=f"{impl} after forward: {_diff(after_forward[impl], expected)}",
            )
            for module in model.modules():
                if isinstance(module, fsdp_module):
                    module.reshard()
            after_reshard[impl] = _registered(model, ref)
            self.assertEqual(
                after_reshard[impl],
                sharded,
                msg=f"{impl} after reshard(): {_diff(after_reshard[impl], sharded)}",
            )
        self.assertEqual(after_forward["ours"], after_forward["torch"])

    @parametrize("layout", list(LAYOUTS))
    @parametrize("reshard_after_forward", RESHARD_AFTER_FORWARD, name_fn=str)
    def test_param_registration_after_backward(self, layout: str, reshard_after_forward) -> None:
        ref, models = self._models(8, 1 if layout == "root_only" else 2)
        after_backward = {}
        for impl, (shard, _) in IMPLS.items():
            model = models[impl]
            LAYOUTS[layout](shard, model, reshard_after_forward)
            model(self._input(8)).sum().backward()
            # Values are the reference's: no optimizer step ran.
            after_backward[impl] = _registered(model, ref)
            sharded = {n: ("DTensor", True) for n, _ in ref.named_parameters()}
            self.assertEqual(
                after_backward[impl],
                sharded,
                msg=f"{impl} after backward: {_diff(after_backward[impl], sharded)}",
            )
            self.assertTrue(all(isinstance(p.grad, DTensor) for p in model.parameters()), msg=impl)


instantiate_parametrized_tests(TestParamRegistration)
