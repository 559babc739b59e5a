"""Gradient norm and clipping of a sharded model on local tensors.

[Note: sharded grad norm]
A DTensor grad with ``Shard``/``Replicate`` placements stores each element on exactly
one coordinate of each sharded mesh axis and on every coordinate of each replicated
axis. So, for a p-norm, ``sum |x|^p`` over the whole tensor is the SUM, over the ranks
of its sharded axes, of the local sums; replicated axes must not be summed. Grads are
grouped by mesh, and each mesh gets one all-reduce over the union ``U`` of the axes
that shard any of its grads (FSDP: the FSDP axis; HSDP: the shard axis only; FSDP+TP:
both axes, where TP-replicated params such as norms are sharded by FSDP alone). A grad
whose sharded axes miss some of ``U`` (the norms under FSDP+TP) is counted only on the
ranks at coordinate 0 of those axes, so that the SUM over ``U`` counts it once, exactly
(no division by a replica count). The inf-norm is a MAX (-inf: MIN) over the same
group, where replicas do no harm. Local norms are ``torch._foreach_norm`` per device and
dtype, as in ``torch.nn.utils.clip_grad_norm_``; no DTensor op runs.

Plain (non-DTensor) grads are this rank's own: their norm enters the total after the
all-reduces, as ``torch.nn.utils.clip_grad_norm_`` counts them on a plain model.
"""

import math
import types
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..runtime.shard_geometry import wrap_local

try:
    from torch.utils._foreach_utils import _device_has_foreach_support
except ImportError:  # private: moved or gone in another torch release

    def _device_has_foreach_support(device: torch.device) -> bool:
        return device.type in ("cpu", "cuda", "xpu")


TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]


@dataclass
class _MeshTerms:
    """The local tensors of one mesh's DTensors that this rank counts in the norm."""

    device: torch.device  # of the first local tensor: where the all-reduce runs
    reduce_axes: set[int] = field(default_factory=set)  # U of [Note: sharded grad norm]
    counted: list[tuple[torch.Tensor, frozenset[int]]] = field(default_factory=list)


def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The norm of ``tensors`` (DTensors and plain tensors) viewed as one vector, as
    ``torch.nn.utils.get_total_norm`` computes it, from local tensors with one
    all-reduce per mesh (see [Note: sharded grad norm]).

    Args:
        tensors: a tensor or an iterable of tensors, e.g. the grads of a sharded model.
        norm_type: the p of the p-norm; ``inf`` (or ``'inf'``) for the max-norm.
        error_if_nonfinite: raise if the total norm is nan or +/-inf.
        foreach: use ``torch._foreach_norm`` (None: where the device supports it).

    Returns:
        The total norm: a DTensor with ``Replicate`` placements on the tensors' mesh when
        they are DTensors of exactly one mesh (torch's is a DTensor too, ``Replicate``,
        or ``Partial(max)`` for the inf-norm; ``.full_tensor()`` and ``.item()`` give
        the total for both, and ours' ``.to_local()`` too), else a plain 0-dim tensor;
        on every rank the same value. Its dtype is the grads' promoted dtype, as
        torch's. ``norm_type=0`` (torch counts the tensors holding a non-zero, which
        no sum of local terms gives) is computed by torch's own function.

    Raises:
        ValueError: a DTensor has a ``Partial`` placement (its local tensor holds summands).
        RuntimeError: ``error_if_nonfinite`` and the norm is not finite (torch's message),
            or ``foreach=True`` on a device without foreach kernels.
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = float(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    if norm_type == 0:
        # torch's 0-"norm" counts the tensors with a non-zero element (the 0-norm of the
        # per-tensor norms), which no sum of local terms gives: torch's own, on DTensors.
        return torch.nn.utils.get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
    meshes, plain = _split_by_mesh(tensors)
    first_device = _local(tensors[0]).device
    dtype = _result_dtype(tensors)
    acc_dtype = torch.promote_types(dtype, torch.float32)
    terms = []
    for mesh, group in meshes.items():
        local = _combine(
            _local_norms([t for t, _ in group.counted], norm_type, foreach),
            norm_type,
            group.device,
            acc_dtype,
        )
        _all_reduce(local, mesh, group.reduce_axes, norm_type)
        terms.append(local.to(first_device))
    terms.append(
        _combine(_local_norms(plain, norm_type, foreach), norm_type, first_device, acc_dtype)
    )
    total = _combine_terms(terms, norm_type).to(dtype)
    if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from "
            "`parameters` is non-finite, so it cannot be clipped. To disable "
            "this error and scale the gradients by the non-finite norm anyway, "
            "set `error_if_nonfinite=False`"
        )
    if len(meshes) == 1:
        (mesh,) = meshes
        # On the grads' device, as torch's (the host under CPU offload).
        return wrap_local(total, mesh, [Replicate()] * mesh.ndim, total.shape, total.stride())
    return total


@torch.no_grad()
def clip_grad_norm_(
    parameters: TensorOrTensors,
    max_norm: float,
    norm_type: float | str = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip the gradient norm of an iterable of parameters, sharded or not.

    ``torch.nn.utils.clip_grad_norm_``'s signature and result, computed on the grads'
    local tensors with one all-reduce per mesh (see [Note: sharded grad norm]) instead
    of DTensor ops: the same total norm up to rounding (the local terms are summed in
    another order), and the grads scaled in place by ``min(max_norm / (total + 1e-6),
    1)``, as torch scales them.

    Args:
        parameters: a tensor or an iterable of tensors whose ``.grad`` is clipped;
            params without a grad are skipped.
        max_norm: max norm of the gradients.
        norm_type: the p of the p-norm; ``inf`` (or ``'inf'``) for the max-norm.
        error_if_nonfinite: raise if the total norm is nan or +/-inf (nothing is scaled).
        foreach: use the foreach kernels (None: where the device supports them).

    Returns:
        The total norm of the grads before clipping, as `get_total_norm` returns it:
        for DTensor grads of one mesh a ``Replicate`` DTensor, as torch's
        (``.full_tensor()``, ``.item()``); otherwise a plain 0-dim tensor, where torch
        raises (grads on several meshes, or DTensor and plain grads mixed).

    Raises:
        ValueError: a DTensor grad has a ``Partial`` placement.
        RuntimeError: as `get_total_norm`.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn(
                "`parameters` is an empty generator, no gradient clipping will occur.",
                stacklevel=3,
            )
    grads = [p.grad for p in parameters if p.grad is not None]
    total = get_total_norm(grads, norm_type, error_if_nonfinite, foreach)
    if grads:
        _scale_(grads, float(max_norm), _value(total), foreach)
    return total


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _value(total: torch.Tensor) -> torch.Tensor:
    """The total norm as a plain tensor (torch's, for norm_type 0, may be Partial)."""
    if isinstance(total, DTensor) and not all(p.is_replicate() for p in total.placements):
        return total.full_tensor()
    return _local(total)


def _split_by_mesh(
    tensors: list[torch.Tensor],
) -> tuple[dict[DeviceMesh, _MeshTerms], list[torch.Tensor]]:
    """The DTensors' counted local tensors by mesh, and the plain tensors."""
    meshes: dict[DeviceMesh, _MeshTerms] = {}
    plain = []
    for tensor in tensors:
        if not isinstance(tensor, DTensor):
            plain.append(tensor)
            continue
        placements = tensor.placements
        if any(placement.is_partial() for placement in placements):
            raise ValueError(
                f"clip_grad_norm_: a DTensor grad of shape {tuple(tensor.shape)} has "
                f"placements {placements}: a Partial local tensor holds summands, not "
                "elements; reduce it (redistribute to Shard/Replicate) before clipping"
            )
        mesh = tensor.device_mesh
        group = meshes.get(mesh)
        if group is None:
            group = meshes[mesh] = _MeshTerms(tensor._local_tensor.device)
        # Every placement but Replicate (and Partial, refused above) shards: Shard and
        # _StridedShard (FSDP over TP's dim), which is no Shard subclass in torch 2.13.
        sharded = frozenset(axis for axis, p in enumerate(placements) if not p.is_replicate())
        group.reduce_axes |= sharded
        group.counted.append((tensor._local_tensor, sharded))
    for mesh, group in meshes.items():
        # Count a grad only at coordinate 0 of the reduced axes that do not shard it.
        coordinate = mesh.get_coordinate()
        assert coordinate is not None, "a rank holding a DTensor is in its mesh"
        group.counted = [
            (local, sharded)
            for local, sharded in group.counted
            if all(coordinate[axis] == 0 for axis in group.reduce_axes - sharded)
        ]
    return meshes, plain


def _result_dtype(tensors: list[torch.Tensor]) -> torch.dtype:
    """The dtype ``torch.stack`` of the tensors' norms has, as torch's total."""
    dtypes = {tensor.dtype for tensor in tensors}
    dtype = dtypes.pop()
    for other in dtypes:
        dtype = torch.promote_types(dtype, other)
    return dtype


def _local_norms(
    tensors: list[torch.Tensor], norm_type: float, foreach: bool | None
) -> list[torch.Tensor]:
    """Each tensor's norm (0-dim, its dtype), by device and dtype as torch groups them;
    empty tensors (a rank's empty shard) are left out, as they hold no element."""
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for tensor in tensors:
        if tensor.numel() > 0:
            by_device.setdefault((tensor.device, tensor.dtype), []).append(tensor)
    norms = []
    for (device, _), group in by_device.items():
        if foreach is not False and _device_has_foreach_support(device):
            norms.extend(torch._foreach_norm(group, norm_type))
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            norms.extend(torch.linalg.vector_norm(t, norm_type) for t in group)
    return norms


def _combine(
    norms: list[torch.Tensor], norm_type: float, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """One 0-dim term that the all-reduce (and then `_combine_terms`) can add up:
    the sum of ``norm ** p``, the max (inf) or the min (-inf); the identity of that
    reduction for no norms."""
    if not norms:
        identity = math.inf if norm_type == -math.inf else 0.0
        return torch.tensor(identity, device=device, dtype=dtype)
    stacked = torch.stack([norm.to(device=device, dtype=dtype) for norm in norms])  # (n,)
    if norm_type == math.inf:
        return stacked.max()
    if norm_type == -math.inf:
        return stacked.min()
    return stacked.pow(norm_type).sum()


def _combine_terms(terms: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The total norm from the meshes' reduced terms and the plain tensors' term."""
    stacked = torch.stack(terms)  # (meshes + 1,)
    if norm_type == math.inf:
        return stacked.max()
    if norm_type == -math.inf:
        return stacked.min()
    return stacked.sum().pow(1.0 / norm_type)


def _all_reduce(term: torch.Tensor, mesh: DeviceMesh, axes: set[int], norm_type: float) -> None:
    """Reduce ``term`` in place over the mesh axes ``axes``: one all-reduce (see
    `_reduce_groups` for the fallback). A group without a backend for ``term``'s
    device reduces a copy on the device it serves first: under CPU offload the grads,
    hence ``term``, are on the host, which an NCCL-only group cannot reduce (torch's
    clip over DTensors raises there; torch's DCP picks the device the same way)."""
    op = {math.inf: dist.ReduceOp.MAX, -math.inf: dist.ReduceOp.MIN}.get(
        norm_type, dist.ReduceOp.SUM
    )
    for group in _reduce_groups(mesh, axes):
        served = group._device_types
        if term.device.type in {device.type for device in served}:
            dist.all_reduce(term, op=op, group=group)
            continue
        wire = term.to(served[0])
        dist.all_reduce(wire, op=op, group=group)
        term.copy_(wire)


def _reduce_groups(mesh: DeviceMesh, axes: set[int]) -> list[dist.ProcessGroup]:
    """The process group over the ranks of ``mesh``'s ``axes`` (none if empty: all
    replicated). Several axes: the world's group when the mesh spans the world,
    else the flattened sub-mesh's (``DeviceMesh._flatten``, torch caches it); a mesh
    without axis names cannot be flattened and gets one all-reduce per axis."""
    if not axes:
        return []
    ordered = sorted(axes)
    if len(ordered) == 1:
        return [mesh.get_group(ordered[0])]
    if len(ordered) == mesh.ndim and mesh.size() == dist.get_world_size():
        return [dist.group.WORLD]
    names = mesh.mesh_dim_names
    if names is not None and hasattr(mesh, "_flatten"):
        sub = mesh if len(ordered) == mesh.ndim else mesh[tuple(names[a] for a in ordered)]
        return [sub._flatten().get_group()]
    return [mesh.get_group(axis) for axis in ordered]


def _scale_(
    grads: list[torch.Tensor], max_norm: float, total: torch.Tensor, foreach: bool | None
) -> None:
    """Multiply the grads' local tensors by ``min(max_norm / (total + 1e-6), 1)``, as
    ``torch.nn.utils.clip_grads_with_norm_`` does. On the CPU a coefficient of 1 skips
    the multiply (``x * 1.0 == x`` exactly); on an accelerator reading it would be a
    host sync, so the multiply runs, as in torch."""
    clip_coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if clip_coef.device.type == "cpu" and clip_coef.item() >= 1.0:
        return
    by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        local = _local(grad)
        by_device.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), group in by_device.items():
        coef = clip_coef.to(device)
        if foreach is not False and _device_has_foreach_support(device):
            torch._foreach_mul_(group, coef)
        elif foreach:
            raise RuntimeError(
                f"foreach=True was passed, but can't use the foreach API on {device.type} tensors"
            )
        else:
            for local in group:
                local.mul_(coef)
