"""fully_shard's placements, shapes and class swap, at large world sizes on the fake PG."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from dtensor_fsdp import FSDPModule, fully_shard
from tests._harness import fake_mesh


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)
        self.register_buffer("scale", torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x))) * self.scale

    def describe(self) -> str:
        return f"Block({self.up.in_features})"


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(8, 13), Block(8, 3), nn.Linear(8, 5))


@pytest.mark.parametrize("world_size,rank", [(2, 1), (3, 2), (4, 3), (1024, 0), (1024, 1023)])
def test_params_become_shard0_dtensors_with_torch_chunk_local_shapes(world_size: int, rank: int) -> None:
    model = _model()
    original = {name: p.detach().clone() for name, p in model.named_parameters()}
    requires_grad = {name: p.requires_grad for name, p in model.named_parameters()}
    with fake_mesh(world_size, rank) as mesh:
        for block in model[:2]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for name, param in model.named_parameters():
            assert isinstance(param, nn.Parameter) and isinstance(param.data, DTensor), name
            assert param.placements == (Shard(0),)
            assert param.shape == original[name].shape and param.dtype == original[name].dtype
            assert param.requires_grad == requires_grad[name]
            chunks = original[name].chunk(world_size)
            expected = chunks[rank] if rank < len(chunks) else original[name][:0]
            assert param.to_local().shape == expected.shape, name
            torch.testing.assert_close(param.to_local(), expected, rtol=0, atol=0)


def test_class_swap_keeps_original_methods_and_buffers() -> None:
    model = _model()
    with fake_mesh(2) as mesh:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        assert isinstance(model[0], FSDPModule) and isinstance(model[0], Block)
        assert isinstance(model, FSDPModule) and isinstance(model, nn.Sequential)
        assert not isinstance(model[1], FSDPModule)
        assert type(model[0]).__name__ == "FSDPBlock"
        assert model[0].describe() == "Block(8)"
        # Buffers are moved, never sharded.
        assert not isinstance(model[0].scale, DTensor) and model[0].scale.shape == (8,)
        # The root group owns what the child did not: Block 1 and the head.
        root_group = model._get_fsdp_state().group
        assert sorted(p.fqn for p in root_group.fsdp_params) == [
            "1.down.weight", "1.up.bias", "1.up.weight", "2.bias", "2.weight",
        ]


def test_tied_parameter_shares_one_shard_and_both_slots() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    with fake_mesh(2) as mesh:
        fully_shard(model, mesh=mesh)
        assert model[0].weight is model[1].weight
        (fsdp_param,) = model._get_fsdp_state().group.fsdp_params
        assert len(fsdp_param.slots) == 2


def test_mixed_dtypes_in_one_group_share_the_sharded_buffer() -> None:
    model = nn.Linear(4, 6)
    model.bias.data = model.bias.data.to(torch.float64)
    model.bias.requires_grad_(False)  # one trainable dtype per group
    expected = copy.deepcopy(model)
    with fake_mesh(2, rank=1) as mesh:
        fully_shard(model, mesh=mesh)
        group = model._get_fsdp_state().group
        # float64 first, so every segment offset is aligned for its dtype.
        assert [p.fqn for p in group.fsdp_params] == ["bias", "weight"]
        assert group.sharded_buffer.numel() == 3 * 8 + 3 * 4 * 4
        torch.testing.assert_close(model.bias.to_local(), expected.bias[3:])
        torch.testing.assert_close(model.weight.to_local(), expected.weight[3:])


def test_meta_device_params_stay_on_meta() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 2))
    with fake_mesh(4) as mesh:
        fully_shard(model, mesh=mesh)
        assert all(p.device.type == "meta" for p in model.parameters())
        assert model[0].weight.to_local().shape == (2, 4)


def test_unsharded_storage_is_freed_at_init() -> None:
    model = nn.Linear(4, 6)
    with fake_mesh(2) as mesh:
        fully_shard(model, mesh=mesh)
        for fsdp_param in model._get_fsdp_state().group.fsdp_params:
            assert fsdp_param.unsharded_param.untyped_storage().size() == 0


@pytest.mark.parametrize("world_size,rank", [(2, 1), (4, 3)])
def test_shard_placement_fn_shards_the_chosen_dim(world_size: int, rank: int) -> None:
    model = nn.Sequential(nn.Linear(8, 5), nn.Linear(5, 3))
    original = {name: p.detach().clone() for name, p in model.named_parameters()}

    def placement(param: nn.Parameter) -> Shard | None:
        return Shard(-1) if param.dim() == 2 and param.shape[-1] % world_size == 0 else None

    with fake_mesh(world_size, rank) as mesh:
        fully_shard(model, mesh=mesh, shard_placement_fn=placement)
        assert model[0].weight.placements == (Shard(1),)  # 8 columns divide evenly
        torch.testing.assert_close(
            model[0].weight.to_local(), original["0.weight"].chunk(world_size, dim=1)[rank]
        )
        assert model[1].weight.placements == (Shard(0),)  # 5 columns do not: default
        assert model[0].bias.placements == (Shard(0),)
