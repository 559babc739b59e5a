"""FSDPParam: the life of one parameter under FSDP.

[Note: FSDP tensors]
These nouns mean one thing each, everywhere in dtensor_fsdp:

- original param: the ``nn.Parameter`` the user registered, before ``fully_shard``.
- sharded param: the ``nn.Parameter(DTensor)`` with ``Shard(0)`` that replaces it on the
  module between iterations; what the optimizer steps and what ``state_dict`` returns.
  Its local tensor is this rank's ``torch.chunk`` of the original, and is a *view into
  the group's sharded buffer* (see all_gather_layout.py), so the all-gather can read every
  shard of the group directly, with no copy-in.
- padded shard: the local rows padded to ``ceil(dim0 / W)`` rows; the padding lives in
  the sharded buffer and stays zero.
- all-gather input: the group's sharded buffer, 1-D uint8, this rank's padded shards
  back to back, read in place. A copy-in builds a fresh one instead when the wire must
  carry something else: shards cast to param_dtype (mixed precision), an extension's
  inputs, or encoded columns (``CommPrecisionPolicy``; see the wire row below).
- all-gather output: ``W`` all-gather inputs, rank-major, 1-D uint8.
- unsharded param: a plain ``nn.Parameter`` with the original shape, a view into the
  padded unsharded buffer (``W * ceil(dim0 / W)`` rows). It is registered on the module
  during forward/backward so any module code runs unchanged. Its storage is freed on
  reshard and refilled on unshard; the tensor object lives on so autograd's saved
  references stay valid. For a parameter with an all-gather extension (a tensor subclass
  defining ``fsdp_pre_all_gather``/``fsdp_post_all_gather``, extension.py) it is what
  ``fsdp_post_all_gather`` built on the extension's all-gather outputs (one persistent
  tensor per extension input, refilled at every unshard) and its inner tensors, which
  are freed on reshard instead.
- wire row: ``CommPrecisionPolicy`` only: this rank's encoded columns (block-wise
  quantized or bf16 values and their scales, wire_format.py) after the exact ones; every
  rank decodes all ``W`` rows, its own included, into the unsharded params.
- unsharded grad: ``unsharded_param.grad``, written by autograd.
- sharded grad: ``sharded_param.grad``, a ``Shard(0)`` DTensor holding this rank's chunk
  of the averaged gradient.
"""

from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from ..api import MixedPrecisionPolicy
from .comm_math import concat_along_shard_dim, unsharded_of
from .extension import AllGatherExtension, has_all_gather_extension
from .mesh import MeshInfo, SpmdLayout
from .param_grads import ParamGrads
from .shard_geometry import ShardGeometry, contiguous_stride, wrap_local
from .storage import alloc_storage, free_storage


class ShardedState(Enum):
    """Which tensor is registered on the module."""

    SHARDED = auto()
    UNSHARDED = auto()


@dataclass(frozen=True)
class ParamToShard:
    """One parameter as ``fully_shard`` found and validated it, before any mutation."""

    fqn: str
    original: nn.Parameter
    slots: list["ParamSlot"]
    layout: SpmdLayout
    shard_dim: int = 0  # from shard_placement_fn; any dim but 0 divides evenly

    @property
    def data(self) -> torch.Tensor:
        """What FSDP shards: the parameter, or for TP its local tensor."""
        return self.original.to_local() if isinstance(self.original, DTensor) else self.original


@dataclass(frozen=True)
class ParamSlot:
    """One place a parameter is registered: ``module._parameters[name]``.

    A tied parameter (e.g. embedding and output head) has one slot per module.
    """

    module: nn.Module
    name: str
    root: nn.Module  # the module passed to fully_shard that it was found under
    key: str  # its state-dict key relative to ``root``


class FSDPParam(ParamGrads):
    """One parameter: shard it, then swap between its sharded and unsharded forms.

    Construction does not touch the module; ``to_sharded()`` is the one mutation, made
    by the group once every parameter of the group has been validated and built.
    """

    def __init__(
        self,
        source: ParamToShard,
        mesh_info: MeshInfo,
        sharded_storage: torch.Tensor,
        mp_policy: MixedPrecisionPolicy,
    ) -> None:
        """Shard ``source.original`` into ``sharded_storage``.

        Args:
            source: the original param (only read), its name, slots and layout.
            mesh_info: the data-parallel mesh.
            mp_policy: decides the unsharded (all-gather, compute) and reduce dtypes.
            sharded_storage: this parameter's segment of the group's sharded buffer,
                1-D uint8 of exactly ``sharded_buffer_nbytes`` bytes, on the target
                device (empty for a parameter with an all-gather extension).
        """
        original = source.data
        self.fqn = source.fqn
        self.slots = source.slots
        self.mesh_info = mesh_info
        self.layout = source.layout
        # FSDP chunks `shape` (for TP: the TP-local shape); DTensors report `global_shape`.
        self.shape = original.shape
        self.global_shape = source.original.shape
        # dtype, param_dtype and reduce_dtype follow the sharded param: `reset_sharded_param`
        # re-derives them after ``module.to(dtype)``, as torch does at lazy init.
        self.mp_policy = mp_policy
        self.dtype = original.dtype
        self.param_dtype, self.reduce_dtype = mp_dtypes(mp_policy, self.dtype)
        self.geometry = ShardGeometry(
            self.shape, source.shard_dim, mesh_info.shard_size, mesh_info.shard_rank
        )
        # HSDP with all-reduce off: this rank's shard-averaged grad chunk, summed over
        # micro-batches, awaiting the all-reduce over the replicate axis. 1-D, padded.
        self.partial_reduced_grad: torch.Tensor | None = None
        # Shard(dim != 0) only: all-gather output columns staged for the rearrangement.
        self._copy_out_staging: list[torch.Tensor] | None = None
        # Gradient accumulation without sync when reduce_dtype != param_dtype: the
        # unsharded grads summed in reduce_dtype, so low precision does not accumulate.
        self._accumulated_grad: torch.Tensor | None = None
        # A tensor subclass that decides what its all-gather carries (extension.py).
        self.extension = (
            AllGatherExtension(source.fqn, source.slots[0].module, self.shape)
            if has_all_gather_extension(original)
            else None
        )
        assert sharded_storage.numel() == self.sharded_buffer_nbytes
        self._sharding_spec = self._init_sharding_spec()
        if self.extension is None:
            self._padded_shard = self.padded_shard_view(sharded_storage)
            self._init_sharded_param(original, source.original.requires_grad)
        else:
            self._init_sharded_subclass(
                original,
                source.original.requires_grad,
                sharded_storage.device,
                sharded_storage.is_pinned(),
            )
        self._init_unsharded_param()
        self.sharded_state = ShardedState.SHARDED

    @property
    def requires_grad(self) -> bool:
        """Read from the sharded param at every use: users freeze and unfreeze it after
        ``fully_shard`` (torch re-reads it at every unshard too)."""
        return self.sharded_param.requires_grad

    @property
    def padded_shard_numel(self) -> int:
        return self.geometry.padded_shard_numel

    @property
    def sharded_buffer_nbytes(self) -> int:
        """This parameter's bytes in the group's sharded buffer: its padded shard, or
        none when an all-gather extension keeps its own tensor subclass."""
        if self.extension is not None:
            return 0
        return self.geometry.padded_shard_numel * self.dtype.itemsize

    @property
    def all_gather_nbytes(self) -> int:
        """Bytes a parameter without extension contributes per rank to the all-gather
        (its padded shard in param_dtype)."""
        return self.geometry.padded_shard_numel * self.param_dtype.itemsize

    def padded_shard_view(self, segment: torch.Tensor) -> torch.Tensor:
        """``segment`` (uint8, ``sharded_buffer_nbytes``, e.g. on the compute device under
        CPU offload) viewed like the padded shard."""
        return segment.view(self.dtype).view(self.geometry.padded_local_shape)

    # Initialization #

    def _init_sharded_subclass(
        self, original: torch.Tensor, requires_grad: bool, device: torch.device, pin_memory: bool
    ) -> None:
        """An all-gather extension's subclass cannot live in the uint8 sharded buffer:
        pad it on its own, as torch does, with ops the subclass keeps itself through
        (``new_zeros``, slicing, ``copy_``; torchao's subclasses implement them for
        FSDP)."""
        with torch.no_grad():
            padded = original.new_zeros(self.geometry.padded_local_shape)
            if padded.device != device:
                padded = padded.to(device)  # CPU offload
            if pin_memory:
                padded = padded.pin_memory()  # as the group's sharded buffer is
            local = padded[: self.geometry.local_shape[0]]  # (*local_shape)
            if local.numel() > 0 and original.device.type != "meta":
                # torch.chunk (aten.split), as torch does: NF4 supports it, but slices
                # only from row 0 (its padded and local rows here are the same, as NF4
                # needs even shards).
                chunks = torch.chunk(original.detach(), self.geometry.world_size, self.geometry.dim)
                local.copy_(chunks[self.geometry.rank])
            sharded = self._sharded_dtensor(local)
        self._padded_shard = padded
        self.sharded_param = nn.Parameter(sharded, requires_grad=requires_grad)
        self._sharded_local = local

    def _init_sharded_param(self, original: torch.Tensor, requires_grad: bool) -> None:
        with torch.no_grad():
            # The padding rows must be zero: they are all-gathered and, for gradients,
            # reduce-scattered, so garbage there could surface as NaN/Inf in norms.
            self._padded_shard.zero_()
            # Padding is only ever on dim 0, after the rows this rank owns.
            local = self._padded_shard[: self.geometry.local_shape[0]]  # (*local_shape)
            if local.numel() > 0 and original.device.type != "meta":
                local.copy_(self.geometry.local_chunk(original.detach()))
            sharded = self._sharded_dtensor(local)
        self.sharded_param = nn.Parameter(sharded, requires_grad=requires_grad)
        # The local tensor the DTensor wraps; the zero-copy all-gather relies on it
        # still aliasing the sharded buffer (see `is_current`).
        self._sharded_local = local

    def _init_sharding_spec(self) -> DTensorSpec:
        """The sharded param's layout in ``dtype``, built once per dtype: the sharded
        param and the sharded grad of every step wrap their local tensors in it
        directly, which costs a few Python calls where ``DTensor.from_local`` costs
        about a hundred and keeps them on the local tensor's device (torch's FSDP2 does
        the same, ``_from_local_no_grad``; see `_sharded_dtensor`)."""
        return DTensorSpec(
            self.layout.mesh,
            self.layout.placements,
            tensor_meta=TensorMeta(
                self.global_shape, contiguous_stride(self.global_shape), self.dtype
            ),
        )

    def _init_unsharded_param(self) -> None:
        # `unsharded_rows` views of the padded unsharded buffer, by row count.
        self._unsharded_rows: dict[int, torch.Tensor] = {}
        if self.extension is not None:
            # Built from the first all-gather, by fsdp_post_all_gather.
            self._padded_unsharded = None
            self.unsharded_param = None
            return
        padded = torch.empty(
            self.geometry.padded_unsharded_shape,
            dtype=self.param_dtype,
            device=self.compute_device,
        )  # (*padded_unsharded_shape): W padded chunks along the shard dim
        self._padded_unsharded: torch.Tensor | None = padded
        unsharded = self._as_unsharded(unsharded_of(padded, self.geometry))  # (*shape)
        self.unsharded_param: nn.Parameter | None = nn.Parameter(unsharded, self.requires_grad)
        free_storage(padded)

    @property
    def compute_device(self) -> torch.device:
        """Where the unsharded param lives: the mesh's device (the sharded param may be
        offloaded to the CPU), or meta until the module is materialized."""
        return self._padded_shard.device if self._padded_shard.is_meta else self.mesh_info.device

    # Runtime #

    def registered_local(self) -> torch.Tensor:
        """The sharded param's local tensor as it is now (user code may have replaced it).

        The object itself, as torch's FSDP2 reads it: ``to_local()`` records an autograd
        node with grad enabled and returns a fresh view of a Parameter(DTensor) without.
        """
        return self.sharded_param._local_tensor

    def sharded_version(self) -> tuple[int, int]:
        """Counts the in-place writes to the sharded param's values: ops on the DTensor
        (``torch.optim``, ``copy_``) bump the DTensor's version, ops on its local tensor
        (``step_on_local_shards``, ``to_local().copy_()``) the local tensor's; neither
        bumps the other's."""
        param = self.sharded_param
        try:  # attribute reads only: this runs for every parameter at every all-gather
            return (param._version, param._local_tensor._version)
        except RuntimeError:  # an inference tensor has no version counter to read
            return (_version(param), _version(param._local_tensor))

    def is_current(self) -> bool:
        """Whether the sharded param's local tensor is still this parameter's segment of
        the group's sharded buffer. ``nn.Module._apply`` (``to_empty``, ``to(dtype)``,
        ``cuda()``...) and ``param.data = ...`` replace it; the group then re-derives
        its sharded state (`FSDPParamGroup.reset_sharded_params`)."""
        local = self.sharded_param._local_tensor  # `registered_local`, inlined (hot)
        if self.extension is not None:
            return local is self._sharded_local
        return (
            local.dtype == self._sharded_local.dtype
            and local.device == self._sharded_local.device
            and (local.data_ptr() == self._sharded_local.data_ptr() or local.numel() == 0)
        )

    def unsharded_rows(self, world_size: int) -> torch.Tensor:
        """The padded unsharded buffer as ``(world_size, -1)`` uint8 rows.

        For dim-0 sharding row r is exactly rank r's padded chunk; hpZ also uses these
        rows (with world_size = k) for whatever dim, since it only needs *some* split
        of the buffer that it reassembles the same way.
        """
        rows = self._unsharded_rows.get(world_size)
        if rows is None:
            # A view stays valid across free_storage/alloc_storage (same storage object).
            rows = self._padded_unsharded.view(torch.uint8).view(world_size, -1)
            self._unsharded_rows[world_size] = rows
        return rows

    def extension_all_gather_inputs(self) -> list[torch.Tensor]:
        """The all-gather inputs ``fsdp_pre_all_gather`` makes of the sharded local
        tensor (moved to the compute device first under CPU offload), each 1-D."""
        assert self.extension is not None
        local = self.registered_local()
        if local.device != self.compute_device:  # CPU offload; else no op (as in torch)
            local = local.to(self.compute_device, non_blocking=True)
        return self.extension.pre_all_gather(
            local, self.mesh_info.shard_mesh, self.geometry.padded_local_shape, self.mp_policy
        )

    def copy_out_targets(self, world_size: int, is_post_forward: bool) -> list[torch.Tensor]:
        """Where this parameter's ``(world_size, bytes)`` columns of the all-gather
        output go, one per all-gather input: the unsharded rows or the extension's
        all-gather outputs; for a full all-gather of a Shard(dim != 0) param, staging
        buffers that `finish_copy_out` concatenates along the shard dim."""
        if self.extension is not None:
            targets = self.extension.copy_out_targets(world_size, self.compute_device)
        else:
            geometry = self.geometry  # W padded shards in param_dtype
            nbytes = geometry.world_size * geometry.padded_shard_numel * self.param_dtype.itemsize
            alloc_storage(self._padded_unsharded, nbytes)
            targets = [self.unsharded_rows(world_size)]
        if self.geometry.dim == 0 or is_post_forward:
            return targets
        self._copy_out_staging = [torch.empty_like(target) for target in targets]
        return self._copy_out_staging

    def finish_copy_out(self) -> None:
        """Concatenate staged Shard(dim != 0) columns along the dim; build or refresh an
        extension's unsharded param with ``fsdp_post_all_gather``."""
        staged, self._copy_out_staging = self._copy_out_staging, None
        if staged is not None:
            finals = [self._padded_unsharded] if self.extension is None else self.extension.outputs
            for rows, final in zip(staged, finals, strict=True):
                concat_along_shard_dim(rows, self.geometry, final.dtype, out=final)
        if self.extension is None:
            return
        unsharded = self.extension.post_all_gather(
            self._sharded_local, self.param_dtype, out=self.unsharded_param
        )
        if unsharded is not None:
            self.unsharded_param = nn.Parameter(self._as_unsharded(unsharded), self.requires_grad)

    def to_unsharded(self) -> None:
        self._assert_in_states(ShardedState.SHARDED)
        assert self.unsharded_param is not None, f"{self.fqn}: unsharded before all-gather"
        # requires_grad may have changed on the sharded param since the last unshard.
        requires_grad = self.requires_grad
        if self.unsharded_param.requires_grad != requires_grad:
            self.unsharded_param.requires_grad_(requires_grad)
        self._register(self.unsharded_param)
        self.sharded_state = ShardedState.UNSHARDED

    def to_sharded(self) -> None:
        # A Parameter the user registered in place of the unsharded one (while the group
        # was kept unsharded) stays: the next all-gather adopts it (`is_replaced`).
        if not (self.sharded_state == ShardedState.UNSHARDED and self.is_foreign()):
            self._register(self.sharded_param)
        if self.extension is not None:
            self.extension.free()
        else:
            free_storage(self._padded_unsharded)
        self.sharded_state = ShardedState.SHARDED

    def version_tracked(self) -> list[torch.Tensor]:
        """The tensors autograd may have saved that copy-out writes into."""
        if self.extension is not None:
            return self.extension.version_tracked()
        return [self.unsharded_param, self._padded_unsharded]

    def _as_unsharded(self, data: torch.Tensor) -> torch.Tensor:
        """``data`` (of ``shape``) as the unsharded param's tensor: itself, or for a
        DTensor param (TP) the original DTensor again, so TP's module hooks and DTensor
        ops run on it unchanged; wrapping ``data`` itself on whatever device it is
        (``DTensor.from_local`` would move it to the mesh's: see `_sharded_dtensor`)."""
        if self.layout.unsharded_mesh is None:
            return data
        return wrap_local(
            data,
            self.layout.unsharded_mesh,
            self.layout.unsharded_placements,
            self.global_shape,
            contiguous_stride(self.global_shape),
        )

    def _sharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """``local`` itself wrapped in the sharding spec, as torch's FSDP2 builds its
        sharded param (``_from_local_no_grad``). Not ``DTensor.from_local``: it copies a
        local tensor whose device type is not the mesh's to the mesh's device, so under
        CPU offload on an accelerator the sharded param would be a device copy instead
        of a view of the (host) sharded buffer."""
        return DTensor(local, self._sharding_spec, requires_grad=False)

    def is_replaced(self) -> bool:
        """Whether user code registered another object in this parameter's place since
        it was sharded (``module.w = nn.Parameter(dtensor)``, ``load_state_dict(assign=
        True)`` outside FSDP's hooks, an ``_apply`` that makes new Parameters). Only
        while sharded: otherwise the unsharded param is registered."""
        slot = self.slots[0]  # `_registered`, inlined: every unshard asks every param
        return (
            self.sharded_state == ShardedState.SHARDED
            and slot.module._parameters.get(slot.name) is not self.sharded_param
        )

    def is_foreign(self) -> bool:
        """Whether the module holds neither this parameter's sharded nor its unsharded
        param: user code replaced it (see `is_replaced`)."""
        slot = self.slots[0]  # `_registered`, inlined: every reshard asks every param
        registered = slot.module._parameters.get(slot.name)
        return registered is not self.sharded_param and registered is not self.unsharded_param

    def _registered(self) -> nn.Parameter | None:
        slot = self.slots[0]
        return slot.module._parameters.get(slot.name)

    def _register(self, tensor: nn.Parameter) -> None:
        # Write the module's parameter dict directly: `setattr` would run nn.Module's
        # __setattr__ and any user hooks on it, neither of which applies to a swap.
        for slot in self.slots:
            slot.module._parameters[slot.name] = tensor

    def _assert_in_states(self, *states: ShardedState) -> None:
        assert self.sharded_state in states, (
            f"{self.fqn}: expected sharded state in {states}, got {self.sharded_state}"
        )


def mp_dtypes(
    mp_policy: MixedPrecisionPolicy, dtype: torch.dtype
) -> tuple[torch.dtype, torch.dtype]:
    """(param_dtype, reduce_dtype) of a parameter of ``dtype``: the policy applies to
    floating-point parameters; reduce_dtype defaults to param_dtype, as in torch."""
    if not dtype.is_floating_point:
        return dtype, dtype
    param_dtype = mp_policy.param_dtype or dtype
    return param_dtype, mp_policy.reduce_dtype or param_dtype


def _version(tensor: torch.Tensor) -> int:
    # An inference tensor (made under inference_mode) keeps no version counter; it can
    # only be written inside inference_mode, and such writes go unseen.
    return -1 if tensor.is_inference() else tensor._version
