"""bench_compile.py's rows: the ways users and torchtitan combine torch.compile with FSDP.

Each row's ``build(model, fsdp, mesh)`` takes a freshly built Llama and returns the
module to train, with the FSDP implementation ``fsdp`` (torch's or ours: the same
calls). Unless a row says otherwise, FSDP shards each block, then the root, with the
default settings. Nothing here runs a step.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from common.workload import shard_blocks_then_root
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import dtensor_fsdp
from dtensor_fsdp.models.llama import Llama

IMPLS = ("torch", "ours")
# torchtitan's apply_compile sets these two for every model (distributed/compile.py).
TITAN_DYNAMO_CONFIG = {
    "capture_scalar_outputs": True,
    "skip_fwd_side_effects_in_bwd_under_checkpoint": True,
}


@dataclasses.dataclass(frozen=True)
class FSDP:
    """One FSDP implementation's entry points."""

    name: str
    fully_shard: Callable[..., nn.Module]
    mixed_precision_policy: type


def fsdp_impl(name: str) -> FSDP:
    if name == "torch":
        return FSDP(name, torch_fully_shard, TorchMixedPrecisionPolicy)
    return FSDP(name, dtensor_fsdp.fully_shard, dtensor_fsdp.MixedPrecisionPolicy)


Build = Callable[[Llama, FSDP, DeviceMesh], nn.Module]


def eager(model: Llama, fsdp: FSDP, mesh: DeviceMesh) -> nn.Module:
    shard_blocks_then_root(model, fsdp.fully_shard, mesh=mesh)
    return model


def compile_blocks(**compile_kwargs: Any) -> Build:
    """``block.compile(**kwargs)`` on every block (``nn.Module.compile``: the module stays
    in place and its ``__call__`` runs compiled), then FSDP."""

    def build(model: Llama, fsdp: FSDP, mesh: DeviceMesh) -> nn.Module:
        for block in model.layers:
            block.compile(**compile_kwargs)
        shard_blocks_then_root(model, fsdp.fully_shard, mesh=mesh)
        return model

    return build


def compile_blocks_after_fsdp(backend: str) -> Build:
    def build(model: Llama, fsdp: FSDP, mesh: DeviceMesh) -> nn.Module:
        shard_blocks_then_root(model, fsdp.fully_shard, mesh=mesh)
        for block in model.layers:
            block.compile(backend=backend)
        return model

    return build


def compile_model(backend: str) -> Build:
    """FSDP first, then ``torch.compile(model)``: an OptimizedModule around the root."""

    def build(model: Llama, fsdp: FSDP, mesh: DeviceMesh) -> nn.Module:
        shard_blocks_then_root(model, fsdp.fully_shard, mesh=mesh)
        return torch.compile(model, backend=backend)

    return build


def swap_compiled_blocks(model: Llama, fsdp: FSDP, mesh: DeviceMesh) -> nn.Module:
    """torchtitan's apply_compile until 2025: ``torch.compile(block, fullgraph=True)``
    replaces each block in the module list, and FSDP shards the OptimizedModules (so its
    hooks sit outside the compiled ``_orig_mod``)."""
    for index, block in enumerate(model.layers):
        model.layers[index] = torch.compile(block, fullgraph=True)
    shard_blocks_then_root(model, fsdp.fully_shard, mesh=mesh)
    return model


def titan(*, ac: bool = False, bf16: bool = False) -> Build:
    """torchtitan's parallelize order for a dense Llama: activation checkpointing
    (``apply_ac``, mode "full": each block swapped for a ``checkpoint_wrapper`` without
    RNG state), ``apply_compile`` (each block ``.compile(fullgraph=True)``, inductor; its
    dynamo flags are patched around the run, see ``Row.dynamo_config``), then
    ``apply_fsdp_to_decoder``'s groups: the embedding, each block, ``[norm, output]``
    (kept unsharded after forward) and the root.

    Not copied: ``set_gradient_divide_factor(1.0)`` (torch turns it into PREMUL_SUM,
    which gloo lacks; both FSDPs average instead), and ``cast_forward_inputs=False``:
    our blocks take the root's fp32 RoPE tables as inputs (torchtitan's model casts them
    inside), so without the cast SDPA gets fp32 queries and bf16 values and fails,
    compiled or not.
    """

    def build(model: Llama, fsdp: FSDP, mesh: DeviceMesh) -> nn.Module:
        if ac:
            for index, block in enumerate(model.layers):
                model.layers[index] = checkpoint_wrapper(block, preserve_rng_state=False)
        for block in model.layers:
            block.compile(backend="inductor", fullgraph=True)
        policy = fsdp.mixed_precision_policy()
        if bf16:
            policy = fsdp.mixed_precision_policy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        fsdp.fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=policy)
        for block in model.layers:
            fsdp.fully_shard(block, mesh=mesh, mp_policy=policy)
        fsdp.fully_shard(
            [model.norm, model.output], mesh=mesh, mp_policy=policy, reshard_after_forward=False
        )
        fsdp.fully_shard(model, mesh=mesh, mp_policy=policy)
        return model

    return build


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    what: str
    build: Build
    dynamo_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    """torch._dynamo.config values patched around the whole run."""
    fp32: bool = True
    """Whether the eager fp32 row is its reference (not for mixed precision)."""


ROWS = [
    Row("eager", "no compile (the control)", eager),
    Row("block.compile()", "each block .compile() (inductor), then FSDP", compile_blocks()),
    Row(
        "fullgraph aot_eager",
        "each block .compile(backend='aot_eager', fullgraph=True), then FSDP",
        compile_blocks(backend="aot_eager", fullgraph=True),
    ),
    Row(
        "fullgraph inductor",
        "each block .compile(backend='inductor', fullgraph=True), then FSDP",
        compile_blocks(backend="inductor", fullgraph=True),
    ),
    Row(
        "before aot_eager",
        "each block .compile(backend='aot_eager'), then FSDP",
        compile_blocks(backend="aot_eager"),
    ),
    Row(
        "after aot_eager",
        "FSDP, then each block .compile(backend='aot_eager')",
        compile_blocks_after_fsdp("aot_eager"),
    ),
    Row(
        "model aot_eager",
        "FSDP, then torch.compile(model, backend='aot_eager')",
        compile_model("aot_eager"),
    ),
    Row("model inductor", "FSDP, then torch.compile(model) (inductor)", compile_model("inductor")),
    Row(
        "swap torch.compile(block)",
        "layers[i] = torch.compile(block, fullgraph=True) (inductor), then FSDP",
        swap_compiled_blocks,
    ),
    Row("titan", "torchtitan: apply_compile, apply_fsdp", titan(), TITAN_DYNAMO_CONFIG),
    Row(
        "titan AC",
        "torchtitan: apply_ac (full), apply_compile, apply_fsdp",
        titan(ac=True),
        TITAN_DYNAMO_CONFIG,
    ),
    Row(
        "titan bf16",
        "torchtitan: apply_compile, apply_fsdp with bf16 params, fp32 reduce",
        titan(bf16=True),
        TITAN_DYNAMO_CONFIG,
        fp32=False,
    ),
]
