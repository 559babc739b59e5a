"""``bench_graph.py``'s configurations: the workloads (model shapes, batch, precision)
and how each configuration builds its model and optimizer (plain, ours eager, graph
mode, torch's ``fully_shard`` eager and per-block compiled).
"""

from dataclasses import dataclass

import torch
from common.workload import shard_blocks_then_root
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

import dtensor_fsdp
from dtensor_fsdp.models.llama import Llama, LlamaConfig, swiglu_hidden_dim
from dtensor_fsdp.optim import step_on_local_shards


@dataclass(frozen=True)
class Workload:
    name: str
    config: LlamaConfig
    batch: int
    seq: int
    bf16: bool


def llama(dim: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int):
    return LlamaConfig(
        vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
        ffn_hidden_dim=ffn, max_seq_len=seq,
    )  # fmt: skip


def host_bound(layers: int, batch: int = 2, seq: int = 128) -> Workload:
    config = llama(256, layers, 4, 4, swiglu_hidden_dim(256), 1024, 256)
    return Workload(f"host-bound ({layers} blocks)", config, batch, seq, bf16=False)


EIGHT_B = Workload(
    "8B-shaped (8 blocks)", llama(4096, 8, 32, 8, 14336, 128256, 4096), 1, 4096, True
)
BUSY = Workload(
    "busy 0.88B", llama(2048, 16, 16, 16, swiglu_hidden_dim(2048), 16384, 2048), 2, 2048, True
)


@dataclass
class Runner:
    """One configuration, built: a step is ``step(runner, tokens)``."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: bool  # the plain model's bf16: autocast (fp32 master weights, as FSDP's)


def build(name: str, workload: Workload, mesh: DeviceMesh, device: torch.device) -> Runner:
    torch.manual_seed(0)
    with torch.device(device):
        model = Llama(workload.config)
    bf16 = workload.bf16
    ours = name in ("ours", "graph", "graph+cudagraphs")
    if ours:
        policy = dtensor_fsdp.MixedPrecisionPolicy(**precision(bf16))
        shard_blocks_then_root(model, dtensor_fsdp.fully_shard, mesh=mesh, mp_policy=policy)
    if name == "graph":
        dtensor_fsdp.compile(model, backend="inductor", fullgraph=False, dynamic=False)
    if name == "graph+cudagraphs":
        dtensor_fsdp.compile(
            model, backend="inductor", fullgraph=False, dynamic=False, mode="reduce-overhead"
        )
    if name == "torch+compile":
        for block in model.layers:
            block.compile(backend="inductor", fullgraph=True)
    if name in ("torch", "torch+compile"):
        policy = TorchMixedPrecisionPolicy(**precision(bf16))
        shard_blocks_then_root(model, torch_fully_shard, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    if ours:
        # Our best configuration: the same AdamW, bitwise, on the local shards without
        # DTensor's per-op dispatch (the optimizer runs outside graph mode's graphs).
        step_on_local_shards(optimizer)
    return Runner(model, optimizer, autocast=bf16 and name == "plain")


def precision(bf16: bool) -> dict[str, torch.dtype]:
    """Both FSDPs' mixed precision: bf16 gathers and compute, fp32 reduction."""
    return {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}


def narrow(layers: int) -> Workload:
    config = llama(16, layers, 4, 4, swiglu_hidden_dim(16), 1024, 256)
    return Workload(f"host-bound at width 16 ({layers} blocks)", config, 1, 1, bf16=False)
