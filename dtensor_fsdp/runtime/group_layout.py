"""GroupLayout: a group's sharded buffer and all-gather layout, as its settings and the
user's changes to the sharded params leave them (`FSDPParamGroup`'s first part; its
lifecycle verbs are in param_group.py).

[Note: re-deriving the sharded state]
``nn.Module._apply`` (``to_empty``, ``to(dtype)``, ``half()``, ``cuda()``...) and
``param.data = ...`` give sharded params new local tensors outside the sharded buffer;
``module.w = nn.Parameter(dtensor)`` registers a new sharded param, which FSDP adopts
(it becomes the sharded param, as in torch's FSDP2, once checked to have the old one's
layout). As in torch's FSDP2, the sharded params as the user left them are the truth: the
group re-derives dtypes and the sharded buffer from them (`reset_sharded_params`) after
every ``_apply`` of one of its modules once none of them is on meta any more (a group
over several modules is only complete after the last one's ``_apply``), at lazy init,
and before an all-gather that finds a replaced local tensor.
"""

import torch

from ..api import AllGather, CommPrecisionPolicy, CPUOffloadPolicy
from .all_gather_layout import AllGatherInFlight, AllGatherLayout, PostForwardShard
from .comm_strategies import is_custom
from .mesh import MeshInfo
from .param import FSDPParam, ShardedState
from .param_reset import (
    adopt_replacement,
    check_replacement,
    move_sharded_param,
    rederive_sharded_buffer,
)
from .reduction.gradient_reduction import GradientReduction
from .training_state import TrainingState


class GroupLayout:
    """The sharded-state side of `FSDPParamGroup` (which declares every attribute in
    its ``__init__``): reads and rebuilds ``all_gather_layout``, never mutated in place."""

    fqn: str
    mesh_info: MeshInfo
    device: torch.device
    offload: CPUOffloadPolicy | None
    fsdp_params: list[FSDPParam]
    all_gather_layout: AllGatherLayout
    sharded_state: ShardedState
    training_state: TrainingState
    reduction: GradientReduction
    tree_params: list[FSDPParam] | None
    _in_flight: AllGatherInFlight | None
    _post_forward: PostForwardShard | None

    def _sharded_device(self, device: torch.device) -> torch.device:
        if self.offload is None or device.type == "meta":
            return device
        return torch.device("cpu")

    def _pins_sharded_buffer(self) -> bool:
        """Pinned host memory lets the offload copies run asynchronously; pinning needs
        an accelerator, so a CPU mesh just uses ordinary memory."""
        return (
            self.offload is not None
            and self.offload.pin_memory
            and self.device.type not in ("cpu", "meta")
        )

    @property
    def sharded_buffer(self) -> torch.Tensor:
        """The group's sharded buffer: see [Note: sharded buffer] (all_gather_layout.py)."""
        return self.all_gather_layout.sharded_buffer

    def set_comm_precision(self, policy: CommPrecisionPolicy | None) -> None:
        """What the wire carries from now on (see `CommPrecisionPolicy`).

        Raises:
            RuntimeError: the group is between its forward and its backward, or has an
                all-gather in flight: its next collectives must read what this one wrote
                in the same layout.
        """
        if (
            self.training_state != TrainingState.IDLE
            or self.sharded_state != ShardedState.SHARDED
            or self._in_flight is not None
            or self._post_forward is not None
        ):
            raise RuntimeError(
                f"set_comm_precision on '{self.fqn or 'the root'}' between its forward and "
                "its backward (or with an unshard in flight): call it between iterations"
            )
        self.reduction.set_comm_precision(policy)
        self._rebuild_layout(policy, self.all_gather_layout.strategy, self.sharded_buffer)

    @property
    def all_gather_comm(self) -> AllGather:
        """The group's all-gather strategy (comm_strategies.py)."""
        return self.all_gather_layout.strategy

    @property
    def custom_all_gather(self) -> AllGather | None:
        """A user's ``set_custom_all_gather`` strategy, if set."""
        comm = self.all_gather_layout.strategy
        return comm if is_custom(comm) else None

    def set_all_gather_comm(self, comm: AllGather) -> None:
        """Run this group's all-gathers with ``comm`` from the next one on."""
        layout = self.all_gather_layout
        self._rebuild_layout(layout.comm_precision, comm, layout.sharded_buffer)

    def _rebuild_layout(
        self, policy: CommPrecisionPolicy | None, comm: AllGather, sharded_buffer: torch.Tensor
    ) -> None:
        self.all_gather_layout = AllGatherLayout.build(
            self.fsdp_params, policy, sharded_buffer, comm, self.offload is not None
        )

    def reset_sharded_params(self) -> bool:
        """Re-derive the sharded buffer and every parameter's dtypes from the sharded
        params as they are now, adopting a Parameter registered in place of one; a
        no-op if nothing changed. See [Note: re-deriving the sharded state]. Returns
        whether it re-derived the buffer.

        Raises:
            ValueError: a sharded param was replaced by something FSDP cannot adopt (see
                `check_replacement` (param_reset.py)); nothing is changed then.
        """
        replaced = [p for p in self.fsdp_params if p.is_replaced()]
        if replaced:
            owners = self.tree_params if self.tree_params is not None else self.fsdp_params
            self.check_replacements({id(p.sharded_param): p for p in owners})
            for fsdp_param in replaced:
                adopt_replacement(fsdp_param)
        if not [p for p in self.fsdp_params if not p.is_current()]:
            return False
        locals_ = [p.registered_local() for p in self.fsdp_params]
        devices = {t.device for t in locals_}
        if len(devices) > 1 or any(t.is_meta for t in locals_):
            return False  # another module of the group has not been applied yet
        device = devices.pop()
        if self.offload is not None and device.type != "cpu":
            return False  # lazy init refuses it, as torch does
        if self.device.type == "meta":
            self.device = self.mesh_info.device
        # Sorted in place, since the reduction holds this same list.
        sharded_buffer = rederive_sharded_buffer(
            self.fsdp_params, device, self._pins_sharded_buffer()
        )
        layout = self.all_gather_layout
        self._rebuild_layout(layout.comm_precision, layout.strategy, sharded_buffer)
        self.reduction.forget_description()  # the params' reduce dtypes may have changed
        return True

    def move_sharded_buffer(self, buffer: torch.Tensor) -> None:
        """Make ``buffer`` the group's sharded buffer: a copy of this one's bytes that
        the caller made, on any device (pinned host memory while a phase offload frees
        the device, and a device copy again after it: post_training/offload.py). The
        sharded params stay the same Parameter objects, now over their segments of
        ``buffer`` (`move_sharded_param`); their grads must have been taken off first.
        Between iterations only: the group is sharded, nothing in flight."""
        assert (
            self.sharded_state == ShardedState.SHARDED
            and self.training_state == TrainingState.IDLE
            and self._in_flight is None
            and self._post_forward is None
        ), f"{self.fqn}: the sharded buffer moves between iterations only"
        assert buffer.dtype == torch.uint8 and buffer.numel() == self.sharded_buffer.numel()
        sizes = [p.sharded_buffer_nbytes for p in self.fsdp_params]
        for fsdp_param, segment in zip(self.fsdp_params, buffer.split(sizes), strict=True):
            move_sharded_param(fsdp_param, segment)
        layout = self.all_gather_layout
        self._rebuild_layout(layout.comm_precision, layout.strategy, buffer)

    def check_replacements(self, owners: dict[int, FSDPParam]) -> None:
        """`check_replacement` (param_reset.py) for every replaced param of the group;
        ``owners`` maps sharded param ids to their FSDPParams (this group's, or at lazy
        init every group's of the tree)."""
        for fsdp_param in self.fsdp_params:
            if fsdp_param.is_replaced():
                check_replacement(fsdp_param, owners)
