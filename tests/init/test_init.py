"""fully_shard's placements, shapes and class swap, at large world sizes on the fake PG;
``init_unsharded``'s lazy full parameters (what init code sees, the byte budget)."""

import copy

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from dtensor_fsdp import FSDPModule, fully_shard, init_unsharded
from dtensor_fsdp.init.lazy_full_tensor import LazyFullTensor
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
def test_params_become_shard0_dtensors_with_torch_chunk_local_shapes(
    world_size: int, rank: int
) -> None:
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
        root_group = model._get_fsdp_state().groups[0]
        assert sorted(p.fqn for p in root_group.fsdp_params) == [
            "1.down.weight",
            "1.up.bias",
            "1.up.weight",
            "2.bias",
            "2.weight",
        ]


def test_tied_parameter_shares_one_shard_and_both_slots() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight
    with fake_mesh(2) as mesh:
        fully_shard(model, mesh=mesh)
        assert model[0].weight is model[1].weight
        (fsdp_param,) = model._get_fsdp_state().fsdp_params()
        assert len(fsdp_param.slots) == 2


def test_mixed_dtypes_in_one_group_share_the_sharded_buffer() -> None:
    model = nn.Linear(4, 6)
    model.bias.data = model.bias.data.to(torch.float64)
    model.bias.requires_grad_(False)  # one trainable dtype per group
    expected = copy.deepcopy(model)
    with fake_mesh(2, rank=1) as mesh:
        fully_shard(model, mesh=mesh)
        group = model._get_fsdp_state().groups[0]
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
        for fsdp_param in model._get_fsdp_state().fsdp_params():
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


# init_unsharded on the fake PG: collectives move no data, so these tests check what
# init code sees and what stays materialized, not values (tests/init/test_meta_init.py).

WEIGHT_BYTES = 8 * 8 * 4  # each Linear(8, 8) weight, fp32


def _meta_sharded(mesh, shard=fully_shard) -> nn.Sequential:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    shard(model[0], mesh=mesh)
    shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    return model


def _seen(p: torch.Tensor) -> tuple:
    return (isinstance(p, nn.Parameter), tuple(p.shape), p.dtype, p.device, p.requires_grad)


def test_lazy_params_look_like_torch_fully_shard_params_without_memory() -> None:
    with fake_mesh(4) as mesh:
        model, theirs = _meta_sharded(mesh), _meta_sharded(mesh, torch_fully_shard)
        model[1].weight.requires_grad_(False)
        theirs[1].weight.requires_grad_(False)
        with init_unsharded(model) as cache:
            ours = {n: _seen(p) for n, p in model.named_parameters()}
            lazy = {n: type(p.data) for n, p in model.named_parameters()}
            detached = type(model[0].weight.detach())
            nbytes = cache.live_bytes
        # Names, Parameter-ness, global shapes, dtypes, devices, requires_grad: torch's.
        assert ours == {n: _seen(p) for n, p in theirs.named_parameters()}
        assert set(lazy.values()) == {LazyFullTensor} and detached is LazyFullTensor
        assert nbytes == 0  # metadata, `.data` and `detach()` materialize nothing
        # The largest group: the root (Linear(8, 8) and Linear(8, 3) with biases).
        assert cache.budget_bytes == WEIGHT_BYTES + 8 * 4 + 3 * 8 * 4 + 3 * 4


def test_in_place_ops_return_the_param_and_views_are_plain_tensors() -> None:
    with fake_mesh(2) as mesh:
        model = _meta_sharded(mesh)
        with init_unsharded(model) as cache, torch.no_grad():
            weight = model[0].weight
            assert nn.init.normal_(weight) is weight
            assert weight.data.zero_() is not weight  # another lazy param of the same
            assert cache.live_bytes == WEIGHT_BYTES
            row, transposed = weight[2], weight.t()
            assert type(row) is torch.Tensor and type(transposed) is torch.Tensor
            row.fill_(1.0)  # a view of the full tensor: writes through
            assert weight.sum().item() == 8.0 and type(weight.sum()) is torch.Tensor
            assert torch.equal(transposed[:, 2], torch.ones(8))
        # Out of the context: the sharded params are back.
        assert all(isinstance(p.data, DTensor) for p in model.parameters())


def test_budget_keeps_the_most_recently_used_and_regathers_evicted_params() -> None:
    with fake_mesh(2) as mesh:
        model = _meta_sharded(mesh)
        with init_unsharded(model, max_unsharded_bytes=WEIGHT_BYTES) as cache, torch.no_grad():
            first, second = model[0].weight, model[1].weight
            first.zero_()
            second.zero_()  # evicts `first`: written back to its shard
            assert (cache.live_bytes, cache.evictions, cache.all_gathers) == (WEIGHT_BYTES, 1, 0)
            first.add_(1.0)  # re-gathered from the shards
            assert (cache.evictions, cache.all_gathers) == (2, 1)
            first.copy_(second)  # one op on both: both live while it runs
            assert cache.peak_bytes == 2 * WEIGHT_BYTES
            model[2].bias.zero_()  # evicts both (least recently used first)
            assert cache.live_bytes == 3 * 4
        assert cache.live_bytes == 0 and cache.closed


def test_using_a_lazy_param_after_the_context_raises() -> None:
    with fake_mesh(2) as mesh:
        model = _meta_sharded(mesh)
        with init_unsharded(model):
            kept = model[1].weight
        with (
            pytest.raises(RuntimeError, match=r"parameter '1.weight' was used after"),
            torch.no_grad(),
        ):
            kept.zero_()


def test_assigning_data_replaces_the_full_tensor_of_the_same_shape_and_dtype() -> None:
    with fake_mesh(2) as mesh:
        model = _meta_sharded(mesh)
        with init_unsharded(model) as cache, torch.no_grad():
            bias = model[0].bias
            value = torch.zeros(8)
            bias.data = value  # as on an eager model: the parameter aliases it
            bias.add_(1.0)
            assert torch.equal(value, torch.ones(8)) and cache.live_bytes == 8 * 4
            with pytest.raises(ValueError, match=r"cannot assign .* to '0.bias'"):
                bias.data = torch.zeros(8, dtype=torch.float64)
