"""ParamGrads: the gradient side of one parameter (`FSDPParam`'s, param.py): its
unsharded grad as the reduce-scatter wants it, the accumulation without sync (in the
reduce dtype) and HSDP's partial sums, and the landing of its sharded grad. The nouns
are [Note: FSDP tensors]'s (param.py).
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec

from .comm_math import arrange_for_reduce_scatter
from .mesh import SpmdLayout
from .shard_geometry import ShardGeometry


class ParamGrads:
    """The gradient methods of `FSDPParam` (which declares every attribute in its
    ``__init__``)."""

    layout: SpmdLayout
    geometry: ShardGeometry
    shape: torch.Size
    dtype: torch.dtype
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    compute_device: torch.device
    sharded_param: nn.Parameter
    unsharded_param: nn.Parameter | None
    partial_reduced_grad: torch.Tensor | None
    _accumulated_grad: torch.Tensor | None
    _sharding_spec: DTensorSpec

    @property
    def unsharded_grad(self) -> torch.Tensor | None:
        """The unsharded grad as a plain tensor of ``shape`` (for TP: its local tensor,
        after turning a Partial grad into the param's own placements)."""
        grad = None if self.unsharded_param is None else self.unsharded_param.grad
        if grad is None or not isinstance(grad, DTensor):
            return grad
        # Data-parallel axes (dp_mesh_dims) keep their placement, Partial included: the
        # reduce-scatter combines them. Every other axis gets the param's placement.
        assert self.layout.unsharded_placements is not None
        target = tuple(
            grad.placements[axis] if axis in self.layout.unsharded_dp_axes else placement
            for axis, placement in enumerate(self.layout.unsharded_placements)
        )
        if tuple(grad.placements) != target:
            grad = grad.redistribute(self.layout.unsharded_mesh, target)
        return grad.to_local()

    def grad_to_reduce(self) -> torch.Tensor | None:
        """The unsharded grad arranged so that its dim-0 chunks are the ranks' shards.

        Shard(dim != 0): (W, *shape[:dim], shape[dim] / W, *shape[dim + 1:]), a view.
        """
        grad = self.unsharded_grad
        if self._accumulated_grad is not None:
            accumulated, self._accumulated_grad = self._accumulated_grad, None
            grad = accumulated if grad is None else accumulated.add_(grad)
        return None if grad is None else arrange_for_reduce_scatter(grad, self.geometry)

    def zero_grad_to_reduce(self) -> torch.Tensor:
        """Zeros in place of the grad of a parameter unused this step."""
        zeros = torch.zeros(self.shape, dtype=self.param_dtype, device=self.compute_device)
        return arrange_for_reduce_scatter(zeros, self.geometry)

    def clear_unsharded_grad(self) -> None:
        if self.unsharded_param is not None:
            self.unsharded_param.grad = None

    def discard_pending_grads(self) -> None:
        self.clear_unsharded_grad()
        self._accumulated_grad = None
        self.partial_reduced_grad = None

    def accumulate_unsharded_grad(self) -> None:
        """No gradient sync this backward: fold the unsharded grad into a reduce_dtype
        accumulator when param_dtype is lower, so micro-batches add in full precision."""
        grad = self.unsharded_grad
        if grad is None or self.reduce_dtype == self.param_dtype:
            return
        grad = grad.to(self.reduce_dtype)
        if self._accumulated_grad is None:
            self._accumulated_grad = grad
        else:
            self._accumulated_grad.add_(grad)
        self.clear_unsharded_grad()

    def accumulate_partial_grad(self, reduced: torch.Tensor) -> None:
        """Hold a reduce-scattered chunk until the replicate all-reduce (HSDP)."""
        if self.partial_reduced_grad is None:
            self.partial_reduced_grad = reduced.clone()
        else:
            self.partial_reduced_grad.add_(reduced)

    def accumulate_sharded_grad(
        self,
        local: torch.Tensor,
        to_host: "Callable[..., torch.Tensor] | None" = None,
        pin_memory: bool = False,
    ) -> bool:
        """Land this rank's averaged gradient chunk on ``sharded_param.grad``.

        Args:
            local: (*local_shape), this parameter's chunk of the reduced buffer
                (`comm_math.sharded_grads`), in the reduce dtype.
            to_host: CPU offload: the device-to-host copy (``CommStreams.copy_to_host``);
                the sharded grad lives with the sharded param, on the CPU.
            pin_memory: CPU offload's ``CPUOffloadPolicy.pin_memory``.

        Returns:
            Whether the host copy may still be running: the caller must make the host
            wait for it before anything reads the grad there (the optimizer).
        """
        grad = self.sharded_param.grad
        hooks = getattr(self.sharded_param, "_post_accumulate_grad_hooks", None) or {}
        # The copy may run asynchronously only if nothing on the host reads it before
        # the end of backward: not an add into an existing grad, not a user hook. And
        # only with pin_memory, as torch's: a non-blocking device-to-host copy lands in
        # pinned memory it allocates, which pin_memory=False asks not to use.
        non_blocking = to_host is not None and pin_memory and grad is None and not hooks
        if to_host is not None:
            local = to_host(local, self.dtype, non_blocking)
        elif local.dtype != self.dtype:
            local = local.to(self.dtype)
        if grad is None:
            # Not differentiable, as torch's: the grad has no grad_fn and no autograd
            # node is recorded (``DTensor.from_local`` would record one under grad mode).
            self.sharded_param.grad = DTensor(local, self._sharding_spec, requires_grad=False)
        else:
            grad._local_tensor.add_(local)
        # Hooks registered on the sharded param (optimizer-in-backward) run once its
        # grad has landed, as autograd would run them for a plain parameter.
        for hook in hooks.values():
            hook(self.sharded_param)
        return non_blocking
