"""``dtensor_fsdp.optim.Muon`` on torch's threaded test process group (one thread per
rank, the backend of torch's own FSDP2 CPU unit tests): its ``all_to_all_single`` with
uneven split sizes carries the owner exchange as gloo's does.

Apart from tests/optim/test_muon_gloo.py so that its spawned ranks do not import torch's
distributed test framework. Threads share the global RNG, so the model comes from a
generator.
"""

import copy

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor

from dtensor_fsdp import fully_shard
from dtensor_fsdp.optim import Muon
from tests._harness import FSDPTestMultiThread

STEPS = 3


def _model() -> nn.Sequential:
    """Uneven rows over 2 ranks: 65 and 3."""
    model = nn.Sequential(nn.Linear(8, 65, bias=False), nn.Tanh(), nn.Linear(65, 3, bias=False))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    return model


class TestMuonThreadedProcessGroup(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 2

    def test_matches_single_process_torch_muon(self) -> None:
        """Each rank's gradient shards are set from one global gradient, so the only
        difference to torch.optim.Muon on the unsharded model is where Newton-Schulz
        runs: bitwise equal ([Note: Muon numerics] in dtensor_fsdp/optim/muon.py). On
        torch's ``fully_shard`` too: the optimizer needs only DTensor params."""
        mesh = init_device_mesh("cpu", (self.world_size,))
        reference = _model()
        ref_optimizer = torch.optim.Muon(reference.parameters(), lr=0.02)
        sharded = {}
        for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
            model = copy.deepcopy(reference)
            for layer in (model[0], model[2]):
                shard(layer, mesh=mesh)
            sharded[name] = (model, Muon(model.parameters(), lr=0.02))
        gen = torch.Generator().manual_seed(1)
        for step in range(STEPS):
            for param in reference.parameters():
                param.grad = torch.randn(param.shape, generator=gen)
            for model, optimizer in sharded.values():
                for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
                    local = ref.grad.chunk(self.world_size)[self.rank].clone()
                    param.grad = DTensor.from_local(
                        local, mesh, param.placements, shape=ref.shape, stride=ref.stride()
                    )
                optimizer.step()
            ref_optimizer.step()
            for name, (model, _) in sharded.items():
                for param, ref in zip(model.parameters(), reference.parameters(), strict=True):
                    self.assertTrue(
                        torch.equal(param.full_tensor(), ref),
                        f"{name} rank {self.rank} step {step}",
                    )
