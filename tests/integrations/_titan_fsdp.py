"""torchtitan's FSDP calls for a decoder, as ``torchtitan/distributed/fsdp.py`` makes them,
with the ``fully_shard`` of either torch or dtensor_fsdp passed in.

``apply_fsdp_to_decoder`` is torchtitan's function of that name, line for line in what
it calls (the non-weight-tied path, no CPU offload, no PP, the partial_dtensor meshes:
``dp_mesh_dims``/``edp_mesh_dims`` None, symmetric memory off). What changes:

- ``fully_shard``, ``FSDPModule`` and ``MixedPrecisionPolicy`` come from ``Impl``, the
  implementation under test. The per-parameter mesh of the EP > 1 branch is built, for
  both implementations, from torch's own ``FSDPMeshInfo``, ``ShardPlacementResult``
  and ``_get_mesh_info``, as torchtitan imports them.
- ``disable_fsdp_gradient_division`` also calls ``set_force_sum_reduction_for_comms``:
  torch's FSDP2 turns ``set_gradient_divide_factor(1.0)`` into ``PREMUL_SUM``, which
  gloo rejects ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); torchtitan's
  symmetric-memory helper sets the same
  flag for its own reasons. The reduction is a SUM either way.

``titan_meshes`` is torchtitan's ``ParallelDims.build_mesh`` for ``dp_shard = world``,
``dp_replicate = cp = tp = pp = 1``: one 1-D world mesh ``_unflatten``-ed once into the
dense view ``(pp, dp_replicate, fsdp, tp)`` and once into the sparse view
``(pp, dp_replicate, efsdp, ep)`` with ``efsdp = world / ep``; size-1 axes get torch's
``"fake"`` backend, ``efsdp`` a real one whenever EP > 1.
"""

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
from torch.distributed.tensor import Shard


@dataclass(frozen=True)
class Impl:
    name: str
    fully_shard: Any
    fsdp_module: type
    mp_policy: type


@dataclass(frozen=True)
class TitanMeshes:
    dp: DeviceMesh  # the dense "fsdp" axis: every rank
    efsdp: DeviceMesh | None  # the experts' FSDP axis, when EP > 1
    ep: DeviceMesh | None  # the expert-parallel axis, when EP > 1


def titan_meshes(world_size: int, ep: int) -> TitanMeshes:
    world = init_device_mesh("cpu", (world_size,), mesh_dim_names=("world",))

    def unflatten(names: tuple[str, ...], sizes: tuple[int, ...], real: set[str]) -> DeviceMesh:
        fake = {n: "fake" for n, s in zip(names, sizes, strict=True) if s == 1 and n not in real}
        return world._unflatten(0, sizes, names, backend_override=fake)

    dense = unflatten(("pp", "dp_replicate", "fsdp", "tp"), (1, 1, world_size, 1), {"fsdp"})
    if ep == 1:
        return TitanMeshes(dense["fsdp"], None, None)
    sparse = unflatten(
        ("pp", "dp_replicate", "efsdp", "ep"), (1, 1, world_size // ep, ep), {"efsdp"}
    )
    return TitanMeshes(dense["fsdp"], sparse["efsdp"], sparse["ep"])


def disable_fsdp_gradient_division(model: nn.Module, impl: Impl) -> None:
    for module in model.modules():
        if isinstance(module, impl.fsdp_module):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo: see the module docstring


def apply_fsdp_to_decoder(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    impl: Impl,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    ep_degree: int = 1,
    edp_mesh: DeviceMesh | None = None,
) -> None:
    mp_policy = impl.mp_policy(
        param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False
    )
    fsdp_config: dict[str, Any] = {"mesh": dp_mesh, "mp_policy": mp_policy}
    reshard_after_forward = True  # torchtitan's "default" policy without PP
    fully_shard = impl.fully_shard

    fully_shard(model.tok_embeddings, **fsdp_config, reshard_after_forward=reshard_after_forward)
    # As torchtitan: the last layers are not resharded ("default" is not "always").
    fully_shard([model.norm, model.lm_head], **fsdp_config, reshard_after_forward=False)

    for transformer_block in model.layers.values():
        if getattr(transformer_block, "moe_enabled", False):
            experts = transformer_block.moe.routed_experts.inner_experts
            expert_params = set(experts.parameters())
            num_experts = experts.num_experts
            if ep_degree > 1:
                assert edp_mesh is not None
                efsdp_ep_size = edp_mesh["efsdp"].size() * ep_degree
            else:
                efsdp_ep_size = fsdp_config["mesh"].size()
            expert_shard_placement = Shard(1) if efsdp_ep_size > num_experts else Shard(0)

            if ep_degree == 1 and expert_shard_placement == Shard(0):
                fully_shard(
                    transformer_block, **fsdp_config, reshard_after_forward=reshard_after_forward
                )
            elif ep_degree == 1:

                def _experts_shard_placement_fn(
                    param: nn.Parameter, _expert_params: set = expert_params
                ) -> Shard | None:
                    return Shard(1) if param in _expert_params else None

                fully_shard(
                    transformer_block,
                    **fsdp_config,
                    reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=_experts_shard_placement_fn,
                )
            else:
                assert edp_mesh is not None
                edp_mesh_info = _get_mesh_info(edp_mesh, None)
                dp_mesh_info = _get_mesh_info(dp_mesh, None)
                assert isinstance(edp_mesh_info, FSDPMeshInfo)
                assert isinstance(dp_mesh_info, FSDPMeshInfo)

                def _shard_placement_fn(
                    param: nn.Parameter,
                    _expert_params: set = expert_params,
                    _expert_placement: Shard = expert_shard_placement,
                    _edp_mesh_info: FSDPMeshInfo = edp_mesh_info,
                    _dp_mesh_info: FSDPMeshInfo = dp_mesh_info,
                ) -> ShardPlacementResult:
                    if param in _expert_params:
                        return ShardPlacementResult(
                            placement=_expert_placement, mesh_info=_edp_mesh_info
                        )
                    return ShardPlacementResult(placement=Shard(0), mesh_info=_dp_mesh_info)

                fully_shard(
                    transformer_block,
                    **fsdp_config,
                    reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=_shard_placement_fn,
                )
        else:
            fully_shard(
                transformer_block, **fsdp_config, reshard_after_forward=reshard_after_forward
            )

    fully_shard(model, **fsdp_config)
    disable_fsdp_gradient_division(model, impl)

    # torchtitan: explicit prefetching when EP is enabled (its D2H syncs could interfere
    # with FSDP's implicit prefetching).
    if ep_degree == 1:
        return
    transformer_blocks = list(model.layers.values())
    next_transformer_blocks = transformer_blocks[1:] + [None]
    model.tok_embeddings.set_modules_to_forward_prefetch([transformer_blocks[0]])
    for transformer_block, next_transformer_block in zip(
        transformer_blocks, next_transformer_blocks
    ):
        if next_transformer_block is not None:
            transformer_block.set_modules_to_forward_prefetch([next_transformer_block])
        else:
            transformer_block.set_modules_to_forward_prefetch([model.norm, model.lm_head])
    reversed_transformer_blocks = list(reversed(model.layers.values()))
    prev_transformer_blocks = reversed_transformer_blocks[1:] + [None]
    model.lm_head.set_modules_to_backward_prefetch([reversed_transformer_blocks[0]])
    for transformer_block, prev_transformer_block in zip(
        reversed_transformer_blocks, prev_transformer_blocks
    ):
        if prev_transformer_block is not None:
            transformer_block.set_modules_to_backward_prefetch([prev_transformer_block])
        else:
            transformer_block.set_modules_to_backward_prefetch([model.tok_embeddings])
