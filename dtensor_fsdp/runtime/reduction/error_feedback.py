"""Error feedback for quantized reduce-scatters (``CommPrecisionPolicy.error_feedback``).

Each quantized parameter keeps the quantization error of its last reduce-scatter and
adds it to the next one's input, so what encoding drops in one step is sent in the
next.

[Note: error-feedback residuals in state dicts] The residuals are training state, so
checkpoints carry them: with error feedback on, ``state_dict()`` of the module passed to
``fully_shard`` has one more entry per parameter that keeps a residual,
``<module>._fsdp_error_feedback.<param key>``, and only then (without error feedback the
keys are torch's ``fully_shard``'s). Its value is a DTensor of shape
``(data-parallel world size, *param shape)`` whose row ``k`` is data-parallel rank
``k``'s residual, in the parameter's shape (padding dropped): one ``Shard(0)`` per data
parallel mesh axis, the parameter's tensor-parallel placements one dim further right.
A rank's residual is the error of its whole contribution to the gradient sum, so any
data-parallel layout of the same world size can take it (DCP reshards the rows), and
the sum over the rows is what the next steps still owe the gradient. At another data
parallel world size the shape differs: the residuals cannot be split meaningfully, and
restart at zero (``dtensor_fsdp.checkpoint`` drops them with a warning; plain DCP raises
its size mismatch). Loading a parameter without its residual resets the residual to
zero (it belonged to the old values); a residual for a parameter that keeps none (error
feedback off, or filtered out) is ignored with a warning. The key's path is an attribute
path (``FSDPModule._fsdp_error_feedback``), as torch's ``get_state_dict`` requires of
every key.
"""

import warnings
from collections.abc import Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from ..param import FSDPParam
from ..shard_geometry import ShardGeometry, contiguous_stride

RESIDUALS_ATTR = "_fsdp_error_feedback"


class ErrorFeedback:
    """Per quantized param, its (W, padded chunk numel) fp32 quantization error of the
    last reduce-scatter."""

    def __init__(self) -> None:
        self._residuals: dict[FSDPParam, torch.Tensor] = {}

    def clear(self) -> None:
        """Drop every residual (another policy: other params, other formats)."""
        self._residuals.clear()

    def zero(self) -> None:
        """Restart every residual at zero, in place: graph mode's compiled backward
        holds the same tensors (graph/gather.py)."""
        for residual in self._residuals.values():
            residual.zero_()

    def reset(self, fsdp_param: FSDPParam) -> None:
        """Restart ``fsdp_param``'s residual at zero, in place (see `zero`)."""
        residual = self._residuals.get(fsdp_param)
        if residual is not None:
            residual.zero_()

    def residual(self, fsdp_param: FSDPParam) -> torch.Tensor:
        """``fsdp_param``'s residual, zeros the first time."""
        if fsdp_param not in self._residuals:
            # Row r: the error of this rank's contribution to rank r's shard.
            zeros = torch.zeros(
                (fsdp_param.geometry.world_size, fsdp_param.padded_shard_numel),
                dtype=torch.float32,
                device=fsdp_param.compute_device,
            )
            if zeros.is_meta:
                return zeros  # a state dict before to_empty: not kept, it has no storage
            self._residuals[fsdp_param] = zeros
        return self._residuals[fsdp_param]

    def residuals(
        self, params: Sequence[FSDPParam], is_quantized: Sequence[bool]
    ) -> list[torch.Tensor | None]:
        """Per param, its residual (zeros the first time), or None if it is exact."""
        return [
            self.residual(fsdp_param) if quantized else None
            for fsdp_param, quantized in zip(params, is_quantized, strict=True)
        ]


# State dicts: see [Note: error-feedback residuals in state dicts]


def residual_key(prefix: str, param_key: str) -> str:
    """The state-dict key of the residual of the parameter at ``prefix + param_key``
    (``prefix``: its ``fully_shard`` module's)."""
    return f"{prefix}{RESIDUALS_ATTR}.{param_key}"


def is_residual_key(key: str) -> bool:
    return RESIDUALS_ATTR in key.split(".")


def residual_state(fsdp_param: FSDPParam, residual: torch.Tensor) -> DTensor:
    """``residual`` as its state-dict value: this rank's row of a (dp world, *param
    shape) DTensor, a view of ``residual`` for a dim-0 sharded param."""
    local = _param_shaped(residual, fsdp_param.geometry).unsqueeze(0)  # (1, *shape)
    mesh, placements = residual_layout(fsdp_param)
    shape = (fsdp_param.mesh_info.mesh.size(), *fsdp_param.global_shape)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=contiguous_stride(shape)
    )


def residual_layout(fsdp_param: FSDPParam) -> tuple[DeviceMesh, tuple[Placement, ...]]:
    """The mesh and placements of ``fsdp_param``'s residual state: the sharded param's
    mesh, ``Shard(0)`` on its data-parallel axes (one row per data-parallel rank), its
    tensor-parallel placements on the others, one dim to the right."""
    layout = fsdp_param.layout
    dp_ndim = fsdp_param.mesh_info.mesh.ndim
    if layout.unsharded_placements is None:  # a plain param: the mesh is data parallel
        return layout.mesh, (Shard(0),) * dp_ndim
    if layout.unsharded_dp_axes:  # dp_mesh_dims: TP placements given on every axis
        tp = {
            axis: p
            for axis, p in enumerate(layout.unsharded_placements)
            if axis not in layout.unsharded_dp_axes
        }
    else:  # the data-parallel axes, then the TP mesh's
        tp = {dp_ndim + axis: p for axis, p in enumerate(layout.unsharded_placements)}
    return layout.mesh, tuple(
        _one_dim_right(tp[axis]) if axis in tp else Shard(0) for axis in range(layout.mesh.ndim)
    )


def _one_dim_right(placement: Placement) -> Placement:
    if isinstance(placement, _StridedShard):
        return _StridedShard(placement.dim + 1, split_factor=placement.split_factor)
    if isinstance(placement, Shard):
        return Shard(placement.dim + 1)
    assert isinstance(placement, Replicate), f"TP placement {placement}"
    return placement


def load_residual_state(fsdp_param: FSDPParam, residual: torch.Tensor, value: DTensor) -> None:
    """Copy ``value`` (a residual state in ``residual_layout``) into ``residual``."""
    geometry = fsdp_param.geometry
    local = value.to_local()[0]  # (*shape): this rank's row
    rows = _rows(residual, geometry)
    if geometry.dim == 0:
        padded = rows.flatten(0, 1)  # (W * chunk rows, *shape[1:]), a view
        # Copied before the padding is zeroed: `local` may be a view of `residual` (DCP
        # loads into the state dict's tensors in place).
        padded[: geometry.shape[0]].copy_(local)
        padded[geometry.shape[0] :].zero_()
    else:
        rows.copy_(local.unflatten(geometry.dim, (geometry.world_size, -1)))


def _rows(residual: torch.Tensor, geometry: ShardGeometry) -> torch.Tensor:
    """(W, padded chunk numel) as (*shape[:dim], W, padded shape[dim] / W,
    *shape[dim + 1:]), a view: the chunks back in their place along the shard dim."""
    return residual.view(geometry.world_size, *geometry.padded_local_shape).movedim(
        0, geometry.dim
    )


def _param_shaped(residual: torch.Tensor, geometry: ShardGeometry) -> torch.Tensor:
    """(W, padded chunk numel) as (*shape): a view for dim 0, a copy otherwise."""
    rows = _rows(residual, geometry).flatten(geometry.dim, geometry.dim + 1)
    return rows[: geometry.shape[0]]  # the padding rows (dim 0) hold zero error


def attribute_tree(states: Mapping[str, torch.Tensor]) -> SimpleNamespace:
    """``{"a.b.weight": t}`` as ``tree.a.b.weight is t``: what makes a residual's key an
    attribute path, as torch's ``get_state_dict`` walks every key."""
    tree = SimpleNamespace()
    for key, value in states.items():
        *path, name = key.split(".")
        node = tree
        for part in path:
            node = vars(node).setdefault(part, SimpleNamespace())
        setattr(node, name, value)
    return tree


def drop_unsaved_residuals(
    model_state: dict[str, Any], saved: Mapping[str, torch.Size], prefix: str
) -> None:
    """Before a checkpoint is read into ``model_state`` (its tensors' sizes ``saved``,
    under ``prefix + key``): remove the residuals that it does not hold at their size,
    which then restart at zero, and warn naming them, and the residuals it holds that
    this model keeps none for."""
    wanted = {key for key in model_state if is_residual_key(key)}
    missing = sorted(key for key in wanted if saved.get(prefix + key) != model_state[key].shape)
    unused = sorted(
        key[len(prefix) :]
        for key in saved
        if key.startswith(prefix) and is_residual_key(key) and key[len(prefix) :] not in wanted
    )
    for key in missing:
        del model_state[key]
    if missing:
        warnings.warn(
            f"error-feedback residuals restart at zero for {missing}: the checkpoint holds "
            "none of their shape (saved without error feedback for these params, or at "
            "another data-parallel world size)",
            stacklevel=2,
        )
    if unused:
        warnings.warn(
            f"error-feedback residuals of the checkpoint ignored for {unused}: this model "
            "keeps none for these params (error feedback off, filtered out, or one rank "
            "per shard group)",
            stacklevel=2,
        )
