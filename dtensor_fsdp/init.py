"""init_unsharded: initialize a sharded model exactly as the unsharded model would be.

The meta-device recipe is: build on ``meta``, ``fully_shard``, ``to_empty(device=...)``,
then initialize. Initializing the sharded DTensors directly draws different random
numbers than an eager model would (each rank fills its own shard from its own
generator), so losses and checkpoints would not match an unsharded run. Inside
``init_unsharded`` every managed parameter is a temporary *full* tensor in its original
dtype, so any init code (``init_weights()``, ``reset_parameters()``) consumes the
random stream exactly as it would on the unsharded model; on exit each rank keeps only
its shard. It costs one full copy of the parameters per rank while it lasts.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch.nn as nn

from .state import states_under


@contextmanager
def init_unsharded(module: nn.Module) -> Iterator[None]:
    """Register full parameters on ``module``'s FSDP groups for initialization.

    Example::

        with torch.device("meta"):
            model = Llama(config)
        for block in model.layers:
            fully_shard(block)
        fully_shard(model)
        model.to_empty(device="cuda")
        with init_unsharded(model):
            model.init_weights()  # the same values as on an eager model

    Args:
        module: a module whose subtree contains ``fully_shard`` modules, all resharded
            (as after ``fully_shard`` or ``to_empty``).

    Raises:
        RuntimeError: a group is unsharded, or its parameters are still on ``meta``.
    """
    groups = [s.group for s in states_under((module,)) if s.group is not None]
    for group in groups:
        if group.sharded_buffer.device.type == "meta":
            raise RuntimeError(
                f"init_unsharded: the parameters of group '{group.fqn}' are on the meta "
                "device; call module.to_empty(device=...) first"
            )
        group.reshard()
    full = [(p, p.register_full_for_init()) for group in groups for p in group.fsdp_params]
    try:
        yield
    finally:
        for fsdp_param, param in full:
            fsdp_param.write_back_from_init(param)
