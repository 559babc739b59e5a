"""Helpers of the graph-mode tests: models, and a counter of the collectives inside
compiled graphs.

``GraphCollectives`` counts the functional-collective nodes of the forward and
backward graphs that graph mode's backend runs (after its passes: bucketing merges
nodes). ``tests/_c10d.py``'s ``C10dRecorder`` cannot see inside compiled code (dynamo
declines to compile under a user dispatch mode), so the tests show this counter agrees
with it where both can look: the same graph-mode model run uncompiled.
"""

import types
from collections import Counter
from typing import Any

import torch
from torch import fx, nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.tensor import Shard
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import dtensor_fsdp
from dtensor_fsdp import MixedPrecisionPolicy, fully_shard
from dtensor_fsdp.graph.backend import graph_backend
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss

_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_reduce": "all_reduce",
}


class GraphCollectives:
    """Counts per kind and graph (forward, backward) of every graph compiled."""

    def __init__(self) -> None:
        self.graphs: list[Counter] = []

    def __call__(self, gm: fx.GraphModule) -> None:
        counts: Counter = Counter()
        for node in gm.graph.nodes:
            target = getattr(node.target, "_opname", None) if node.op == "call_function" else None
            namespace = getattr(node.target, "namespace", None)
            if namespace == "_c10d_functional" and target is not None:
                # Bucketing emits the ``_out`` variants (e.g. all_gather_into_tensor_out).
                name = target.rstrip("_").removesuffix("_out")
                counts[_KINDS.get(name, name)] += name != "wait_tensor"
        self.graphs.append(+counts)

    def total(self) -> Counter:
        return sum(self.graphs, Counter())


def build_llama(
    config: LlamaConfig,
    mesh: Any,
    *,
    mixed: bool = False,
    reshard_after_forward: bool = True,
    impl: Any = fully_shard,
    checkpoint_blocks: bool = False,
    shard_dim1: bool = False,
) -> Llama:
    """The Llama, each block and then the root sharded by ``impl`` (ours or torch's
    ``fully_shard``); ``shard_dim1``: matrices ``Shard(1)`` (``shard_placement_fn``)."""
    torch.manual_seed(0)
    model = Llama(config)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if mixed:
        kwargs["mp_policy"] = mp
    if shard_dim1:
        kwargs["shard_placement_fn"] = lambda param: Shard(1) if param.ndim == 2 else None
    if checkpoint_blocks:
        for index, block in enumerate(model.layers):
            model.layers[index] = checkpoint_wrapper(block)
    for block in model.layers:
        impl(block, **kwargs)
    # The root as users leave it (reshard_after_forward=None: kept for backward).
    impl(model, **{k: v for k, v in kwargs.items() if k != "reshard_after_forward"})
    return model


class ResidualBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 3 * dim + 1)  # 3*dim+1 rows: uneven over 2 and 4 ranks
        self.down = nn.Linear(3 * dim + 1, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def build_blocks(
    mesh: Any,
    *,
    n_blocks: int = 2,
    dim: int = 16,
    checkpoint: bool = False,
    patch_forward: bool = False,
):
    """Residual MLP blocks (each sharded, optionally activation-checkpointed) and a
    sharded root with a head: the model for what the Llama cannot show.
    ``patch_forward``: checkpoint each block by replacing its instance ``forward``
    before ``fully_shard``, as train.py's ``--activation-checkpointing`` does."""
    torch.manual_seed(0)
    blocks = [ResidualBlock(dim) for _ in range(n_blocks)]
    if checkpoint:
        blocks = [checkpoint_wrapper(block) for block in blocks]
    if patch_forward:
        for block in blocks:
            body = type(block).forward
            block.forward = types.MethodType(
                lambda self, x, body=body: torch_checkpoint(body, self, x, use_reentrant=False),
                block,
            )
    model = nn.Sequential(*blocks, nn.Linear(dim, 1))
    for block in blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def compile_counting(
    model: nn.Module, counter: GraphCollectives, *, bucket_mb: float | None
) -> None:
    """Graph mode with the aot_eager backend, ``counter`` seeing every compiled graph."""
    dtensor_fsdp.enable_graph_mode(model)
    model.compile(backend=graph_backend("aot_eager", bucket_mb, on_graph=counter), fullgraph=True)


def llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return cross_entropy_loss(logits, tokens[:, 1:])
