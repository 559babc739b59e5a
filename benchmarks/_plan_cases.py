"""``bench_plan.py``'s real configurations, each defined once for both sides: the
prediction (``plan()``, in the launching process) and the measurement (a training step
on real gloo ranks, ``measure``).

Models: the repo's Llama ``tiny`` and ``small``, and torch's own
``nn.TransformerEncoder`` (a model that is not ours: post-norm layers, ``nn.MultiheadAttention``
with its packed ``in_proj_weight``) under ``plan()``'s default loss ``model(x).sum()``.
"""

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from common.tensor_memory import restart_step, total_bytes
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from dtensor_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from dtensor_fsdp.models.llama import PRESETS, Llama, cross_entropy_loss
from dtensor_fsdp.plan import shard_largest_module_list
from dtensor_fsdp.plan.recorders import collective_totals
from dtensor_fsdp.plan.settings import OPTIMIZERS, default_loss
from tests._c10d import C10dRecorder

SEQ = 32  # tokens per sequence (Llama) or positions (encoder)
SEQUENCES = 2  # per rank
ENCODER_DIM = 64


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # "tiny", "small" (Llama presets) or "encoder"
    setting: str  # "fp32", "bf16", "last_block_kept", "offload" or "hsdp_2x2"
    world_size: int

    @property
    def name(self) -> str:
        return f"{self.model} {self.setting} W={self.world_size}"


CASES = [
    Case("tiny", "fp32", 2),
    Case("tiny", "fp32", 4),
    Case("tiny", "bf16", 2),
    Case("tiny", "last_block_kept", 2),
    Case("tiny", "offload", 2),
    Case("tiny", "hsdp_2x2", 4),
    Case("small", "fp32", 2),
    Case("small", "bf16", 4),
    Case("small", "last_block_kept", 4),
    Case("small", "offload", 4),
    Case("encoder", "fp32", 2),
    Case("encoder", "bf16", 4),
    Case("encoder", "hsdp_2x2", 4),
]
# Every setting and both world sizes once, on the fastest models.
QUICK_CASES = [
    Case("tiny", "fp32", 2),
    Case("tiny", "bf16", 2),
    Case("tiny", "last_block_kept", 2),
    Case("tiny", "offload", 2),
    Case("tiny", "hsdp_2x2", 4),
    Case("encoder", "fp32", 4),
]


def build_model(name: str) -> nn.Module:
    if name == "encoder":
        layer = nn.TransformerEncoderLayer(
            ENCODER_DIM, nhead=4, dim_feedforward=4 * ENCODER_DIM, dropout=0.0, batch_first=True
        )
        return nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    return Llama(PRESETS[name]())


def make_batch(name: str) -> torch.Tensor:
    if name == "encoder":
        return torch.randn(SEQUENCES, SEQ, ENCODER_DIM)  # (B, T, D)
    return torch.randint(0, PRESETS[name]().vocab_size, (SEQUENCES, SEQ + 1))  # (B, T + 1)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])  # tokens (B, T + 1)


def keep_last_block(model: nn.Module, **kwargs: Any) -> None:
    """Each block of ``model.layers`` resharded after forward but the last (its
    parameters are needed first in backward), then the root."""
    for i, block in enumerate(model.layers):
        fully_shard(block, reshard_after_forward=i < len(model.layers) - 1, **kwargs)
    fully_shard(model, **kwargs)


def plan_kwargs(case: Case) -> dict[str, Any]:
    """``plan()``'s settings for ``case``; the measurement applies the same ones."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "loss_fn": default_loss if case.model == "encoder" else next_token_loss,
        "replicate": 2 if case.setting == "hsdp_2x2" else 1,
        "shard_fn": keep_last_block
        if case.setting == "last_block_kept"
        else shard_largest_module_list,
        "mp_policy": bf16 if case.setting == "bf16" else MixedPrecisionPolicy(),
        "offload_policy": (
            CPUOffloadPolicy(pin_memory=False) if case.setting == "offload" else OffloadPolicy()
        ),
        "optimizer": "adamw",
    }


@dataclasses.dataclass(frozen=True)
class Measured:
    peak_bytes: int
    """Step 2's peak of live bytes on this rank (MemTracker, as bench_train.py)."""
    peak_breakdown: dict[str, int]
    """The peak's bytes per MemTracker category, as ``Plan.peak_breakdown``."""
    collectives: dict[str, dict[str, int]]
    """Step 2's c10d collectives, ``{kind: {"count", "bytes"}}`` as ``Plan.collectives``."""


def measure_cases(cases: list[Case]) -> list[Measured]:
    """On each gloo rank (see ``common.spawn.run_ranks``): every case in turn."""
    return [measure(case) for case in cases]


def measure(case: Case) -> Measured:
    """Build, shard and train ``case`` for two steps under MemTracker, as
    ``bench_train.measure_memory`` does: the peak restarted at step 2's start."""
    kwargs = plan_kwargs(case)
    mesh = _mesh(kwargs["replicate"])
    with MemTracker() as tracker:
        torch.manual_seed(0)
        model = build_model(case.model)
        kwargs["shard_fn"](
            model,
            mesh=mesh,
            mp_policy=kwargs["mp_policy"],
            offload_policy=kwargs["offload_policy"],
        )
        optimizer = OPTIMIZERS[kwargs["optimizer"]](model.parameters())
        batch = make_batch(case.model)
        for _ in range(2):
            restart_step(tracker)
            with C10dRecorder() as recorder:
                kwargs["loss_fn"](model, batch).backward()
                optimizer.step()
            optimizer.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
    breakdown: dict[str, int] = {}
    for device, snapshot in peak.items():
        for category, nbytes in snapshot.items():
            if device.type == "cpu" and category != "Total":
                # MemTracker's keys are its private _MemRefType enum: by name.
                name = getattr(category, "value", category)
                breakdown[name] = breakdown.get(name, 0) + nbytes
    # Counted as the NCCL plan counts them: gloo's all-to-all carries ours' reduce-scatter.
    collectives = collective_totals(recorder.records, all_to_all_as="reduce_scatter")
    return Measured(total_bytes(peak), breakdown, collectives)


def measure_on_fake_group(case: Case) -> Measured:
    """``measure`` as rank 0 of torch's fake process group, in this process: real
    tensors and arithmetic, collectives that move nothing. Ours then issues the
    reduce-scatter an NCCL job does (on gloo it is an all-to-all, with a receive buffer
    as large as its input), which is what ``plan()`` simulates: this isolates what fake
    tensors get wrong from what gloo adds."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=case.world_size)
    try:
        return measure(case)
    finally:
        dist.destroy_process_group()


def _mesh(replicate: int) -> DeviceMesh:
    world = dist.get_world_size()
    if replicate == 1:
        return init_device_mesh("cpu", (world,))
    # plan()'s HSDP mesh: (replicate, shard).
    return init_device_mesh(
        "cpu", (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )
