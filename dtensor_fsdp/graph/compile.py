"""``dtensor_fsdp.compile``: graph mode's entry point."""

from typing import Any

from torch import nn

from .backend import graph_backend
from .switch import enable_graph_mode, gather_specs


def compile(
    model: nn.Module,
    *,
    backend: str = "inductor",
    bucketing: bool = True,
    bucket_mb: float | None = None,
    fullgraph: bool = True,
    **compile_kwargs: Any,
) -> nn.Module:
    """Compile ``model``, the root of a ``fully_shard`` tree, in graph mode, in place.

    Every FSDP module's all-gather, mixed-precision cast and gradient reduction become
    ops of the compiled graphs (`switch.py`), so the forward and backward compile
    without graph breaks and the compiler schedules the collectives. Parameters stay
    the same sharded DTensors: state dicts, checkpoints, optimizers work unchanged.

    Args:
        backend: ``"inductor"``, or ``"aot_eager"`` (no fusion: bitwise the eager
            numerics).
        bucketing: merge consecutive FSDP all-gathers and reduce-scatters into buckets
            of ``bucket_mb`` and, with inductor, reorder compute and communication so
            they overlap. Off: one all-gather and one reduction per group, as eager.
        bucket_mb: the bucket size; None: `default_bucket_mb`.
        fullgraph, compile_kwargs: as ``torch.compile``'s (``mode``, ``dynamic``...).

    Returns:
        ``model`` itself (compiled with ``nn.Module.compile``: its state-dict keys do
        not change).
    """
    enable_graph_mode(model)
    if bucketing and bucket_mb is None:
        bucket_mb = default_bucket_mb(model)
    model.compile(
        backend=graph_backend(backend, bucket_mb if bucketing else None),
        fullgraph=fullgraph,
        **compile_kwargs,
    )
    return model


def default_bucket_mb(model: nn.Module) -> float:
    """2.5 times the largest all-gather of ``model`` (in graph mode), in MB: a bucket
    holds two groups of the largest size, about what eager's prefetch holds unsharded
    at once (the current group and the next), and never three. Not exactly 2: a bucket
    of two equal groups would then sit on its cap and torch's passes would not merge
    them."""
    return 2.5 * max(spec.all_gather_nbytes for spec in gather_specs(model)) / 2**20
