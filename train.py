"""Train a small Llama with dtensor_fsdp on synthetic data.

Launch with torchrun, which sets RANK, LOCAL_RANK and WORLD_SIZE:

    torchrun --nproc-per-node 2 train.py                 # CPU + gloo, FSDP
    torchrun --nproc-per-node 4 train.py --replicate 2   # HSDP: 2 replicas x 2 shards
    torchrun --nproc-per-node 4 train.py --tp 2          # FSDP over 2 x TP over 2
    torchrun --nproc-per-node 8 train.py --device cuda   # one GPU per rank + NCCL
    torchrun --nproc-per-node 2 train.py --mixed-precision bf16 --grad-accum 4 \
        --activation-checkpointing --meta-init --cpu-offload
    torchrun --nproc-per-node 2 train.py --checkpoint-dir ckpt --checkpoint-every 10
    torchrun --nproc-per-node 4 train.py --checkpoint-dir ckpt --resume --batch-size 4
    torchrun --nproc-per-node 2 train.py --optimizer muon  # Muon on the blocks' matrices
    torchrun --nproc-per-node 2 train.py --compile         # each block torch.compile-d
    torchrun --nproc-per-node 2 train.py --graph           # graph mode: dtensor_fsdp.compile
    torchrun --nproc-per-node 4 train.py --pp 2            # 2 pipeline stages x FSDP over 2

Parallelism: the world is a mesh of ``replicate x shard x tp`` ranks, where
``shard = world / (replicate * tp)``; axes of size 1 are left out of the mesh:
``("dp",)`` (FSDP), ``("replicate", "shard")`` (HSDP), ``("dp", "tp")`` or
``("replicate", "shard", "tp")`` (with tensor parallelism). TP is the innermost
axis (consecutive ranks, i.e. within a node), then shard, then replicate: for a
multi-node HSDP run, ``--replicate`` = number of nodes replicates across nodes and
shards within each. Every transformer block is its own ``fully_shard`` unit and the
root holds the embeddings, final norm and output projection, as in torchtitan.

Pipeline parallelism (``--pp N``): an outermost "pp" axis, as torchtitan lays it out,
``("pp", "dp")`` or ``("pp", "replicate", "shard")``. The blocks are split into stages
(the embedding on the first, the final norm and output head on the last), each stage
module and its blocks sharded over the rest of the mesh, and torch's pipeline schedule
(``--pp-schedule``) runs them through ``dtensor_fsdp.pipelining``. Each data-parallel
rank's rows are split into ``--microbatches``; the last stage's ranks compute the loss,
which one all-reduce brings to every rank for the per-step line.

Data: a deterministic stream of noisy arithmetic sequences (see
``synthetic_batch``). Every rank draws the same global batch of
``batch_size * dp_size`` rows (``dp_size = replicate * shard``) and keeps the
contiguous block of rows of its data-parallel rank; the TP ranks of one
data-parallel rank share it. A single process training on the whole global batch
sees exactly the same data. With ``--grad-accum N`` the global batch is N times larger
and each rank runs its block as N micro-batches, synchronizing gradients on the last.

Initialization is the same with and without ``--meta-init``: ``init_weights()`` from a
fresh seed, on the full parameters (on the meta path inside ``init_unsharded``, so the
sharded parameters get exactly the eager values; with ``--tp`` the meta path draws
each TP shard separately and differs).
"""

import argparse
import dataclasses
import gc
import json
import os
import resource
import sys
import time
import types

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import dtensor_fsdp
from dtensor_fsdp import (
    CommTrace,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    init_unsharded,
)
from dtensor_fsdp.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from dtensor_fsdp.models.llama import (
    PRESETS,
    Llama,
    LlamaConfig,
    apply_tensor_parallel,
    cross_entropy_loss,
    swiglu_hidden_dim,
)
from dtensor_fsdp.models.llama_stages import LlamaStage, split_into_stages
from dtensor_fsdp.optim import (
    Muon,
    clip_grad_norm_,
    get_total_norm,
    split_muon_params,
    step_on_local_shards,
)
from dtensor_fsdp.pipelining import PipelineStage, register_fsdp_actions

# Chance that a token is replaced by a uniform random one; it sets the loss floor
# and keeps the task from being solved exactly in a handful of steps.
NOISE_PROB = 0.1
MAX_STRIDE = 8
# --pp-schedule: torch's schedule classes, and how many stages each pp rank holds.
PP_SCHEDULES = {
    "gpipe": (ScheduleGPipe, 1),
    "1f1b": (Schedule1F1B, 1),
    "interleaved1f1b": (ScheduleInterleaved1F1B, 2),
}
# What --pp does not combine with, and why (validate_parallelism names them).
PP_EXCLUDES = {
    "tp": "tensor parallelism inside stages is not wired up",
    "grad_accum": "the microbatches are the accumulation: use --microbatches",
    "meta_init": "the stages are cut from an initialized model",
    "cpu_offload": "not tested with pipeline schedules",
    "compile": "not tested with pipeline schedules",
    "graph": "graph mode compiles one root's whole forward and backward",
    "optimizer": "Muon's parameter split reads the whole model",
    "checkpoint_dir": "checkpoints hold the whole model's FQNs on every rank",
    "trace_comms": "the trace is per FSDP root, and each stage is one",
    "tie_embeddings": "the first and last stages would share the weight across ranks",
}
# What --graph does not combine with, and why (parse_args names them).
GRAPH_EXCLUDES = {
    "compile": "graph mode compiles the whole model; --compile compiles each block",
    "cpu_offload": "graph mode does not support CPU offload yet",
    "trace_comms": "the trace records the eager hooks' collectives; graph mode has none",
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags from ``argv`` (default: the command line)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--dim", type=int, help="override the preset (ffn width follows)")
    parser.add_argument("--n-layers", type=int, help="override the preset")
    parser.add_argument("--n-heads", type=int, help="override the preset")
    parser.add_argument("--n-kv-heads", type=int, help="override the preset")
    parser.add_argument("--vocab-size", type=int, help="override the preset")
    parser.add_argument("--seq-len", type=int, help="training length (sets max_seq_len)")
    parser.add_argument("--tie-embeddings", action="store_true")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sequences per data-parallel rank per step"
    )
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="muon: dtensor_fsdp.optim.Muon on the blocks' 2-D weights (learning rate "
        "matched to AdamW's RMS), AdamW on the rest (embeddings, norms, output head)",
    )
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping threshold")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--reshard-after-forward", choices=("true", "false"), default="true")
    parser.add_argument(
        "--replicate",
        type=int,
        default=1,
        help="HSDP: replicas (e.g. nodes); parameters are sharded within each",
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (innermost axis)")
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline-parallel degree (outermost axis)"
    )
    parser.add_argument(
        "--pp-schedule",
        choices=sorted(PP_SCHEDULES),
        default="1f1b",
        help="torch's pipeline schedule; interleaved1f1b holds two stages per pp rank",
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        help="pipeline microbatches per step, dividing --batch-size (default: --batch-size)",
    )
    parser.add_argument(
        "--mixed-precision",
        choices=("none", "bf16"),
        default="none",
        help="bf16: all-gather and compute in bf16, reduce in fp32, fp32 master weights",
    )
    parser.add_argument(
        "--cpu-offload", action="store_true", help="sharded params, grads, optimizer on CPU"
    )
    parser.add_argument(
        "--grad-accum", type=int, default=1, help="micro-batches per step (sync on the last)"
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each block's activations in backward",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each block (inductor, fullgraph) before sharding, as torchtitan "
        "does; after activation checkpointing if that is on",
    )
    parser.add_argument(
        "--graph",
        action="store_true",
        help="graph mode: dtensor_fsdp.compile(model) after sharding (FSDP's collectives "
        "inside the compiled graphs, bucketed); not with --compile",
    )
    parser.add_argument(
        "--graph-backend",
        choices=("inductor", "aot_eager"),
        default="inductor",
        help="--graph's backend; aot_eager (no fusion) trains bitwise as eager",
    )
    parser.add_argument(
        "--meta-init", action="store_true", help="build on the meta device, init after sharding"
    )
    parser.add_argument(
        "--checkpoint-dir", metavar="DIR", help="save distributed checkpoints (DCP) here"
    )
    parser.add_argument(
        "--checkpoint-every", type=int, default=0, metavar="N", help="save every N steps"
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in --checkpoint-dir (any world size)",
    )
    parser.add_argument(
        "--trace-comms",
        metavar="PATH",
        help="record FSDP's collectives: print them per step at the end, and write a "
        "Chrome/Perfetto trace of rank 0's to PATH",
    )
    parser.add_argument(
        "--metrics-out",
        metavar="PATH",
        help="rank 0 writes per-step losses and grad norms and the final "
        "full parameters to this JSON file",
    )
    args = parser.parse_args(argv)
    for flag in ("replicate", "tp", "pp", "steps", "batch_size", "grad_accum"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        parser.error("--checkpoint-every and --resume need --checkpoint-dir")
    if args.microbatches is None:
        args.microbatches = args.batch_size
    if args.graph:
        excluded = [flag for flag in GRAPH_EXCLUDES if getattr(args, flag)]
        if excluded:
            reasons = [f"--{flag.replace('_', '-')} ({GRAPH_EXCLUDES[flag]})" for flag in excluded]
            parser.error(f"--graph does not combine with {', '.join(reasons)}")
    return args


def build_config(args: argparse.Namespace) -> LlamaConfig:
    """The preset named by --model with any shape flags applied on top."""
    config = PRESETS[args.model]()
    overrides = {
        "dim": args.dim,
        "n_layers": args.n_layers,
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "vocab_size": args.vocab_size,
        "max_seq_len": args.seq_len,
    }
    overrides = {name: value for name, value in overrides.items() if value is not None}
    if args.dim is not None:
        overrides["ffn_hidden_dim"] = swiglu_hidden_dim(args.dim)
    if args.tie_embeddings:
        overrides["tie_embeddings"] = True
    return dataclasses.replace(config, **overrides)


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """The device mesh and this rank's place in it."""

    mesh: DeviceMesh
    """The whole mesh: ("dp",), ("replicate", "shard"), ("dp", "tp") or
    ("replicate", "shard", "tp"), after a leading "pp" axis with --pp."""
    dp_mesh: DeviceMesh
    """What fully_shard gets: the mesh without its "pp" and "tp" axes."""
    tp_mesh: DeviceMesh | None
    """The "tp" sub-mesh, or None without tensor parallelism."""
    dp_rank: int
    """This rank's index among the data-parallel ranks (replicate-major)."""
    dp_size: int
    """Number of data-parallel ranks: replicate * shard."""
    pp_mesh: DeviceMesh | None = None
    """The "pp" sub-mesh, or None without pipeline parallelism."""


def validate_parallelism(args: argparse.Namespace, config: LlamaConfig, world_size: int) -> None:
    """Raise ValueError, naming the flags, for a layout that cannot be built."""
    if world_size % (args.replicate * args.tp * args.pp):
        raise ValueError(
            f"--replicate {args.replicate} x --tp {args.tp} x --pp {args.pp} must divide the "
            f"world size {world_size} (the shard size is world / (replicate * tp * pp))"
        )
    if args.pp > 1:
        validate_pipeline(args, config)
    if args.tp > 1:
        if args.optimizer == "muon":
            raise ValueError(
                "--optimizer muon does not support --tp (dtensor_fsdp.optim.Muon needs "
                "params sharded over one mesh axis): use --optimizer adamw or drop --tp"
            )
        if config.tie_embeddings:
            raise ValueError("--tp needs untied embeddings: drop --tie-embeddings")
        if config.n_heads % args.tp or config.n_kv_heads % args.tp:
            raise ValueError(
                f"--tp {args.tp} must divide n_heads ({config.n_heads}) and n_kv_heads "
                f"({config.n_kv_heads}): pick another --tp or --n-heads/--n-kv-heads"
            )
        if config.max_seq_len % args.tp:
            raise ValueError(
                f"--tp {args.tp} must divide the sequence length ({config.max_seq_len}), "
                "which sequence parallelism splits"
            )


def validate_pipeline(args: argparse.Namespace, config: LlamaConfig) -> None:
    """Raise ValueError for a --pp run that cannot be built, naming the flags."""
    defaults = parse_args([])
    excluded = [
        f"--{flag.replace('_', '-')} ({why})"
        for flag, why in PP_EXCLUDES.items()
        if flag != "tie_embeddings" and getattr(args, flag) != getattr(defaults, flag)
    ]
    if config.tie_embeddings:
        excluded.append(f"--tie-embeddings ({PP_EXCLUDES['tie_embeddings']})")
    if excluded:
        raise ValueError(f"--pp {args.pp} does not combine with {', '.join(excluded)}")
    num_stages = args.pp * PP_SCHEDULES[args.pp_schedule][1]
    if config.n_layers < num_stages:
        raise ValueError(
            f"--pp {args.pp} with --pp-schedule {args.pp_schedule} makes {num_stages} stages, "
            f"more than the {config.n_layers} layers: raise --n-layers or lower --pp"
        )
    if args.batch_size % args.microbatches or args.microbatches < args.pp:
        raise ValueError(
            f"--microbatches {args.microbatches} must divide --batch-size {args.batch_size} "
            f"(equal microbatches keep the loss a mean over the batch) and be at least "
            f"--pp {args.pp} (torch's 1F1B needs one per stage)"
        )


def init_distributed(device_arg: str) -> torch.device:
    """Join torchrun's process group: NCCL on CUDA, gloo on CPU."""
    use_cuda = device_arg == "cuda" or (device_arg == "auto" and torch.cuda.is_available())
    if use_cuda:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device


def build_mesh(device: torch.device, replicate: int, tp: int, pp: int = 1) -> Parallelism:
    """One mesh over the world, (pp, replicate, shard, tp) with the size-1 axes left out."""
    world_size = dist.get_world_size()
    shard = world_size // (replicate * tp * pp)
    if replicate > 1:
        dp_shape, dp_names = (replicate, shard), ("replicate", "shard")
    else:
        dp_shape, dp_names = (shard,), ("dp",)
    tp_shape, tp_names = ((tp,), ("tp",)) if tp > 1 else ((), ())
    pp_shape, pp_names = ((pp,), ("pp",)) if pp > 1 else ((), ())
    mesh = init_device_mesh(
        device.type,
        pp_shape + dp_shape + tp_shape,
        mesh_dim_names=pp_names + dp_names + tp_names,
    )
    dp_mesh = mesh[dp_names] if tp > 1 or pp > 1 else mesh
    dp_rank = dp_mesh.get_local_rank(dp_names[-1])
    if replicate > 1:  # replicate-major, as the global batch is split
        dp_rank += dp_mesh.get_local_rank("replicate") * shard
    return Parallelism(
        mesh=mesh,
        dp_mesh=dp_mesh,
        tp_mesh=mesh["tp"] if tp > 1 else None,
        dp_rank=dp_rank,
        dp_size=replicate * shard,
        pp_mesh=mesh["pp"] if pp > 1 else None,
    )


def build_model(
    config: LlamaConfig, parallelism: Parallelism, device: torch.device, args: argparse.Namespace
) -> Llama:
    """Build identically on every rank, apply tensor parallelism if asked, and shard
    each block and the root over the data-parallel mesh. Eager: initialize, then shard.
    ``--meta-init``: shard on meta, materialize, then initialize the full parameters
    under ``init_unsharded``; both give the same values."""
    if args.meta_init:
        with torch.device("meta"):
            model = Llama(config)
    else:
        with device:
            model = Llama(config)
        init_from_seed(model, args.seed)
    if parallelism.tp_mesh is not None:
        apply_tensor_parallel(model, parallelism.tp_mesh)
    if args.activation_checkpointing:
        for block in model.layers:
            checkpoint_forward(block)
    if args.compile:
        compile_blocks(model)
    for module in [*model.layers, model]:
        fully_shard(module, mesh=parallelism.dp_mesh, **fsdp_settings(args))
    if args.meta_init:
        materialize(model, device, args.cpu_offload)
        with init_unsharded(model):
            init_from_seed(model, args.seed)
    if args.graph:
        dtensor_fsdp.compile(model, backend=args.graph_backend)
    return model


def materialize(model: torch.nn.Module, device: torch.device, cpu_offload: bool) -> None:
    """``to_empty`` after sharding on meta. With CPU offload the sharded params go to
    the CPU, as FSDP requires (torch's recipe: ``to_empty(device="cpu")``), and the
    buffers, which FSDP does not manage, to the device the forward runs on."""
    if not cpu_offload:
        model.to_empty(device=device)
        return
    model.to_empty(device="cpu")
    for module in model.modules():
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def fsdp_settings(args: argparse.Namespace) -> dict:
    """The ``fully_shard`` keyword arguments the flags ask for, besides the mesh."""
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.mixed_precision == "bf16"
        else MixedPrecisionPolicy()
    )
    return {
        "reshard_after_forward": args.reshard_after_forward == "true",
        "mp_policy": mp_policy,
        "offload_policy": CPUOffloadPolicy() if args.cpu_offload else OffloadPolicy(),
    }


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """This rank's stages of a ``--pp`` run and torch's schedule over them."""

    stages: list[PipelineStage]
    schedule: object
    """torch's schedule (``PP_SCHEDULES``) over ``stages``."""
    pp_mesh: DeviceMesh
    n_params: int
    """The whole model's parameter count."""

    @property
    def modules(self) -> list[LlamaStage]:
        return [stage.submod for stage in self.stages]


def build_pipeline(
    config: LlamaConfig, parallelism: Parallelism, device: torch.device, args: argparse.Namespace
) -> Pipeline:
    """Build and initialize the whole model on every rank (the same values as without
    --pp), keep this pp rank's stages (looped: rank r holds stages r, r + pp, ..., as
    torch's interleaved schedules expect), shard each stage's blocks and the stage
    module over the data-parallel mesh, and wrap them in torch's schedule."""
    assert parallelism.pp_mesh is not None
    with device:
        model = Llama(config)
    init_from_seed(model, args.seed)
    schedule_cls, stages_per_rank = PP_SCHEDULES[args.pp_schedule]
    num_stages = args.pp * stages_per_rank
    pp_rank = parallelism.pp_mesh.get_local_rank()
    stage_ids = [pp_rank + k * args.pp for k in range(stages_per_rank)]
    modules = split_into_stages(model, num_stages, stage_ids)
    for module in modules:
        for block in module.layers.values():
            if args.activation_checkpointing:
                checkpoint_forward(block)
            fully_shard(block, mesh=parallelism.dp_mesh, **fsdp_settings(args))
        fully_shard(module, mesh=parallelism.dp_mesh, **fsdp_settings(args))
    stages = [
        PipelineStage(module, index, num_stages, device, group=parallelism.pp_mesh.get_group())
        for index, module in zip(stage_ids, modules, strict=True)
    ]
    schedule = schedule_cls(
        stages if stages_per_rank > 1 else stages[0], args.microbatches, loss_fn=cross_entropy_loss
    )
    register_fsdp_actions(schedule)  # interleaved: UNSHARD/RESHARD; others: unchanged
    return Pipeline(
        stages, schedule, parallelism.pp_mesh, sum(p.numel() for p in model.parameters())
    )


def init_from_seed(model: Llama, seed: int) -> None:
    """The one initialization every layout shares: ``init_weights()`` from ``seed``."""
    torch.manual_seed(seed)
    model.init_weights()


def checkpoint_forward(block: torch.nn.Module) -> None:
    """Activation checkpointing (non-reentrant) of ``block``'s forward body.

    The instance's ``forward`` is replaced, not the module: parameter names stay the
    same, and FSDP's hooks still run around the call, while the recompute in backward
    calls the class's forward directly (the block is already unsharded by then).
    """
    body = type(block).forward

    def forward(self: torch.nn.Module, *args: object) -> torch.Tensor:
        return checkpoint(body, self, *args, use_reentrant=False)

    block.forward = types.MethodType(forward, block)


def compile_blocks(model: Llama) -> None:
    """torchtitan's ``apply_compile``: each block's ``__call__`` runs compiled
    (``nn.Module.compile``: the module stays in ``model.layers``, so parameter names do
    not change), one full graph per block, which FSDP's hooks stay out of. Called
    before ``fully_shard`` and after activation checkpointing (the checkpointed forward
    is traced as one region)."""
    for block in model.layers:
        block.compile(backend="inductor", fullgraph=True)


def synthetic_batch(
    generator: torch.Generator, rows: int, seq_len: int, vocab_size: int
) -> torch.Tensor:
    """(rows, seq_len + 1) tokens: x[t] = (start + stride * t) mod vocab, with noise.

    Start and stride are drawn per row, so the model must infer the stride from
    context: learnable (the loss drops fast), but not by memorizing one sequence.
    """
    start = torch.randint(vocab_size, (rows, 1), generator=generator)
    stride = torch.randint(1, MAX_STRIDE + 1, (rows, 1), generator=generator)
    positions = torch.arange(seq_len + 1)  # (seq_len + 1,)
    tokens = (start + stride * positions) % vocab_size  # (rows, seq_len + 1)
    noise = torch.randint(vocab_size, tokens.shape, generator=generator)
    is_noisy = torch.rand(tokens.shape, generator=generator) < NOISE_PROB
    return torch.where(is_noisy, noise, tokens)


def local_rows(global_batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """This data-parallel rank's contiguous block of rows; (global_rows / dp_size, seq_len + 1)."""
    return global_batch.chunk(dp_size)[dp_rank]


def build_optimizers(model: Llama, args: argparse.Namespace) -> list[torch.optim.Optimizer]:
    """AdamW on every parameter; or, with ``--optimizer muon``, Muon's recipe:
    ``dtensor_fsdp.optim.Muon`` on the blocks' 2-D weights and AdamW on the rest.

    Muon uses ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's scaling), so ``--lr`` and
    AdamW's weight decay (torch's default, 0.01) carry over unchanged.
    """
    if args.optimizer == "adamw":
        adamw = torch.optim.AdamW(model.parameters(), lr=args.lr, foreach=True)
        optimizers = [adamw]
    else:
        muon_params, adamw_params = split_muon_params(model)
        adamw = torch.optim.AdamW(adamw_params, lr=args.lr, foreach=True)
        muon = Muon(muon_params, lr=args.lr, weight_decay=0.01, adjust_lr_fn="match_rms_adamw")
        optimizers = [muon, adamw]
    step_on_local_shards(adamw)  # bitwise the same step, without DTensor dispatch
    return optimizers


def train_step(
    model: Llama,
    optimizers: list[torch.optim.Optimizer],
    tokens: torch.Tensor,
    args: argparse.Namespace,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on this rank's tokens, as ``--grad-accum`` micro-batches whose
    gradients are synchronized only on the last; returns (local loss, grad norm)."""
    micro_batches = tokens.chunk(args.grad_accum)
    total_loss = torch.zeros((), device=tokens.device)
    for index, micro in enumerate(micro_batches):
        if isinstance(model, FSDPModule):  # a plain model (a reference run) always syncs
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        inputs, targets = micro[:, :-1], micro[:, 1:]  # each (B / N, T)
        loss = cross_entropy_loss(model(inputs), targets) / len(micro_batches)
        loss.backward()
        total_loss += loss.detach()
    # torch.nn.utils.clip_grad_norm_'s result, on local tensors: one all-reduce.
    grad_norm = clip_grad_norm_(model.parameters(), args.max_norm)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    # The norm of DTensor grads is a DTensor; full_tensor() makes it a plain value.
    if isinstance(grad_norm, DTensor):
        grad_norm = grad_norm.full_tensor()
    return total_loss, grad_norm


def pipeline_step(
    pipeline: Pipeline, optimizers: list[torch.optim.Optimizer], tokens: torch.Tensor,
    args: argparse.Namespace,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One optimizer step of a ``--pp`` run on this data-parallel rank's tokens: the
    schedule splits them into ``--microbatches``, and its last stage computes their
    losses; returns (this rank's loss, 0 off the last stage; the whole model's grad
    norm)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # each (B, T)
    losses: list[torch.Tensor] = []
    step_args = (inputs,) if any(s.is_first for s in pipeline.stages) else ()
    is_last = any(s.is_last for s in pipeline.stages)
    step_kwargs = {"target": targets, "losses": losses} if is_last else {}
    pipeline.schedule.step(*step_args, **step_kwargs)
    # Equal microbatches, each loss their mean: their mean is the mean over the rows,
    # and the schedule divides the summed grads by their number (scale_grads).
    local_loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
    params = [p for module in pipeline.modules for p in module.parameters()]
    grad_norm = clip_grad_norm_across_stages(params, args.max_norm, pipeline.pp_mesh)
    for optimizer in optimizers:
        optimizer.step()
        optimizer.zero_grad()
    return local_loss, grad_norm


@torch.no_grad()
def clip_grad_norm_across_stages(
    params: list[torch.nn.Parameter], max_norm: float, pp_mesh: DeviceMesh
) -> torch.Tensor:
    """``clip_grad_norm_`` of the whole model when each pp rank holds some stages, as
    torchtitan computes it: this rank's 2-norm squared, summed over the pp ranks, then
    every local grad scaled by ``min(max_norm / (norm + 1e-6), 1)`` as torch scales."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = get_total_norm(grads)  # one Replicate DTensor: all grads are on the dp mesh
    squared = (norm.to_local() if isinstance(norm, DTensor) else norm) ** 2
    dist.all_reduce(squared, group=pp_mesh.get_group())
    total = squared.sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for grad in grads:
        grad.to_local().mul_(scale)
    return total


def resume(
    args: argparse.Namespace,
    model: Llama,
    optimizers: list[torch.optim.Optimizer],
    generator: torch.Generator,
    global_rows: int,
) -> int:
    """Load the newest complete checkpoint, if any; returns the steps already done.

    Model and optimizers are resharded by DCP to this run's layout. The data stream and
    RNG are global (every rank draws the same global batch), so they carry over to any
    world size; the run continues exactly if the global batch is the same.
    """
    path = latest_checkpoint(args.checkpoint_dir)
    if path is None:
        if dist.get_rank() == 0:
            print(f"resume: no complete checkpoint in {args.checkpoint_dir}, starting fresh")
        return 0
    loaded = load_checkpoint(path, model, optimizers)
    if loaded.extra["global_rows"] != global_rows:
        raise ValueError(
            f"resume: {path} was trained with a global batch of {loaded.extra['global_rows']} "
            f"rows, this run has {global_rows}: set --batch-size so that batch-size x "
            "data-parallel size x grad-accum matches, to continue exactly"
        )
    generator.set_state(loaded.extra["data_generator"])
    torch.set_rng_state(loaded.extra["torch_rng"])
    if dist.get_rank() == 0:
        print(f"resume: {path} (step {loaded.step}, saved on {loaded.world_size} ranks)")
    return loaded.step


def mean_over_ranks(value: torch.Tensor, holders: int | None = None) -> float:
    """Average a scalar over the ``holders`` ranks that hold one (default: all; the
    others pass 0); SUM then divide, since gloo has no AVG.

    The TP ranks of one data-parallel rank hold the same loss, so with every
    data-parallel rank counted tp times this is the mean over data-parallel ranks.
    With --pp only the last stage's ranks hold a loss: world / pp of them.
    """
    total = value.clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return total.item() / (holders or dist.get_world_size())


def peak_memory_mib(device: torch.device) -> float:
    """This rank's peak allocated CUDA memory, or its peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def report_comms(trace: CommTrace, steps: int, path: str) -> None:
    """Print the collectives per step by kind, and export the trace."""
    for kind, entry in sorted(trace.summary(steps).items()):
        print(
            f"comms | {kind}: {entry['count']:.0f} per step, "
            f"{entry['nbytes'] / 2**20:.2f} MiB, ring wire {entry['wire_bytes'] / 2**20:.2f} "
            f"MiB, exposed {entry['exposed_s'] * 1e3:.1f} ms",
            flush=True,
        )
    trace.export_chrome_trace(path)


def write_metrics(
    path: str, modules: list[torch.nn.Module], losses: list[float], grad_norms: list[float]
) -> None:
    """Rank 0 writes the run's losses, grad norms and full parameters as JSON.

    Every rank must call it: ``full_tensor()`` all-gathers each parameter. With --pp
    each rank holds some stages (``modules``), whose parameters reach rank 0 through
    one object all-gather over the world.
    """
    params = {
        name: p.full_tensor().flatten().tolist()
        for module in modules
        for name, p in module.named_parameters()
    }
    if len(modules) > 1 or isinstance(modules[0], LlamaStage):
        parts: list[dict] = [{} for _ in range(dist.get_world_size())]
        dist.all_gather_object(parts, params)
        params = {name: value for part in parts for name, value in part.items()}
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"losses": losses, "grad_norms": grad_norms, "params": params}, f)


def train(args: argparse.Namespace, device: torch.device) -> None:
    config = build_config(args)
    seq_len = config.max_seq_len
    rank, world_size = dist.get_rank(), dist.get_world_size()
    parallelism = build_mesh(device, args.replicate, args.tp, args.pp)
    if args.pp > 1:
        pipeline = build_pipeline(config, parallelism, device, args)
        modules, n_params = pipeline.modules, pipeline.n_params
        model = torch.nn.ModuleList(modules)  # for the optimizers: this rank's params
    else:
        pipeline = None
        model = build_model(config, parallelism, device, args)
        modules, n_params = [model], sum(p.numel() for p in model.parameters())
    optimizers = build_optimizers(model, args)
    generator = torch.Generator().manual_seed(args.seed)
    global_rows = args.batch_size * parallelism.dp_size * args.grad_accum
    tokens_per_step = global_rows * seq_len
    if rank == 0:
        print(
            f"{config}\nparams {n_params:,} | world {world_size} | mesh {parallelism.mesh} | "
            f"device {device} | global batch {global_rows} x {seq_len} tokens",
            flush=True,
        )

    done = resume(args, model, optimizers, generator, global_rows) if args.resume else 0
    trace = CommTrace() if args.trace_comms else None
    if trace is not None:
        model.set_comm_trace(trace)
    throughputs, losses, grad_norms = [], [], []
    for step in range(done + 1, args.steps + 1):
        start = time.perf_counter()
        global_batch = synthetic_batch(generator, global_rows, seq_len, config.vocab_size)
        tokens = local_rows(global_batch, parallelism.dp_rank, parallelism.dp_size).to(device)
        if pipeline is None:
            local_loss, grad_norm = train_step(model, optimizers, tokens, args)
        else:
            local_loss, grad_norm = pipeline_step(pipeline, optimizers, tokens, args)
        # .item() also waits for the device
        losses.append(mean_over_ranks(local_loss, world_size // args.pp))
        grad_norms.append(grad_norm.item())
        throughputs.append(tokens_per_step / (time.perf_counter() - start))
        if rank == 0:
            print(
                f"step {step:4d} | loss {losses[-1]:.4f} | grad_norm {grad_norms[-1]:.3f} | "
                f"tok/s {throughputs[-1]:,.0f} | peak_mem {peak_memory_mib(device):,.0f} MiB",
                flush=True,
            )
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            extra = {
                "data_generator": generator.get_state(),
                "torch_rng": torch.get_rng_state(),
                "global_rows": global_rows,
            }
            save_checkpoint(args.checkpoint_dir, step, model, optimizers, extra)
    if args.metrics_out:
        write_metrics(args.metrics_out, modules, losses, grad_norms)
    if trace is not None and rank == 0:
        report_comms(trace, args.steps - done, args.trace_comms)

    if rank == 0 and throughputs:
        # Step 1 pays for lazy init and allocator warm-up, so it is left out.
        steady = throughputs[1:] or throughputs
        print(
            f"done | steps {args.steps} | final loss {losses[-1]:.4f} | "
            f"mean tok/s {sum(steady) / len(steady):,.0f} (excl. step 1) | "
            f"peak_mem {peak_memory_mib(device):,.0f} MiB",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    # Before joining the process group, so a bad layout fails fast with one message.
    try:
        validate_parallelism(args, build_config(args), int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError as error:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"train.py: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    device = init_distributed(args.device)
    try:
        train(args, device)
    finally:
        # A DeviceMesh holds its ProcessGroup (DeviceMesh._pg_registry), and FSDP's
        # module <-> state reference cycles keep the mesh alive until the cyclic GC
        # runs. If that is at interpreter shutdown, gloo's teardown aborts ("terminate
        # called without an active exception"), so collect now, then destroy explicitly.
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
