"""Bad input: a clear error naming the parameter and the fix, and the module untouched."""

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import share_comm_ctx as torch_share_comm_ctx
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    FSDPMeshInfo,
    HSDPMeshInfo,
    ShardPlacementResult,
)
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from dtensor_fsdp import (
    AllGather,
    DataParallelMeshDims,
    FSDPModule,
    ReduceScatter,
    fully_shard,
    share_comm_ctx,
)
from tests._harness import fake_mesh


def _snapshot(model: nn.Module) -> list[tuple[Any, ...]]:
    """Everything fully_shard could mutate: classes, parameter objects, hooks, state."""
    return [
        (
            name,
            type(m),
            tuple((n, id(p)) for n, p in m._parameters.items()),
            tuple((n, id(b)) for n, b in m._buffers.items()),
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            sorted(m.__dict__),
        )
        for name, m in model.named_modules()
    ]


def _assert_rejected(model: nn.Module, call: Callable[[], Any], error: type, match: str) -> None:
    before = _snapshot(model)
    with pytest.raises(error, match=match):
        call()
    assert _snapshot(model) == before


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


@pytest.mark.parametrize("bad", [42, [], [nn.Linear(2, 2), "not a module"]])
def test_non_module_argument(bad: Any) -> None:
    with fake_mesh(2) as mesh, pytest.raises(TypeError, match="nn.Module"):
        fully_shard(bad, mesh=mesh)


def test_fully_shard_twice_on_one_module() -> None:
    model = _mlp()
    with fake_mesh(2) as mesh:
        fully_shard(model, mesh=mesh)
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "already applied to this Sequential.*fully_shard\\(\\[module_a, module_b\\]\\)",
        )


def test_submodule_of_an_already_sharded_module() -> None:
    model = _mlp()
    with fake_mesh(2) as mesh:
        fully_shard(model, mesh=mesh)
        _assert_rejected(
            model, lambda: fully_shard(model[0], mesh=mesh), ValueError,
            "parameter 'weight' is already a DTensor",
        )
        assert not isinstance(model[0], FSDPModule)


def test_parameter_shared_across_groups_names_it_and_the_fix() -> None:
    model = _mlp()
    model[2].weight = nn.Parameter(torch.randn(6, 6))
    model.add_module("tied", nn.Linear(6, 6, bias=False))
    model.tied.weight = model[2].weight
    with fake_mesh(2) as mesh:
        fully_shard(model[2], mesh=mesh)
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "'tied.weight' is shared with a parameter already managed by another FSDP group.*as 'weight of Linear'.*common ancestor",
        )


def test_parameter_on_another_device_than_the_mesh() -> None:
    model = _mlp()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model[2].weight = nn.Parameter(torch.empty(2, 6, device="cuda"))
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "parameter '2.weight' is on cuda:0, but the mesh's device is cpu.*module.to",
        )


def test_meta_and_real_parameters_mixed_in_one_group() -> None:
    model = _mlp()
    model[0].weight = nn.Parameter(torch.empty(6, 4, device="meta"))
    with fake_mesh(2) as mesh:
        _assert_rejected(model, lambda: fully_shard(model, mesh=mesh), ValueError, "meta device")


def test_zero_dim_parameter_points_to_ignored_params() -> None:
    model = _mlp()
    model.temperature = nn.Parameter(torch.tensor(1.0))
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), ValueError,
            "doesn't support scalar parameters. Change temperature to a 1D tensor with numel "
            "equal to 1.*'temperature' is 0-dimensional.*ignored_params",
        )
        fully_shard(model, mesh=mesh, ignored_params={model.temperature})
        assert type(model.temperature) is nn.Parameter and model.temperature.dim() == 0


def test_trainable_parameters_of_different_dtypes_in_one_group() -> None:
    model = _mlp()
    model[0].bias = nn.Parameter(torch.zeros(6, dtype=torch.float64))
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh), NotImplementedError,
            "'0.bias' \\(torch.float64\\).*separate fully_shard calls",
        )


@pytest.mark.parametrize("value", [3, 0, -2])
def test_reshard_after_forward_int_must_divide_the_world_size(value: int) -> None:
    model = _mlp()
    with fake_mesh(4) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, reshard_after_forward=value),
            ValueError, f"reshard_after_forward={value} must be a divisor of the shard world size 4",
        )
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, reshard_after_forward="yes"),
            TypeError, "must be a bool, an int or None",
        )


def test_mesh_must_be_a_1d_or_2d_device_mesh() -> None:
    model = _mlp()
    with fake_mesh(8):
        _assert_rejected(
            model, lambda: fully_shard(model, mesh="cpu"), TypeError, "DeviceMesh"
        )
        mesh_3d = DeviceMesh("cpu", torch.arange(8).view(2, 2, 2))
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh_3d), ValueError,
            "but got DeviceMesh.*\\(3-D\\).*1-D mesh \\(FSDP\\) or a 2-D "
            "\\(replicate, shard\\) mesh",
        )


def test_prefetch_targets_must_be_fsdp_modules() -> None:
    model = _mlp()
    with fake_mesh(2) as mesh:
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        with pytest.raises(ValueError, match="modules passed to fully_shard, got Linear"):
            model.set_modules_to_forward_prefetch([model[2]])


def test_parameter_shared_between_sibling_groups() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    model[1].weight = model[0].weight
    with fake_mesh(2) as mesh:
        fully_shard(model[0], mesh=mesh)
        _assert_rejected(  # model[1] cannot see model[0]: they are siblings
            model, lambda: fully_shard(model[1], mesh=mesh), ValueError,
            "parameter 'weight' is shared with a parameter already managed.*'weight of Linear'.*fully_shard\\(\\[module_a",
        )


def test_dp_mesh_dims_needs_dtensor_params_on_the_full_mesh() -> None:
    model = _mlp()
    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
            ValueError, "parameter '0.weight' is a plain tensor; with dp_mesh_dims every parameter must be a DTensor",
        )
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp")),
            ValueError, "dp_mesh_dims names \\['fsdp'\\], which mesh",
        )
        _assert_rejected(
            model, lambda: fully_shard(model, dp_mesh_dims=DataParallelMeshDims(shard="dp")),
            ValueError, "pass the full SPMD mesh",
        )
        _assert_rejected(
            model,
            lambda: fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard=("dp", "tp"))),
            NotImplementedError, "flattening several mesh axes",
        )


# Same misuse, same exception as torch's fully_shard #
#
# Each case builds a model and fully_shard's kwargs on a fake group, runs torch's
# fully_shard and ours on separate copies, and checks that ours raises torch's type (or
# a subclass) with torch's key phrase in the message, and leaves the module untouched.
# The phrase is asserted in torch's message too, so a torch that words it differently
# shows up here rather than as a silently weaker test.

Case = Callable[[DeviceMesh], tuple[Callable[[], nn.Module], dict[str, Any]]]


def _scalar_parameter(mesh: DeviceMesh):
    def build() -> nn.Module:
        model = _mlp()
        model.temperature = nn.Parameter(torch.tensor(1.0))
        return model

    return build, {"mesh": mesh}


def _non_contiguous_parameter(mesh: DeviceMesh):
    def build() -> nn.Module:
        model = _mlp()
        model[0].weight = nn.Parameter(torch.randn(4, 6).t())  # (6, 4), strides (1, 6)
        return model

    return build, {"mesh": mesh}


def _three_dimensional_mesh(mesh: DeviceMesh):
    return _mlp, {"mesh": DeviceMesh("cpu", torch.arange(8).view(2, 2, 2))}


def _two_dimensional_mesh_without_names(mesh: DeviceMesh):
    return _mlp, {"mesh": DeviceMesh("cpu", torch.arange(4).view(2, 2))}


def _placement_fn(result: Callable[[nn.Parameter], Any], build=_mlp) -> Case:
    return lambda mesh: (build, {"mesh": mesh, "shard_placement_fn": result})


def _tp_mesh_overlapping_the_dp_mesh(mesh: DeviceMesh):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    dp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]
    # Transposed: its "tp" groups are ranks {0, 2} and {1, 3}, which is dp_mesh's axis.
    tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))["tp"]

    def build() -> nn.Module:
        return parallelize_module(_mlp(), tp_mesh, {"0": ColwiseParallel()})

    return build, {"mesh": dp_mesh}


MISUSES: dict[str, tuple[int, Case, type, str]] = {
    # name: (world size, case, torch's exception type, torch's key phrase)
    # torch names the parameter as registered on its module; here that is its FQN too.
    "scalar_parameter": (
        2, _scalar_parameter, ValueError,
        "fully_shard doesn't support scalar parameters. Change temperature to a 1D tensor "
        "with numel equal to 1.",
    ),
    "non_contiguous_parameter": (
        2, _non_contiguous_parameter, NotImplementedError,
        "FSDP does not support non-contiguous parameters yet",
    ),
    "three_dimensional_mesh": (
        8, _three_dimensional_mesh, ValueError,
        "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh",
    ),
    "two_dimensional_mesh_without_names": (
        4, _two_dimensional_mesh_without_names, AssertionError,
        "Please init the 2D mesh for HSDP with mesh_dim_names specified",
    ),
    "placement_fn_returns_replicate": (
        2, _placement_fn(lambda p: Replicate()), ValueError, "Invalid shard_placement_fn result"
    ),
    "placement_fn_returns_an_int": (
        2, _placement_fn(lambda p: 1), ValueError, "Invalid shard_placement_fn result"
    ),
    "placement_fn_dim_out_of_range": (
        2, _placement_fn(lambda p: Shard(2)), AssertionError, "Shard dim 2 is invalid for 2D tensor"
    ),
    # torch normalizes -3 to -1 and fails later, in DTensorSpec ("Shard dim -1 in
    # placements ... must be normalized"); what both messages share is "Shard dim".
    "placement_fn_negative_dim_out_of_range": (
        2, _placement_fn(lambda p: Shard(-3)), AssertionError, "Shard dim"
    ),
    "placement_fn_uneven_dim_1": (
        2,
        _placement_fn(lambda p: Shard(1) if p.dim() == 2 else None, lambda: nn.Linear(3, 4)),
        NotImplementedError,
        "FSDP does not support uneven sharding on dim 1",
    ),
    "tp_mesh_overlapping_the_dp_mesh": (
        4, _tp_mesh_overlapping_the_dp_mesh, RuntimeError, "Cannot concatenate overlapping meshes"
    ),
}


@pytest.mark.parametrize("name", list(MISUSES))
def test_misuse_raises_torchs_exception_and_key_phrase(name: str) -> None:
    world_size, case, torch_error, phrase = MISUSES[name]
    with fake_mesh(world_size) as mesh:
        build, kwargs = case(mesh)
        with pytest.raises(Exception) as theirs:
            torch_fully_shard(build(), **kwargs)
        assert type(theirs.value) is torch_error and phrase in str(theirs.value), theirs.value
        model = build()
        before = _snapshot(model)
        with pytest.raises(torch_error) as ours:
            fully_shard(model, **kwargs)
        assert phrase in str(ours.value)
        assert _snapshot(model) == before


# shard_placement_fn returning torch's ShardPlacementResult #


def _one_mesh_info(mesh: DeviceMesh) -> Any:
    """torch's mesh info for ``mesh``, as its users build it (FSDP or HSDP)."""
    if mesh.ndim == 1:
        return FSDPMeshInfo(mesh, shard_mesh_dim=0)
    return HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)


def _layout(model: nn.Module) -> dict[str, tuple]:
    return {
        name: (p.device_mesh, tuple(p.placements), tuple(p.to_local().shape))
        for name, p in model.named_parameters()
    }


@pytest.mark.parametrize("shape", [(4,), (2, 2)], ids=["fsdp", "hsdp"])
def test_shard_placement_result_on_the_groups_mesh_matches_torch(shape: tuple) -> None:
    with fake_mesh(4):
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        mesh = DeviceMesh("cpu", torch.arange(4).view(shape), mesh_dim_names=names)
        info = _one_mesh_info(mesh)  # one object for every parameter, as torch requires

        def placement(param: nn.Parameter) -> Any:
            return ShardPlacementResult(Shard(1) if param.dim() == 2 else None, info)

        layouts = []
        for impl in (fully_shard, torch_fully_shard):
            model = nn.Linear(8, 6)
            impl(model, mesh=mesh, shard_placement_fn=placement)
            layouts.append(_layout(model))
    assert layouts[0] == layouts[1]
    assert layouts[0]["weight"][1][-1] == Shard(1)


def test_shard_placement_result_on_another_mesh_makes_a_second_group() -> None:
    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4))
        expert_mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("ep", "dp"))
        expert_info = FSDPMeshInfo(expert_mesh["dp"], shard_mesh_dim=0)

        def placement(param: nn.Parameter) -> Any:
            return ShardPlacementResult(Shard(1), expert_info) if param.dim() == 2 else None

        # torch and ours make a second parameter group, on the other mesh, within one
        # call, ordered by their first parameters: the weights' group first.
        theirs, ours = _mlp(), _mlp()
        torch_fully_shard(theirs, mesh=mesh, shard_placement_fn=placement)
        fully_shard(ours, mesh=mesh, shard_placement_fn=placement)
        their_groups = torch_fully_shard.state(theirs)._fsdp_param_groups
        our_groups = ours._get_fsdp_state().groups
        assert [len(g.fsdp_params) for g in our_groups] == [
            len(g.fsdp_params) for g in their_groups
        ] == [2, 2]
        for name, param in ours.named_parameters():
            their = dict(theirs.named_parameters())[name]
            assert (param.device_mesh, param.placements, param.to_local().shape) == (
                their.device_mesh, their.placements, their.to_local().shape,
            ), name
        assert ours[0].weight.device_mesh == expert_mesh["dp"]
        assert ours[0].weight.placements == (Shard(1),)
        assert ours[0].bias.device_mesh == mesh


def test_shard_placement_result_on_the_call_mesh_joins_its_group() -> None:
    # A ShardPlacementResult on the mesh passed to fully_shard, beside parameters that
    # returned None: torch wants the very FSDPMeshInfo object it built and raises
    # (README, differences); ours puts them in one group, as their process groups are.
    with fake_mesh(2) as mesh:
        info = FSDPMeshInfo(mesh, shard_mesh_dim=0)

        def placement(param: nn.Parameter) -> Any:
            return ShardPlacementResult(Shard(0), info) if param.dim() == 1 else None

        with pytest.raises(ValueError, match="same FSDPMeshInfo object"):
            torch_fully_shard(_mlp(), mesh=mesh, shard_placement_fn=placement)
        model = fully_shard(_mlp(), mesh=mesh, shard_placement_fn=placement)
        assert [len(g.fsdp_params) for g in model._get_fsdp_state().groups] == [4]


def test_shard_placement_result_without_a_usable_mesh_info() -> None:
    model = _mlp()
    bad = ShardPlacementResult(Shard(0), mesh_info=None)
    with fake_mesh(2) as mesh:
        _assert_rejected(
            model, lambda: fully_shard(model, mesh=mesh, shard_placement_fn=lambda p: bad),
            ValueError, "'0.weight': Invalid shard_placement_fn result.*FSDPMeshInfo",
        )


# share_comm_ctx #


@pytest.mark.parametrize("which", ["plain_module", "string"])
def test_share_comm_ctx_refuses_what_is_not_an_fsdp_module(which: str) -> None:
    with fake_mesh(2) as mesh:
        impls = ((fully_shard, share_comm_ctx), (torch_fully_shard, torch_share_comm_ctx))
        for impl, share in impls:
            root = impl(_mlp(), mesh=mesh)
            bad = nn.Linear(2, 2) if which == "plain_module" else "model"
            share([])  # nothing to share: fine in both
            share([root])
            with pytest.raises(ValueError, match="Expects list of FSDPModules"):
                share([root, bad])


# set_reduce_scatter_max_input_buffers #


@pytest.mark.parametrize(
    "bad, error, phrase",
    [
        (True, TypeError, "max_input_buffers must be an int, got bool"),
        (2.0, TypeError, "max_input_buffers must be an int, got float"),
        (0, ValueError, "max_input_buffers must be a positive int, got 0"),
        (-1, ValueError, "max_input_buffers must be a positive int, got -1"),
    ],
)
def test_reduce_scatter_max_input_buffers_refuses_what_torch_refuses(
    bad: Any, error: type, phrase: str
) -> None:
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            root = impl(_mlp(), mesh=mesh)
            with pytest.raises(error, match=phrase):
                root.set_reduce_scatter_max_input_buffers(bad)


# A sharded parameter replaced after fully_shard #
#
# torch's FSDP2 adopts a replacing nn.Parameter(DTensor) with the sharded param's layout
# at lazy init, and so do we (tests/runtime/test_replaced_param.py). What cannot be adopted
# torch fails on inside its padding code (an AttributeError or a RuntimeError), or, for
# a tie made after fully_shard, accepts: it then all-gathers the tied values twice, with
# a wrong result when the shard is padded. Ours refuses each with a ValueError at lazy
# init that says what the replacement must be, before adopting anything.


def _replace_with_plain(model: nn.Module, mesh: DeviceMesh) -> None:
    model[0].bias = nn.Parameter(torch.zeros(6))


def _replace_with_replicate(model: nn.Module, mesh: DeviceMesh) -> None:
    model[0].bias = nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Replicate()]))


def _replace_with_other_shape(model: nn.Module, mesh: DeviceMesh) -> None:
    model[0].bias = nn.Parameter(distribute_tensor(torch.zeros(8), mesh, [Shard(0)]))


def _tie(model: nn.Module, mesh: DeviceMesh) -> None:
    model[2].weight = model[0].weight


def _square_mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))


REPLACEMENTS: dict[str, tuple[Callable[[], nn.Module], bool, Callable[..., None], Any, str]] = {
    # name: (model, shard model[0] on its own, replacement, torch's outcome, our phrase)
    "plain_parameter": (
        _mlp, False, _replace_with_plain, AttributeError,
        "'0.bias' was replaced after fully_shard by a Parameter, not an nn.Parameter "
        "wrapping a DTensor",
    ),
    "replicated_dtensor": (
        _mlp, False, _replace_with_replicate, RuntimeError,
        "'0.bias' was replaced after fully_shard by a DTensor of global shape \\(6,\\), "
        "local shape \\(6,\\), placements \\(Replicate\\(\\),\\).*local shape \\(3,\\), "
        "placements \\(Shard\\(dim=0\\),\\)",
    ),
    "other_global_shape": (
        _mlp, False, _replace_with_other_shape, RuntimeError,
        "'0.bias' was replaced after fully_shard by a DTensor of global shape \\(8,\\).*"
        "global shape \\(6,\\)",
    ),
    "tie_within_a_group": (
        _square_mlp, False, _tie, None,
        "'2.weight' was replaced after fully_shard by the sharded parameter '0.weight' "
        "\\(a tie made after fully_shard\\). Tie parameters before fully_shard",
    ),
    "tie_across_groups": (
        _square_mlp, True, _tie, None,
        "'2.weight' was replaced after fully_shard by the sharded parameter '0.weight'",
    ),
}


@pytest.mark.parametrize("name", list(REPLACEMENTS))
def test_replaced_parameter_that_cannot_be_adopted(name: str) -> None:
    build, nested, replace, torch_outcome, phrase = REPLACEMENTS[name]
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        models = {}
        for impl in (torch_fully_shard, fully_shard):
            model = build()
            if nested:
                impl(model[0], mesh=mesh)
            models[impl] = impl(model, mesh=mesh)
            replace(model, mesh)
        theirs = None
        try:
            models[torch_fully_shard](inp)
        except Exception as error:
            theirs = type(error)
        assert theirs is torch_outcome, f"torch's premise: {theirs}"
        model = models[fully_shard]
        registered = [m._parameters.copy() for m in model.modules()]
        sharded = [
            p.sharded_param for s in model._fsdp_states(True) for p in s.fsdp_params()
        ]
        with pytest.raises(ValueError, match=phrase):
            model(inp)
        # Nothing adopted: the user's replacement is still registered, FSDP's own
        # sharded params are unchanged, and no state became a root.
        assert [m._parameters.copy() for m in model.modules()] == registered
        states = model._fsdp_states(True)
        assert [p.sharded_param for s in states for p in s.fsdp_params()] == sharded
        assert all(s.ctx is None for s in states)


def test_replaced_parameter_with_the_sharded_layout_is_adopted_after_a_refusal() -> None:
    """The fix the message names: an nn.Parameter(DTensor) with the sharded layout."""
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        model = fully_shard(_mlp(), mesh=mesh)
        _replace_with_replicate(model, mesh)
        with pytest.raises(ValueError, match="was replaced after fully_shard"):
            model(inp)
        fixed = nn.Parameter(distribute_tensor(torch.zeros(6), mesh, [Shard(0)]))
        model[0].bias = fixed
        model(inp).sum().backward()
        assert model[0].bias is fixed and fixed.grad is not None


def test_tie_across_groups_made_after_lazy_init_is_refused() -> None:
    """The same tie as ``tie_across_groups``, made after the first step: torch's accepts
    it (and all-gathers the tied values in both groups); ours refuses it at the next
    all-gather, naming the owner, as at lazy init."""
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            model = _square_mlp()
            impl(model[0], mesh=mesh)
            impl(model, mesh=mesh)
            model(inp).sum().backward()
            _tie(model, mesh)
            if impl is torch_fully_shard:
                model(inp).sum().backward()  # torch's premise: accepted
                continue
            with pytest.raises(ValueError, match="'2.weight' was replaced after fully_shard "
                               "by the sharded parameter '0.weight'"):
                model(inp)


def test_parameter_replaced_while_kept_unsharded_is_adopted() -> None:
    """After a no_grad forward the root keeps its unsharded params (as torch's). A
    sharded-layout replacement registered then is adopted at the next forward; torch's
    computes with it beside its own unsharded params and fails."""
    inp = torch.randn(2, 4)
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            model = _square_mlp()
            impl(model[0], mesh=mesh)
            impl(model, mesh=mesh)
            with torch.no_grad():
                model(inp)
            fixed = nn.Parameter(distribute_tensor(torch.ones(4, 4), mesh, [Shard(0)]))
            model[2].weight = fixed
            if impl is torch_fully_shard:
                with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
                    model(inp)
                continue
            model(inp).sum().backward()
            assert model[2].weight is fixed and fixed.grad is not None
            assert torch.equal(fixed.to_local(), torch.ones(2, 4))


# Communication setters #


class _NoAllGather(AllGather):
    """A custom all-gather that is never called: only set_* calls are under test."""

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        raise AssertionError("not called in these tests")


class _NoReduceScatter(ReduceScatter):
    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        raise AssertionError("not called in these tests")


def _custom_all_gather(root: nn.Module) -> None:
    root.set_custom_all_gather(_NoAllGather())


def _custom_reduce_scatter(root: nn.Module) -> None:
    root.set_custom_reduce_scatter(_NoReduceScatter())


SETTER_MISUSES: dict[str, tuple[Callable[[nn.Module], None] | None, Callable, type, str]] = {
    # name: (set up first, the call, torch's exception type, torch's key phrase)
    "allocate_after_a_custom_all_gather": (
        _custom_all_gather,
        lambda root: root.set_allocate_memory_from_process_group_for_comm(True),
        AssertionError,
        "cannot call set_allocate_memory_from_process_group() when all gather comm is "
        "custom: _NoAllGather",
    ),
    "allocate_after_a_custom_reduce_scatter": (
        _custom_reduce_scatter,
        lambda root: root.set_allocate_memory_from_process_group_for_comm(False),
        AssertionError,
        "cannot call set_allocate_memory_from_process_group() when reduce scatter comm is "
        "custom: _NoReduceScatter",
    ),
    "symm_mem_after_a_custom_all_gather": (
        _custom_all_gather,
        lambda root: root.set_symm_mem_for_comm(),
        AssertionError,
        "cannot call set_symm_mem() when all gather comm is custom: _NoAllGather",
    ),
    "symm_mem_unknown_backend": (
        None,
        lambda root: root.set_symm_mem_for_comm("GLOO"),
        RuntimeError,
        "SymmetricMemory does not find allocation backend GLOO",
    ),
}


@pytest.mark.parametrize("name", list(SETTER_MISUSES))
def test_comm_setter_misuse_raises_torchs_exception_and_key_phrase(name: str) -> None:
    set_up, call, torch_error, phrase = SETTER_MISUSES[name]
    with fake_mesh(2) as mesh:
        for impl in (torch_fully_shard, fully_shard):
            root = impl(_mlp(), mesh=mesh)
            if set_up is not None:
                set_up(root)
            with pytest.raises(torch_error) as raised:
                call(root)
            assert phrase in str(raised.value), f"{impl.__module__}: {raised.value}"
            if impl is fully_shard:
                assert isinstance(raised.value, ValueError)  # a user mistake, too


def test_all_reduce_hook_stream_is_refused_for_native_hsdp() -> None:
    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("r", "s"))
        for impl in (torch_fully_shard, fully_shard):
            root = impl(_mlp(), mesh=mesh)
            with pytest.raises(ValueError, match="stream cannot be set when using native HSDP"):
                root.set_all_reduce_hook(lambda t: None, stream=torch.cpu.Stream())
        # Without a stream the hook is accepted on HSDP (it runs after the all-reduce).
        root.set_all_reduce_hook(lambda t: None)


def test_all_reduce_hook_stream_without_a_hook() -> None:
    phrase = "all reduce hook stream is specified but hook itself is missing"
    with fake_mesh(2) as mesh:
        # torch accepts the call and raises at the first backward; ours at the call.
        theirs = torch_fully_shard(_mlp(), mesh=mesh)
        theirs.set_all_reduce_hook(None, stream=torch.cpu.Stream())
        with pytest.raises(AssertionError, match=phrase):
            theirs(torch.randn(2, 4)).sum().backward()
        ours = fully_shard(_mlp(), mesh=mesh)
        with pytest.raises(AssertionError, match=phrase):
            ours.set_all_reduce_hook(None, stream=torch.cpu.Stream())
        ours(torch.randn(2, 4)).sum().backward()  # nothing was set


# One call on several meshes: what torch refuses or checks there #


class _Experts(nn.Module):
    """Experts registered before the dense child: torch orders the groups by the
    post-order of modules, so the dense group comes first."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.Parameter(torch.randn(4, 8, 8))
        self.dense = nn.Linear(8, 8)


def _two_meshes() -> tuple[DeviceMesh, DeviceMesh, Callable[[nn.Module], Callable[..., Any]]]:
    dp = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("dp",))
    efsdp = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("ep", "efsdp"))["efsdp"]
    dp_info, efsdp_info = FSDPMeshInfo(dp, shard_mesh_dim=0), FSDPMeshInfo(efsdp, shard_mesh_dim=0)

    def placement(block: nn.Module) -> Callable[..., Any]:
        return lambda p: ShardPlacementResult(
            Shard(0), efsdp_info if p is block.experts else dp_info
        )

    return dp, efsdp, placement


@pytest.mark.parametrize(
    "setter",
    [
        lambda m: m.set_custom_all_gather(object()),
        lambda m: m.set_custom_reduce_scatter(object()),
        lambda m: m.set_all_reduce_hook(lambda t: None),
    ],
    ids=["set_custom_all_gather", "set_custom_reduce_scatter", "set_all_reduce_hook"],
)
def test_custom_comms_are_refused_on_a_call_on_several_meshes(setter: Callable[..., Any]) -> None:
    # A custom collective or hook is written for one process group: torch refuses it on
    # a module whose call made groups on several meshes, with this phrase.
    with fake_mesh(4):
        dp, _, placement = _two_meshes()
        for shard in (torch_fully_shard, fully_shard):
            block = _Experts()
            shard(block, mesh=dp, shard_placement_fn=placement(block))
            with pytest.raises(ValueError, match="not supported with multiple param groups"):
                setter(block)


def test_int_reshard_after_forward_is_checked_against_the_call_mesh() -> None:
    # torch checks the post-forward size against the mesh passed to fully_shard, even
    # when no parameter ends up on it; then against each group's mesh.
    with fake_mesh(4):
        dp, efsdp, placement = _two_meshes()
        dp_info = FSDPMeshInfo(dp, shard_mesh_dim=0)
        calls = {
            "no parameters": lambda shard: shard(nn.ReLU(), mesh=dp, reshard_after_forward=3),
            "all on another mesh": lambda shard: shard(
                _Experts(), mesh=efsdp, reshard_after_forward=4,
                shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), dp_info),
            ),
            "fits one mesh only": lambda shard: shard(
                (b := _Experts()), mesh=dp, reshard_after_forward=4, shard_placement_fn=placement(b)
            ),
        }
        for name, call in calls.items():
            for shard in (torch_fully_shard, fully_shard):
                with pytest.raises(ValueError, match="factor of"):
                    call(shard)
                    pytest.fail(f"{name}: {shard.__module__} accepted it")


def test_group_names_tell_a_calls_groups_apart() -> None:
    # The comm trace and the divergence check name groups: a call's groups on two
    # meshes whose shard axes share a name get distinct names, the root's no blank.
    with fake_mesh(4):
        dp = DeviceMesh("cpu", torch.arange(4), mesh_dim_names=("x",))
        other = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("r", "x"))["x"]
        info = FSDPMeshInfo(other, shard_mesh_dim=0)
        block = _Experts()
        fully_shard(block, mesh=dp, shard_placement_fn=lambda p: (
            ShardPlacementResult(Shard(0), info) if p is block.experts else None
        ))
        block.set_comm_trace(None)  # names the groups from this root
        assert [g.fqn for g in block._get_fsdp_state().groups] == ["[x#0]", "[x#1]"]


def test_torchs_data_parallel_mesh_dims_is_accepted() -> None:
    # A user switching the import line keeps torch's DataParallelMeshDims objects.
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims

    with fake_mesh(4):
        mesh = DeviceMesh("cpu", torch.arange(4).view(2, 2), mesh_dim_names=("dp", "tp"))
        layouts = []
        for shard in (torch_fully_shard, fully_shard):
            model = _mlp()
            for name, param in list(model.named_parameters()):
                module_name, attr = name.rsplit(".", 1)
                model.get_submodule(module_name).register_parameter(
                    attr, nn.Parameter(distribute_tensor(param.detach(), mesh, [Replicate()] * 2))
                )
            shard(model, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
            layouts.append({n: (p.placements, p.to_local().shape) for n, p in model.named_parameters()})
        assert layouts[0] == layouts[1]
