"""All-gather extensions: torch FSDP2's tensor-subclass protocol, for one parameter.

A parameter whose sharded local tensor is a tensor subclass defining both
``fsdp_pre_all_gather`` and ``fsdp_post_all_gather`` decides what its all-gather
carries (torchao's float8 training sends float8 data and keeps the scale as metadata;
NF4 sends its quantized blocks and scalers):

    all-gather inputs, metadata = local.fsdp_pre_all_gather(
        mesh, outer_size, outer_stride, module, mp_policy)      # or the 1-argument form
    unsharded tensor, inner tensors = local.fsdp_post_all_gather(
        all-gather outputs, metadata, param_dtype)              # the first unshard
    local.fsdp_post_all_gather(outputs, metadata, param_dtype, out=unsharded param)
                                                                # every later unshard

Each all-gather input becomes an all-gather output of ``W`` times its elements, a
tensor that lives as long as the parameter and is refilled in place at every unshard
(the subclass built on it, e.g. a float8 tensor wrapping it, stays valid: NF4 even
asserts it gets the same storages back). Its storage, and the inner tensors'
``fsdp_post_all_gather`` returned, are freed at reshard, like a plain unsharded param.

The contract, checks and error types are torch 2.13's (``_fsdp_param.py``); what the
wire carries per parameter is exactly the inputs' bytes, so a group's all-gather moves
the same bytes as torch's.
"""

import inspect
import math
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..api import MixedPrecisionPolicy
from .shard_geometry import contiguous_stride
from .storage import alloc_storage, free_storage


def has_all_gather_extension(local: torch.Tensor) -> bool:
    """Whether ``local`` (a sharded param's local tensor) defines the protocol; defining
    only one half of it is an error, as in torch."""
    has_pre = hasattr(local, "fsdp_pre_all_gather")
    if has_pre != hasattr(local, "fsdp_post_all_gather"):
        raise AssertionError(
            "Both fsdp_pre_all_gather and fsdp_post_all_gather should be defined "
            f"if using all-gather extensions: {type(local).__name__}"
        )
    return has_pre


class AllGatherExtension:
    """One parameter's pre/post all-gather state between an unshard's issue and its
    copy-out, and its persistent all-gather outputs."""

    def __init__(self, fqn: str, module: nn.Module, orig_size: torch.Size) -> None:
        """
        Args:
            fqn: the parameter's name, for messages.
            module: the module that registers the parameter (handed to the 5-argument
                ``fsdp_pre_all_gather``).
            orig_size: the parameter's unsharded size (for TP, its TP-local size).
        """
        self.fqn = fqn
        self.module = module
        self.orig_size = orig_size
        self.orig_stride = contiguous_stride(orig_size)
        # Set by `pre_all_gather`, consumed by `post_all_gather` (torch's ExtensionsData).
        self._metadata: Any = None
        self._input_sizes: list[torch.Size] = []
        self._input_dtypes: list[torch.dtype] = []
        # Per all-gather input, W times its elements, 1-D; allocated at the first unshard.
        self.outputs: list[torch.Tensor] = []
        # What the first fsdp_post_all_gather returned for FSDP to free at reshard.
        self._inner_tensors: list[torch.Tensor] = []

    def pre_all_gather(
        self,
        local: torch.Tensor,
        mesh: DeviceMesh,
        padded_local_size: torch.Size,
        mp_policy: MixedPrecisionPolicy,
    ) -> list[torch.Tensor]:
        """Run ``local.fsdp_pre_all_gather``; return its all-gather inputs, 1-D.

        Args:
            local: the sharded param's local tensor (unpadded rows), on the compute
                device.
            mesh: the 1-D shard mesh (torch's ``shard_mesh_from_root``).
            padded_local_size: the padded shard's size, which the 5-argument form must
                return for every input when this rank's shard is padded.
        """
        pre_all_gather = local.fsdp_pre_all_gather
        num_args = len(inspect.signature(pre_all_gather).parameters)
        # The 1-argument form (mesh only) is the older one; torch 2.13 keeps both.
        if num_args not in (1, 5):
            raise AssertionError(
                f"Invalid fsdp_pre_all_gather: {inspect.signature(pre_all_gather)}\n"
                "Expects fsdp_pre_all_gather(self, mesh: DeviceMesh, "
                "outer_size: torch.Size, outer_stride: tuple[int, ...], "
                "module: nn.Module, mp_policy: MixedPrecisionPolicy)"
            )
        with torch.no_grad():
            if num_args == 1:
                inputs, self._metadata = pre_all_gather(mesh)
            else:
                inputs, self._metadata = pre_all_gather(
                    mesh, self.orig_size, self.orig_stride, self.module, mp_policy
                )
        if (
            num_args == 5
            and local.size() != padded_local_size
            and any(t.size() != padded_local_size for t in inputs)
        ):
            # Only ranks whose shard is padded can tell, as in torch.
            raise AssertionError(
                f"{self.fqn}: when a parameter is unevenly sharded by FSDP (orig size="
                f"{self.orig_size}), fsdp_pre_all_gather must return all-gather inputs "
                f"with the padded sharded size {padded_local_size} but got "
                f"{[t.size() for t in inputs]}"
            )
        self._input_sizes = [t.size() for t in inputs]
        self._input_dtypes = [t.dtype for t in inputs]
        return [t.contiguous().view(-1) for t in inputs]

    def copy_out_targets(self, world_size: int, device: torch.device) -> list[torch.Tensor]:
        """Each all-gather output as ``(W, input bytes)`` uint8 rows, storage allocated;
        the outputs are created at the first unshard and reused after."""
        numels = [math.prod(size) for size in self._input_sizes]
        if not self.outputs:
            self.outputs = [
                torch.empty(numel * world_size, dtype=dtype, device=device)
                for numel, dtype in zip(numels, self._input_dtypes, strict=True)
            ]
        for output in self.outputs:
            alloc_storage(output, output.numel() * output.itemsize)
        return [output.view(torch.uint8).view(world_size, -1) for output in self.outputs]

    def post_all_gather(
        self, local: torch.Tensor, param_dtype: torch.dtype, out: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Run ``local.fsdp_post_all_gather`` on the filled outputs.

        Returns:
            The first time (``out`` None), the unsharded tensor; after that ``None``: the
            subclass refreshed ``out`` (the unsharded param) in place.
        """
        outputs = tuple(
            output.view(-1, *size[1:])
            for output, size in zip(self.outputs, self._input_sizes, strict=True)
        )
        metadata, self._metadata = self._metadata, None
        if out is not None:
            for tensor in self._inner_tensors:
                alloc_storage(tensor, tensor.numel() * tensor.itemsize)
            local.fsdp_post_all_gather(outputs, metadata, param_dtype, out=out)
            return None
        unsharded, inner_tensors = local.fsdp_post_all_gather(outputs, metadata, param_dtype)
        self._inner_tensors = list(inner_tensors)
        return torch.as_strided(unsharded, self.orig_size, self.orig_stride, storage_offset=0)

    def version_tracked(self) -> list[torch.Tensor]:
        """What autograd may have saved that the copy-out writes into."""
        return [*self.outputs, *self._inner_tensors]

    def free(self) -> None:
        for tensor in (*self.outputs, *self._inner_tensors):
            free_storage(tensor)
