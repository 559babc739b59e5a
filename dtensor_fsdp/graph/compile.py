"""``dtensor_fsdp.compile``: graph mode's entry point."""

import logging
import statistics
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime.observer import Observers
from ..runtime.state import state_of
from ..runtime.streams import CommStreams
from .observed import ObserversOf
from .switch import enable_graph_mode, gather_plans


def compile(
    model: nn.Module,
    *,
    backend: str = "inductor",
    bucketing: bool = True,
    bucket_mb: float | None = None,
    fullgraph: bool = True,
    mode: str | None = None,
    options: dict[str, Any] | None = None,
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
        fullgraph, mode, options, compile_kwargs: as ``torch.compile``'s (``mode``
            and ``options`` are inductor's: ``mode="reduce-overhead"`` for CUDA graphs).

    Logging calls inside the compiled forward (``logging.Logger``'s ``debug``,
    ``info``, ``warning``, and Hugging Face's ``warning_once``/``info_once``, which
    transformers models call in ``forward``) are skipped while dynamo traces
    (``torch._dynamo.config.ignore_logging_functions``), so they do not stop a
    ``fullgraph`` compile; their messages are not emitted by the compiled code.

    Returns:
        ``model`` itself (compiled with ``nn.Module.compile``: its state-dict keys do
        not change). ``dtensor_fsdp.disable_graph_mode(model)`` returns it to eager
        mode, uncompiled.
    """
    # Here, not at import: the backends import AOTAutograd, its partitioner (networkx)
    # and inductor's config, ~0.3 s of CPU that `import dtensor_fsdp` need not pay.
    from .backend import graph_backend, inductor_mode_options

    inductor_options = {**inductor_mode_options(mode), **(options or {})}
    graph_backend(backend, None, None, inductor_options)  # bad arguments fail before the switch
    enable_graph_mode(model)
    if bucketing and bucket_mb is None:
        bucket_mb = default_bucket_mb(model)
    model.compile(
        backend=graph_backend(
            backend, bucket_mb if bucketing else None, None, inductor_options, _observers_of(model)
        ),
        fullgraph=fullgraph,
        **compile_kwargs,
    )
    model._compiled_call_impl = _ignoring_logging(model._compiled_call_impl)
    return model


def _observers_of(model: nn.Module) -> ObserversOf:
    """What each compiled graph's launch tells (graph/observed.py): the observers
    attached to the root's groups (the flight recorder and the checks are attached to
    every group of the tree; a ``CommTrace`` set on the root too), read at each launch,
    with the root's streams and device."""
    state = state_of(model)
    assert state is not None and state.ctx is not None  # enable_graph_mode ran lazy init
    # Weakly: dynamo keeps each compiled graph, and with it this function, in the
    # globals of the compiled frame's module (graph/switch.py) for the process's life;
    # a strong reference would keep the model, its parameters and its watchdog alive
    # after the user dropped it.
    root = weakref.ref(state)

    def observers_of() -> tuple[Observers, CommStreams, torch.device]:
        state = root()
        assert state is not None and state.ctx is not None, "the compiled model is gone"
        # A root without parameters of its own: its tree's groups.
        groups = state.groups or [g for s in state.states_in_tree for g in s.groups]
        observers = groups[0].observers if len(groups) == 1 else _union(groups)
        return observers, state.ctx.streams, state.device

    return observers_of


def _union(groups: list[Any]) -> Observers:
    seen: dict[int, Any] = {}
    for group in groups:
        for observer in group.observers:
            seen.setdefault(id(observer), observer)
    return tuple(seen.values())


def _ignoring_logging(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` run with the logging calls its frames make ignored by dynamo (the
    config is read while dynamo traces, at the first call and at recompiles)."""
    ignored = {
        method
        for name in ("debug", "info", "warning", "warning_once", "info_once")
        if (method := getattr(logging.Logger, name, None)) is not None
    }

    def call(*args: Any, **kwargs: Any) -> Any:
        config = torch._dynamo.config
        with config.patch(ignore_logging_functions=ignored | config.ignore_logging_functions):
            return compiled(*args, **kwargs)

    return call


def default_bucket_mb(model: nn.Module) -> float:
    """The default bucket size of ``model`` (in graph mode), in MB: two groups of the
    typical (median) size, what eager's prefetch holds unsharded at once (the current
    group and the next), plus room for one smaller group to ride along (a root's
    embedding and norm); a group larger than that (a large root) travels alone.

    Sizes are all-gather outputs, as torch's passes measure buckets; 1% over two
    typical groups so that two equal ones fit despite float rounding of the cap."""
    sizes = sorted(plan.all_gather_nbytes for plan in gather_plans(model))
    typical = statistics.median_low(sizes)
    smaller = sizes[0] if sizes[0] < typical else 0
    return (2.02 * typical + smaller) / 2**20
