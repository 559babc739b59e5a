"""A group's sharded buffer and `AllGatherLayout`, how its all-gather lays out the
parameters; the records of an all-gather in flight and of hpZ's post-forward shard.

[Note: sharded buffer]
Every parameter's padded shard lives in ONE contiguous uint8 buffer per group, and the
sharded param's local tensor is a view into it. That buffer *is* the all-gather input:
the all-gather reads it in place, so the per-step copy-in that torch's FSDP2 does (every
shard into a fresh all-gather buffer) disappears. The optimizer updates the views in
place, which keeps them valid. Parameters are laid out by element size, largest first,
so each segment's byte offset is a multiple of its dtype's size and ``view(dtype)``
works without alignment padding; a group may mix dtypes. State dicts hand out aliases
of the views with storages of their own ([Note: state-dict values own their storage] in
``io/state_dict.py``): torch's async checkpoint stager cannot copy a DTensor over a view
at a nonzero offset.

The all-gather carries each plain param's padded shard in param_dtype, then each
extension's inputs, as bytes. Without a cast or an extension it reads the sharded buffer
in place and this order is the buffer's; otherwise a copy-in builds the all-gather input
in this order (largest param_dtype first again, so the cast writes aligned views). With
``CommPrecisionPolicy.all_gather`` the selected params travel encoded, at the end.

A layout is immutable: `FSDPParamGroup` builds a new one whenever what it describes
changes (the sharded buffer or a parameter's dtype in ``reset_sharded_params``, the
policy in ``set_comm_precision``), so everything derived from it (orders, splits, the
views of the sharded buffer) is computed once per layout, not per all-gather.
"""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..api import AllGather, CommPrecisionPolicy, MixedPrecisionPolicy
from ..comm_precision.wire_format import WireLayout
from .collectives import AllGatherResult
from .comm_description import AllGatherDescription, describe_all_gather
from .comm_math import (
    cast_whole_buffer,
    copy_in,
    copy_out,
    decode_columns,
)
from .extension import has_all_gather_extension
from .mesh import MeshInfo
from .observer import Watches
from .param import FSDPParam, ParamToShard
from .shard_geometry import ShardGeometry


def shard_params(
    params: list[ParamToShard],
    mesh_info: MeshInfo,
    device: torch.device,
    pin: bool,
    mp_policy: MixedPrecisionPolicy,
) -> tuple[torch.Tensor, list[FSDPParam]]:
    """Shard ``params`` into a new sharded buffer on ``device`` (pinned if ``pin``).
    Returns the buffer (1-D uint8) and the FSDPParams whose shards it holds, in its
    order."""
    world_size, rank = mesh_info.shard_size, mesh_info.shard_rank
    ordered = sorted(params, key=lambda p: -p.data.dtype.itemsize)  # [Note: sharded buffer]
    # A parameter with an all-gather extension keeps its own subclass tensor.
    sizes = [
        0
        if has_all_gather_extension(p.data)
        else ShardGeometry(p.data.shape, p.shard_dim, world_size, rank).padded_shard_numel
        * p.data.dtype.itemsize
        for p in ordered
    ]
    sharded_buffer = torch.empty(sum(sizes), dtype=torch.uint8, device=device, pin_memory=pin)
    segments = sharded_buffer.split(sizes)  # each (sharded_buffer_nbytes,)
    return sharded_buffer, [
        FSDPParam(source, mesh_info, segment, mp_policy)
        for source, segment in zip(ordered, segments, strict=True)
    ]


@dataclass(frozen=True)
class AllGatherSource:
    """What an unshard all-gathers: the sharded buffer over the shard mesh, or after an
    hpZ reshard the post-forward buffer over the smaller post-forward mesh."""

    input: torch.Tensor  # 1-D uint8
    mesh_info: MeshInfo
    split_nbytes: Sequence[int]  # bytes per rank of each exactly copied column
    # CommPrecisionPolicy.all_gather: the quantized params' encoded shards, after the
    # exact columns in each rank's bytes.
    wire: WireLayout | None = None


@dataclass(frozen=True)
class AllGatherInFlight:
    """An all-gather that `unshard` issued and no `wait_for_unshard` consumed yet."""

    result: AllGatherResult
    source: AllGatherSource
    # Recorded on the all-gather's stream right after it: the copy-out waits for it.
    event: object | None
    # Issued by an async unshard (a prefetch): its copy-out releases the output at once,
    # not at the next copy-out.
    is_async: bool
    watches: Watches  # the attached observers' watches of it (runtime/observer.py)


@dataclass(frozen=True)
class PostForwardShard:
    """hpZ: this rank's 1/k of the padded unsharded params, kept between forward and
    backward (see `FSDPParamGroup._reshard_post_forward`)."""

    buffer: torch.Tensor  # (W/k * shard_nbytes,) uint8
    # On an accelerator the buffer is written on the compute stream: the backward
    # all-gather's stream waits for this event before reading; None once it has.
    written: object | None


@dataclass(frozen=True)
class AllGatherLayout:
    """What one group's all-gather sends and where its output goes: the group's
    `AllGatherDescription` (comm_description.py) with the eager runtime's buffers, for
    the group's parameters, sharded buffer, ``CommPrecisionPolicy`` and all-gather
    strategy as they are when built."""

    description: AllGatherDescription
    params: tuple[FSDPParam, ...]  # the group's, in the sharded buffer's order
    sharded_buffer: torch.Tensor  # 1-D uint8; see [Note: sharded buffer]
    comm_precision: CommPrecisionPolicy | None
    # The description's orders as the params themselves (it holds indices).
    plain_order: tuple[FSDPParam, ...]
    quantized_order: tuple[FSDPParam, ...]
    all_gather_order: tuple[FSDPParam, ...]
    post_forward_order: tuple[FSDPParam, ...]
    finishes_copy_out: tuple[FSDPParam, ...]
    # Each plain param's padded shard, a view of the sharded buffer.
    padded_shards: Mapping[FSDPParam, torch.Tensor]
    # The tensors copy-out writes into that autograd may have saved (see
    # `_version_tracked`); None when an extension may build new ones at any copy-out.
    version_tracked: tuple[torch.Tensor, ...] | None

    @classmethod
    def build(
        cls,
        params: Sequence[FSDPParam],
        comm_precision: CommPrecisionPolicy | None,
        sharded_buffer: torch.Tensor,
        strategy: AllGather,
        offload: bool,
    ) -> "AllGatherLayout":
        description = describe_all_gather(params, comm_precision, strategy, offload)

        def ordered(indices: tuple[int, ...]) -> tuple[FSDPParam, ...]:
            return tuple(params[i] for i in indices)

        return cls(
            description=description,
            params=tuple(params),
            sharded_buffer=sharded_buffer,
            comm_precision=comm_precision,
            plain_order=ordered(description.plain_order),
            quantized_order=ordered(description.quantized_order),
            all_gather_order=ordered(description.all_gather_order),
            post_forward_order=ordered(description.post_forward_order),
            finishes_copy_out=ordered(description.finishes_copy_out),
            padded_shards=_padded_shards(params, sharded_buffer),
            version_tracked=None if description.extension_order else _version_tracked(params),
        )

    @property
    def strategy(self) -> AllGather:
        return self.description.strategy

    @property
    def plain_split(self) -> tuple[int, ...]:
        return self.description.plain_split

    @property
    def wire(self) -> WireLayout | None:
        return self.description.wire

    def sharded_source(self, sharded: torch.Tensor, mesh_info: MeshInfo) -> AllGatherSource:
        """The full all-gather's input over ``mesh_info``: ``sharded`` (the sharded
        buffer on the compute device) in place, cast as a whole, or copied in."""
        description = self.description
        if not description.copies_in:
            return AllGatherSource(sharded, mesh_info, description.plain_split)
        if description.casts_whole_buffer:
            first = self.params[0]
            cast = cast_whole_buffer(sharded, first.dtype, first.param_dtype)
            return AllGatherSource(cast, mesh_info, description.plain_split)
        shards = (
            self.padded_shards
            if sharded is self.sharded_buffer
            else _padded_shards(self.params, sharded)
        )
        copied_in = copy_in(
            [shards[p] for p in self.plain_order],
            description.plain_dtypes,
            [
                t
                for p in self.all_gather_order
                if p.extension is not None
                for t in p.extension_all_gather_inputs()
            ],
            description.wire,
            # Encoded from the sharded (master) values, not from a param_dtype copy.
            [shards[p].view(1, -1) for p in self.quantized_order],
        )
        return AllGatherSource(
            copied_in.input, mesh_info, copied_in.split_nbytes, description.wire
        )

    def post_forward_source(
        self, post_forward: PostForwardShard, mesh_info: MeshInfo, post_forward_mesh_info: MeshInfo
    ) -> AllGatherSource:
        """hpZ's backward all-gather of the post-forward buffer over the smaller mesh:
        its columns are ``mesh_info``'s, W/k times wider."""
        ratio = mesh_info.shard_size // post_forward_mesh_info.shard_size
        return AllGatherSource(
            post_forward.buffer,
            post_forward_mesh_info,
            [ratio * p.all_gather_nbytes for p in self.post_forward_order],
        )

    def post_forward_buffer(self, k: int, j: int) -> torch.Tensor:
        """hpZ: row ``j`` of each unsharded param's ``k`` rows (this rank's 1/k of the
        padded unsharded params), concatenated in ``post_forward_order``."""
        kept = [p.unsharded_rows(k)[j] for p in self.post_forward_order]  # each (W/k * bytes,)
        return torch.cat(kept)  # (W/k * shard_nbytes,) uint8

    def foreach_copy_out(
        self, output: torch.Tensor, source: AllGatherSource, is_post_forward: bool
    ) -> None:
        """Copy the all-gather ``output`` of ``source`` into the unsharded params."""
        world_size = source.mesh_info.shard_size
        tracked = self.version_tracked
        if tracked is None:
            tracked = _version_tracked(self.params)
        # Autograd saved these tensors in forward; refilling them in backward must not
        # look like an in-place change to its version check. One guard for the group.
        with torch.autograd._unsafe_preserve_version_counter(tracked):
            exact = self.post_forward_order if is_post_forward else self.all_gather_order
            rows = output.view(world_size, -1)  # (W, bytes per rank)
            exact_nbytes = sum(source.split_nbytes)
            copy_out(
                rows[:, :exact_nbytes],
                source.split_nbytes,
                [t for p in exact for t in p.copy_out_targets(world_size, is_post_forward)],
            )
            if source.wire is not None:
                decode_columns(
                    rows[:, exact_nbytes:],
                    source.wire,
                    [
                        p.copy_out_targets(world_size, False)[0].view(p.param_dtype)
                        for p in self.quantized_order
                    ],  # each (W, padded_shard_numel)
                )
            for fsdp_param in self.finishes_copy_out:
                fsdp_param.finish_copy_out()


def _padded_shards(
    params: Sequence[FSDPParam], sharded: torch.Tensor
) -> dict[FSDPParam, torch.Tensor]:
    """Each plain param's padded shard in ``sharded`` (the sharded buffer, or its copy
    on the compute device under CPU offload)."""
    segments = sharded.split([p.sharded_buffer_nbytes for p in params])
    return {
        p: p.padded_shard_view(segment)
        for p, segment in zip(params, segments, strict=True)
        if p.extension is None  # an extension's subclass is not in the buffer
    }


def _version_tracked(params: Sequence[FSDPParam]) -> tuple[torch.Tensor, ...]:
    """The tensors copy-out writes into that autograd may have saved, but for inference
    tensors (made under inference_mode), which have no version counter. Plain params
    keep their unsharded tensors until the group's next layout (`reset_sharded_params`);
    an extension may build new ones at any copy-out."""
    return tuple(t for p in params for t in p.version_tracked() if not t.is_inference())
