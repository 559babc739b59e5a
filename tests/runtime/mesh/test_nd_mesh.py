"""2-D and 3-D meshes (HSDP, FSDP + TP) on torch's fake process group, in one process:
placements and local shapes against torch's ``fully_shard``, ``shard_placement_fn`` on
them, and the errors for meshes and placements that cannot work."""

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from dtensor_fsdp import fully_shard
from tests._harness import fake_mesh


@contextlib.contextmanager
def _mesh(shape: tuple[int, ...], names: tuple[str, ...], rank: int = 0) -> Iterator[DeviceMesh]:
    with fake_mesh(int(torch.tensor(shape).prod()), rank):
        yield init_device_mesh("cpu", shape, mesh_dim_names=names)


class TwoLinear(nn.Module):
    """An up projection (column-wise under TP) and a down projection (row-wise)."""

    def __init__(self, dim: int = 8, hidden: int = 12) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


def _tp(model: TwoLinear, tp_mesh: DeviceMesh) -> TwoLinear:
    parallelize_module(model, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def _layout(model: nn.Module) -> dict[str, tuple]:
    return {
        name: (tuple(p.placements), tuple(p.to_local().shape), p.device_mesh.mesh_dim_names)
        for name, p in model.named_parameters()
    }


def _both(build: Callable[[], nn.Module], shard: Callable[[nn.Module], None]) -> tuple[dict, dict]:
    """(ours, torch's) layout of the same model sharded the same way."""
    layouts = []
    for impl in (fully_shard, torch_fully_shard):
        model = build()
        shard(model, impl)
        layouts.append(_layout(model))
    return layouts[0], layouts[1]


# Placements, against torch #


@pytest.mark.parametrize("rank", [0, 3])
def test_hsdp_placements_match_torch(rank: int) -> None:
    with _mesh((2, 2), ("replicate", "shard"), rank) as mesh:
        ours, theirs = _both(TwoLinear, lambda m, impl: impl(m, mesh=mesh))
    assert ours == theirs
    assert ours["up.weight"] == ((Replicate(), Shard(0)), (6, 8), ("replicate", "shard"))


@pytest.mark.parametrize("rank", [0, 3])
def test_fsdp_tp_placements_match_torch(rank: int) -> None:
    with _mesh((2, 2), ("dp", "tp"), rank) as mesh:
        ours, theirs = _both(
            lambda: _tp(TwoLinear(), mesh["tp"]), lambda m, impl: impl(m, mesh=mesh["dp"])
        )
    assert ours == theirs
    # up: TP rows (6 of 12), then FSDP's 3 of those, interleaved with TP's chunks.
    assert ours["up.weight"] == ((_StridedShard(0, split_factor=2), Shard(0)), (3, 8), ("dp", "tp"))
    assert ours["down.weight"] == ((Shard(0), Shard(1)), (4, 6), ("dp", "tp"))


def _views(kind: str) -> tuple[DeviceMesh, DeviceMesh]:
    """(TP mesh, data-parallel mesh) over 4 ranks, built the ways torch accepts."""
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    if kind == "unflattened_views":  # torchtitan: one world, a view per purpose
        data = world._unflatten(0, (2, 2), ("batch", "tp"))
        dense = world._unflatten(0, (2, 2), ("fsdp", "tp"))
        return data["tp"], dense["fsdp"]
    if kind == "tp_outer":  # TP over ranks {0, 2}, {1, 3}; FSDP over {0, 1}, {2, 3}
        view = world._unflatten(0, (2, 2), ("tp", "fsdp"))
        return view["tp"], view["fsdp"]
    if kind == "separate_roots":  # two init_device_mesh calls over the same ranks
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        return other["tp"], world._unflatten(0, (2, 2), ("fsdp", "tp"))["fsdp"]
    assert kind == "hsdp_views"
    data = world._unflatten(0, (2, 2), ("batch", "tp"))
    dense = world._unflatten(0, (2, 1, 2), ("replicate", "shard", "tp"))
    return data["tp"], dense["replicate", "shard"]


@pytest.mark.parametrize("kind", ["unflattened_views", "tp_outer", "separate_roots", "hsdp_views"])
@pytest.mark.parametrize("rank", [0, 3])
def test_fsdp_tp_on_views_of_one_world_matches_torch(kind: str, rank: int) -> None:
    with fake_mesh(4, rank):
        tp_mesh, dp_mesh = _views(kind)
        results = []
        for impl in (fully_shard, torch_fully_shard):
            model = _tp(TwoLinear(), tp_mesh)
            impl(model, mesh=dp_mesh)
            meshes = {name: p.device_mesh for name, p in model.named_parameters()}
            results.append((_layout(model), meshes))
    (ours, our_meshes), (theirs, their_meshes) = results
    assert ours == theirs
    assert our_meshes == their_meshes  # the concatenated (dp..., tp) mesh, equal as meshes
    dp_placements = (Replicate(),) * (dp_mesh.ndim - 1)
    assert ours["up.weight"][0] == (*dp_placements, _StridedShard(0, split_factor=2), Shard(0))
    assert ours["down.weight"][0] == (*dp_placements, Shard(0), Shard(1))


def _dim1_when_even(size: int) -> Callable[[nn.Parameter], Shard | None]:
    def placement(param: nn.Parameter) -> Shard | None:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(1) if local.dim() == 2 and local.shape[1] % size == 0 else None

    return placement


def test_shard_placement_fn_with_hsdp_matches_torch() -> None:
    with _mesh((2, 2), ("replicate", "shard"), rank=1) as mesh:
        ours, theirs = _both(
            TwoLinear, lambda m, impl: impl(m, mesh=mesh, shard_placement_fn=_dim1_when_even(2))
        )
    assert ours == theirs
    assert ours["up.weight"] == ((Replicate(), Shard(1)), (12, 4), ("replicate", "shard"))
    assert ours["up.bias"] == ((Replicate(), Shard(0)), (6,), ("replicate", "shard"))


def test_shard_placement_fn_with_tp_matches_torch() -> None:
    with _mesh((2, 2), ("dp", "tp"), rank=2) as mesh:
        ours, theirs = _both(
            lambda: _tp(TwoLinear(), mesh["tp"]),
            lambda m, impl: impl(m, mesh=mesh["dp"], shard_placement_fn=_dim1_when_even(2)),
        )
    assert ours == theirs
    # up: TP shards dim 0, FSDP dim 1 of the TP-local (6, 8): no interleaving.
    assert ours["up.weight"] == ((Shard(1), Shard(0)), (6, 4), ("dp", "tp"))
    # down: TP already shards dim 1 (12 -> 6), FSDP splits those 6 columns again.
    assert ours["down.weight"] == (
        (_StridedShard(1, split_factor=2), Shard(1)),
        (8, 3),
        ("dp", "tp"),
    )


# Errors #


def _assert_untouched_after(
    model: nn.Module, call: Callable[[], object], error: type, match: str
) -> None:
    before = [(name, id(p)) for name, p in model.named_parameters()]
    with pytest.raises(error, match=match):
        call()
    assert [(name, id(p)) for name, p in model.named_parameters()] == before


def test_tp_mesh_overlapping_the_data_parallel_mesh() -> None:
    with _mesh((2, 2), ("dp", "tp")) as mesh:
        # Transposed: its "tp" groups are ranks {0, 2} and {1, 3}, mesh["dp"]'s axis.
        other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
        model = _tp(TwoLinear(), other["tp"])
        for error in (ValueError, RuntimeError):  # RuntimeError: what torch raises
            _assert_untouched_after(
                model,
                lambda: fully_shard(model, mesh=mesh["dp"]),
                error,
                "parameter 'up.weight' is a DTensor on .*which cannot be combined with the "
                "data-parallel mesh .*Cannot concatenate overlapping meshes",
            )


def test_tp_mesh_passed_as_the_data_parallel_mesh() -> None:
    with _mesh((2, 2), ("dp", "tp")) as mesh:
        model = _tp(TwoLinear(), mesh["tp"])
        _assert_untouched_after(
            model,
            lambda: fully_shard(model, mesh=mesh["tp"]),
            ValueError,
            "parameter 'up.weight' is already a DTensor on the data-parallel mesh",
        )


def test_three_dimensional_mesh_names_the_sub_mesh_to_pass() -> None:
    with _mesh((2, 1, 2), ("replicate", "shard", "tp")) as mesh:
        model = TwoLinear()
        _assert_untouched_after(
            model,
            lambda: fully_shard(model, mesh=mesh),
            ValueError,
            r"but got DeviceMesh.*\(3-D\).*mesh\['replicate', 'shard'\]",
        )


def _with_cuda_param(model: nn.Module) -> nn.Module:
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.scale = nn.Parameter(torch.ones(8, device="cuda"))  # cuda:0 outside the mode
    return model


@pytest.mark.parametrize("kind", ["hsdp", "fsdp_tp"])
def test_param_on_another_device_type_than_the_mesh(kind: str) -> None:
    shape, names = ((2, 2), ("replicate", "shard")) if kind == "hsdp" else ((2, 2), ("dp", "tp"))
    with _mesh(shape, names) as mesh:
        if kind == "hsdp":
            model, dp_mesh = _with_cuda_param(TwoLinear()), mesh
        else:
            model, dp_mesh = _with_cuda_param(_tp(TwoLinear(), mesh["tp"])), mesh["dp"]
        _assert_untouched_after(
            model,
            lambda: fully_shard(model, mesh=dp_mesh),
            ValueError,
            "parameter 'scale' is on cuda:0, but the mesh's device is cpu",
        )


def _dim1(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.dim() == 2 else None


@pytest.mark.parametrize(
    "kind,shape,names",
    [
        ("fsdp", (3,), ("dp",)),  # 8 columns over 3 ranks
        ("hsdp", (2, 3), ("replicate", "shard")),  # over the 3-rank shard axis
        ("fsdp_tp", (3, 2), ("dp", "tp")),  # up's TP-local (6, 8): 8 columns over 3
    ],
)
def test_uneven_shard_on_a_dim_other_than_0(kind: str, shape: tuple, names: tuple) -> None:
    with _mesh(shape, names) as mesh:
        model = _tp(TwoLinear(), mesh["tp"]) if kind == "fsdp_tp" else TwoLinear()
        dp_mesh = mesh["dp"] if kind == "fsdp_tp" else mesh
        _assert_untouched_after(
            model,
            lambda: fully_shard(model, mesh=dp_mesh, shard_placement_fn=_dim1),
            NotImplementedError,  # as torch
            r"parameter 'up.weight': FSDP does not support uneven sharding on dim 1: size 8 "
            r"on dim 1, which the shard world size 3 does not divide",
        )
