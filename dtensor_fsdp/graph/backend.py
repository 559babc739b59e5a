"""The compile backends of graph mode, and the two graph passes they add.

- `mark_reshard` (joint graph, before the forward/backward partition): the nodes of a
  gather whose group reshards after forward (annotated by switch.py) become
  ``MUST_RECOMPUTE``: the partitioner re-gathers them in backward instead of saving the
  unsharded parameters, which is what ``reshard_after_forward=True`` means.
- Bucketing (forward and backward graphs, torch's ``bucket_all_gather`` /
  ``bucket_reduce_scatter``): consecutive gathers or reductions are merged into one
  collective up to ``bucket_mb``; with inductor, its compute/communication reordering
  also runs (``reorder_for_compute_comm_overlap``), so collectives overlap compute.

``"inductor"`` runs torch's inductor with these passes through its config (patched for
our compile only); ``"aot_eager"`` runs the same graphs without fusion, eagerly, op for
op: the backend whose losses and gradients are bitwise the eager ones.

torch._inductor's modules are imported inside the functions that compile: ``import
dtensor_fsdp`` should not pay for the compiler unless graph mode is used.
"""

import hashlib
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils.checkpoint import CheckpointPolicy

from .gather import RESHARD_ANNOTATION
from .observed import ObservedGraph, ObserversOf, collectives_of

BACKENDS = ("inductor", "aot_eager")
_warned: set[str] = set()


def mark_reshard(graph: fx.Graph) -> int:
    """Mark the forward nodes of resharding gathers ``MUST_RECOMPUTE``, and the views
    taken of them only (a matmul's transposed weight: saving it would keep the
    unsharded parameter alive); returns how many. Forward nodes are those that do not
    depend on a tangent (a backward input)."""
    backward: set[fx.Node] = set()
    for node in graph.nodes:  # topological order: a node's inputs come before it
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            arg in backward for arg in node.all_input_nodes
        ):
            backward.add(node)
    marked: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op != "call_function" or node in backward:
            continue
        custom = node.meta.get("custom") or {}
        if _is_resharding(custom) or _is_view_of(node, marked):
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            marked.add(node)
    return len(marked)


def _is_view_of(node: fx.Node, marked: set[fx.Node]) -> bool:
    inputs = node.all_input_nodes
    return (
        bool(inputs)
        and all(arg in marked for arg in inputs)
        and getattr(node.target, "is_view", False)
    )


def _is_resharding(custom: dict) -> bool:
    return all(custom.get(key) == value for key, value in RESHARD_ANNOTATION.items())


class _MarkReshard(CustomGraphPass):
    """`mark_reshard` as inductor's ``joint_custom_pre_pass`` (its uuid keys the cache)."""

    def __call__(self, graph: fx.Graph) -> None:
        mark_reshard(graph)

    def uuid(self) -> Any:
        source = inspect.getsource(mark_reshard) + inspect.getsource(_is_view_of)
        return hashlib.sha256(source.encode()).hexdigest()


def graph_backend(
    name: str,
    bucket_mb: float | None,
    on_graph: Callable[[fx.GraphModule], None] | None = None,
    inductor_options: dict[str, Any] | None = None,
    observers_of: ObserversOf | None = None,
) -> Callable:
    """The dynamo backend ``name`` (`BACKENDS`) with graph mode's passes; ``bucket_mb``:
    the bucket size, None for no bucketing (and no reordering). ``on_graph`` (aot_eager
    only): called with each forward and backward graph as it will run.
    ``inductor_options``: inductor config, as ``torch.compile``'s ``options`` (its
    ``mode`` is a set of these: `inductor_mode_options`). ``observers_of``: the root's
    observers, told of each graph's launch (graph/observed.py); None: no one."""
    if name == "inductor":
        if on_graph is not None:
            raise ValueError("on_graph is for the aot_eager backend, whose graphs run as seen")
        return _inductor(bucket_mb, inductor_options or {}, observers_of)
    if inductor_options:
        raise ValueError(f"mode and options are inductor's; the {name!r} backend takes none")
    if name == "aot_eager":
        return _aot_eager(bucket_mb, on_graph, observers_of)
    raise ValueError(f"graph mode's backend must be one of {BACKENDS}, not {name!r}")


def inductor_mode_options(mode: str | None) -> dict[str, Any]:
    """``torch.compile``'s ``mode`` as inductor config (a custom backend such as graph
    mode's does not get ``mode`` from ``torch.compile``: it must apply it itself)."""
    from torch._inductor import list_mode_options

    return dict(list_mode_options(mode)) if mode else {}


def _inductor(
    bucket_mb: float | None, options: dict[str, Any], observers_of: ObserversOf | None
) -> Callable:
    from torch._inductor import config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    patches: dict[str, Any] = {**options, "joint_custom_pre_pass": _MarkReshard()}
    if bucket_mb is not None:
        wanted = {
            "bucket_all_gathers_fx": "all",
            "bucket_all_gathers_fx_bucket_size_determinator": _BucketCap(bucket_mb),
            "bucket_reduce_scatters_fx": "all",
            "bucket_reduce_scatters_fx_bucket_size_determinator": _BucketCap(bucket_mb),
            "reorder_for_compute_comm_overlap": True,
        }
        for key, value in wanted.items():
            if hasattr(config, key):
                patches[key] = value
            else:
                _warn_once(f"this torch's inductor has no {key}: graph mode runs without it")

    def inner_compile(gm: fx.GraphModule, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
        compiled = compile_fx_inner(gm, example_inputs, *args, **kwargs)
        if observers_of is None:
            return compiled
        # The collectives as they run: read after inductor's passes (bucketing).
        phase = "backward" if kwargs.get("is_backward") else "forward"
        return _ObservedOutput(compiled, ObservedGraph(compiled, collectives_of(gm), phase, observers_of))

    def backend(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)

    return backend


class _ObservedOutput:
    """Inductor's compiled graph (an ``OutputCode``), launched through `ObservedGraph`;
    everything else AOT autograd asks of it goes to it."""

    def __init__(self, compiled: Any, observed: ObservedGraph) -> None:
        self._compiled = compiled
        self._observed = observed
        self._boxed_call = True  # see ObservedGraph

    def __call__(self, inputs: list[Any]) -> Any:
        return self._observed(inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._compiled, name)


def _aot_eager(
    bucket_mb: float | None,
    on_graph: Callable[[fx.GraphModule], None] | None,
    observers_of: ObserversOf | None,
) -> Callable:
    def compiler(phase: str) -> Callable:
        def compile_graph(gm: fx.GraphModule, example_inputs: list[Any]) -> Callable:
            if bucket_mb is not None:
                bucket(gm, bucket_mb)
            if on_graph is not None:
                on_graph(gm)
            compiled = make_boxed_func(gm.forward)
            if observers_of is None:
                return compiled
            return ObservedGraph(compiled, collectives_of(gm), phase, observers_of)

        return compile_graph

    def partition(joint: fx.GraphModule, inputs: Any, **kwargs: Any) -> Any:
        mark_reshard(joint.graph)
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    return aot_autograd(
        fw_compiler=compiler("forward"), bw_compiler=compiler("backward"), partition_fn=partition
    )


def bucket(gm: fx.GraphModule, bucket_mb: float) -> None:
    """torch's all-gather and reduce-scatter bucketing on an aten graph, in place."""
    from torch._inductor.fx_passes.bucketing import bucket_all_gather, bucket_reduce_scatter
    from torch._inductor.pattern_matcher import stable_topological_sort

    bucket_all_gather(gm, _BucketCap(bucket_mb))
    bucket_reduce_scatter(gm, _BucketCap(bucket_mb))
    # A merged collective can sit after users of its first member: re-sort (as
    # inductor's post-grad passes do after bucketing).
    stable_topological_sort(gm.graph)
    gm.recompile()


@dataclass(frozen=True)
class _BucketCap:
    """Every bucket's size in MB (the passes ask per bucket index). A module-level
    class, not a lambda: inductor pickles its config into the cache key."""

    bucket_mb: float

    def __call__(self, bucket_index: int) -> float:
        return self.bucket_mb


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, stacklevel=3)
