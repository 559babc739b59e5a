"""init_unsharded: initialize a sharded model exactly as the unsharded model would be,
with a bounded number of full bytes.

The meta-device recipe is: build on ``meta``, ``fully_shard``, ``to_empty(device=...)``,
then initialize. Initializing the sharded DTensors directly draws different random
numbers than an eager model would (each rank fills its own shard from its own
generator), so losses and checkpoints would not match an unsharded run. Inside
``init_unsharded`` every managed parameter is a *full* parameter in its original dtype,
so any init code (``init_weights()``, ``reset_parameters()``, ``model.apply(...)``)
consumes the random stream exactly as it would on the unsharded model; on exit each
rank keeps only its shard.

Memory: the full parameters are lazy (lazy_full_tensor.py, [Note: lazy full parameters]).
One is materialized when init code first uses it, and the least recently used ones are
written back to their shards once the materialized ones would exceed a budget: by
default the largest group's full bytes, so init needs one group's worth of full
tensors on top of the sharded model, however many groups there are, instead of the
whole model. The cost: a parameter used again after it was written back is all-gathered
from the shards (one collective, straight into its full tensor; gloo stages the output
in a temporary of the same size), e.g. in a second init pass over all the blocks after
the first, as GPT-2's scaled residual projections. ``max_unsharded_bytes`` raises the
budget (no re-gathers when it holds the whole model) or lowers it to single parameters.

Tensor-parallel parameters (DTensors on a TP mesh) and parameters with an all-gather
extension stay eager: their full tensor is registered for the whole context and is not
counted in the budget.

Device: the full parameters live on the compute device (the mesh's), also under CPU
offload, where each rank's chunk is then copied to its shard on the host: init code
draws from the same generator as the eager model on that device, so ``--meta-init
--cpu-offload`` starts from the values of an eager run on the GPU (initializing the
host shards directly would draw from the CPU's generator: other values).
"""

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ..runtime.param import FSDPParam
from ..runtime.param_group import FSDPParamGroup
from ..runtime.state import FSDPState, states_under
from .full_param import register_for_init, register_full_for_init, write_back_from_init
from .lazy_full_tensor import InitCache, LazyEntry, LazyFullTensor


@contextmanager
def init_unsharded(
    module: nn.Module, *, max_unsharded_bytes: int | None = None
) -> Iterator[InitCache]:
    """Register full parameters on ``module``'s FSDP groups for initialization.

    Example::

        with torch.device("meta"):
            model = Llama(config)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cuda")  # with CPUOffloadPolicy: device="cpu"
        with init_unsharded(model):
            model.init_weights()  # the same values as on an eager model

    Inside the context each managed parameter is an ``nn.Parameter`` of a lazy full
    tensor: the first op on it materializes it, in-place ops return it, views and
    other results are plain tensors to use at once (see [Note: lazy full parameters]).
    At most ``max_unsharded_bytes`` of them are materialized at a time; a parameter
    used again after it was written back to its shards is all-gathered (every rank must
    run the same init code in the same order, as for eager init). Tensor-parallel and
    all-gather-extension parameters are full tensors for the whole context.

    Args:
        module: a module whose subtree contains ``fully_shard`` modules, all resharded
            (as after ``fully_shard`` or ``to_empty``).
        max_unsharded_bytes: the most full bytes materialized at once (the same on every
            rank); None: the largest ``fully_shard`` call's full bytes (all its groups).
            One op on several parameters may exceed it while it runs.

    Yields:
        The ``InitCache``: ``peak_bytes``, ``all_gathers`` and the other counters.

    Raises:
        RuntimeError: the parameters of a group are still on ``meta``, or with CPU
            offload were materialized on another device than the CPU.
        ValueError: ``max_unsharded_bytes`` is negative; inside the context, ``param.data``
            is assigned a tensor of another shape, dtype or device.
    """
    if max_unsharded_bytes is not None and max_unsharded_bytes < 0:
        raise ValueError(
            f"init_unsharded: max_unsharded_bytes must be >= 0, got {max_unsharded_bytes}"
        )
    states = states_under((module,))
    groups = [g for s in states for g in s.groups]
    for group in groups:
        if group.sharded_buffer.device.type == "meta":
            raise RuntimeError(_not_materialized(group))
        group.reshard()
    lazy = [p for group in groups for p in group.fsdp_params if _is_lazy(p)]
    eager = [p for group in groups for p in group.fsdp_params if not _is_lazy(p)]
    cache = InitCache(
        max_unsharded_bytes if max_unsharded_bytes is not None else _largest_call_bytes(states),
        eager_bytes=sum(_full_nbytes(p) for p in eager),
    )
    # Messages name parameters by their path from `module` (FSDPParam.fqn is set at the
    # root's lazy init, which may not have run yet).
    names = {id(p): n for n, p in module.named_parameters()}
    full: list[tuple[FSDPParam, nn.Parameter]] = []
    try:
        full.extend((p, register_full_for_init(p)) for p in eager)
        for p in lazy:
            entry = LazyEntry(p, cache, names.get(id(p.sharded_param), p.fqn))
            register_for_init(p, nn.Parameter(LazyFullTensor(entry), p.requires_grad))
        yield cache
    finally:
        try:
            cache.close()  # writes back the materialized lazy parameters
            for fsdp_param, param in full:
                write_back_from_init(fsdp_param, param)
        finally:
            for fsdp_param in lazy + eager:
                register_for_init(fsdp_param, None)


def _not_materialized(group: FSDPParamGroup) -> str:
    """Why ``group``'s sharded buffer is still on meta: not materialized yet, or (CPU
    offload) materialized on the device, which FSDP refuses, as torch's does."""
    devices = {p.registered_local().device for p in group.fsdp_params}
    if group.offload is None or any(d.type in ("meta", "cpu") for d in devices):
        return (
            f"init_unsharded: the parameters of group '{group.fqn}' are on the meta "
            "device; call module.to_empty(device=...) first"
        )
    return (
        f"init_unsharded: the parameters of group '{group.fqn}' are on "
        f"{sorted(map(str, devices))}, but with CPU offloading FSDP parameters should be "
        'materialized on CPU: call module.to_empty(device="cpu")'
    )


def _is_lazy(fsdp_param: FSDPParam) -> bool:
    """Plain parameters are lazy; TP (a DTensor unsharded param) and all-gather
    extensions keep the eager full tensor."""
    return fsdp_param.layout.unsharded_mesh is None and fsdp_param.extension is None


def _full_nbytes(fsdp_param: FSDPParam) -> int:
    return fsdp_param.shape.numel() * fsdp_param.dtype.itemsize


def _largest_call_bytes(states: list[FSDPState]) -> int:
    """The full bytes of the largest ``fully_shard`` call (all its groups: a MoE
    block's init touches its dense and expert parameters together)."""
    return max(
        (sum(_full_nbytes(p) for p in s.fsdp_params() if _is_lazy(p)) for s in states), default=0
    )
