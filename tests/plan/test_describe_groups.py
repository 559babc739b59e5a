"""``FSDPModule.describe_groups()``: what it reports of each ``fully_shard`` call's group
is what a user can observe. Its all-gather bytes are those torch's ``fully_shard`` moves
for the same module (counted at the c10d level, on torch's fake process group); its
sizes are the model's; its names are the ``CommTrace`` events'."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import CommTrace, FSDPGroupInfo, MixedPrecisionPolicy, fully_shard
from tests._c10d import C10dRecorder, bytes_of
from tests._harness import fake_mesh


class Net(nn.Module):
    """Over 3 ranks every dim 0 pads: 8 rows to 3 per rank, 5 to 2."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _shard(model: Net, shard, mesh, param_dtype: torch.dtype | None) -> list[nn.Module]:
    """Block 0 resharded after forward, block 1 kept, then the root; returns the
    sharded modules in ``modules()`` order (the root first)."""
    policy_cls = MixedPrecisionPolicy if shard is fully_shard else TorchMixedPrecisionPolicy
    kwargs = {"mesh": mesh, "mp_policy": policy_cls(param_dtype=param_dtype)}
    shard(model.blocks[0], reshard_after_forward=True, **kwargs)
    shard(model.blocks[1], reshard_after_forward=False, **kwargs)
    shard(model, **kwargs)
    return [model, model.blocks[0], model.blocks[1]]


def _torch_all_gather_bytes(module: TorchFSDPModule) -> int:
    """What torch's fully_shard all-gathers for ``module``'s own params."""
    with C10dRecorder() as recorder:
        module.unshard()
    module.reshard()
    return bytes_of(recorder.records, "all_gather")


@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp", "hsdp"])
def test_describes_what_torch_all_gathers(param_dtype: torch.dtype | None, hsdp: bool) -> None:
    world_size = 4 if hsdp else 3
    with fake_mesh(world_size) as mesh:
        if hsdp:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        ours, theirs = Net(), Net()
        sharded = _shard(ours, fully_shard, mesh, param_dtype)
        torch_sharded = _shard(theirs, torch_fully_shard, mesh, param_dtype)
        infos = ours.describe_groups()
        assert [info.modules for info in infos] == [(m,) for m in sharded]
        assert [info.unsharded_nbytes for info in infos] == [
            _torch_all_gather_bytes(m) for m in torch_sharded
        ]
        own_numel = [
            sum(p.numel() for p in ours.head.parameters()),
            *(sum(p.numel() for p in block.parameters()) for block in ours.blocks),
        ]
        assert [info.numel for info in infos] == own_numel
        assert {(info.shard_size, info.replicate_size) for info in infos} == {
            (2, 2) if hsdp else (3, 1)
        }
        assert [info.reshard_after_forward for info in infos[1:]] == [True, False]
        assert ours.blocks[1].describe_groups(recurse=False) == [infos[2]]


def test_names_are_the_trace_events() -> None:
    with fake_mesh(2) as mesh:
        model = Net()
        _shard(model, fully_shard, mesh, None)
        trace = CommTrace()
        model.set_comm_trace(trace)
        model(torch.randn(2, 8)).sum().backward()
        names = [info.fqn for info in model.describe_groups()]
        assert names == ["", "blocks.0", "blocks.1"]
        assert {event.fqn for event in trace.events} == set(names)


def test_hpz_reports_the_post_forward_world_size() -> None:
    with fake_mesh(4) as mesh:
        model = Net()
        fully_shard(model.blocks[0], mesh=mesh, reshard_after_forward=2)
        fully_shard(model, mesh=mesh)
        (block,) = model.blocks[0].describe_groups(recurse=False)
        assert block == FSDPGroupInfo(
            fqn=block.fqn,
            modules=(model.blocks[0],),
            numel=8 * 8 + 8,
            unsharded_nbytes=4 * (2 * 8 + 2) * 4,  # 4 ranks' padded shards, fp32
            shard_size=4,
            replicate_size=1,
            reshard_after_forward=2,
        )
        assert dist.get_world_size() == 4
