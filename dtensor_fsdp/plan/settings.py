"""What one plan simulates: ``PlanSettings``, validated before anything is built."""

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from ..api import MixedPrecisionPolicy, OffloadPolicy
from ..fully_shard import fully_shard

# fully_shard's keyword arguments that the plan chooses: mesh, mp_policy, offload_policy.
ShardFn = Callable[..., None]
LossFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]

# The collectives' backends a plan can simulate; see PlanSettings.backend.
BACKENDS = frozenset({"nccl", "gloo"})

OPTIMIZERS: dict[str, OptimizerFactory] = {
    # The learning rates do not matter: fake tensors do no arithmetic. What matters is
    # the state each keeps per parameter: SGD without momentum none, with it one
    # buffer; Adam/AdamW two (exp_avg, exp_avg_sq) and a scalar step.
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-3),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=1e-3),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
}


def largest_module_list(model: nn.Module) -> nn.ModuleList | None:
    """The model's largest ``nn.ModuleList`` by parameter count (a transformer's
    blocks), or ``None`` without one."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def shard_largest_module_list(model: nn.Module, **fully_shard_kwargs: Any) -> None:
    """The default grouping, as ``train.py``'s: ``fully_shard`` on each direct child of
    the model's largest ``nn.ModuleList`` (by parameter count; a transformer's blocks),
    then on the root. A model without a ``ModuleList`` becomes one group."""
    largest = largest_module_list(model)
    for child in largest if largest is not None else ():
        fully_shard(child, **fully_shard_kwargs)
    fully_shard(model, **fully_shard_kwargs)


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """``model(batch).sum()``: a scalar whose backward reaches every output element."""
    return model(batch).sum()


@dataclass(frozen=True)
class PlanSettings:
    """Everything a plan simulates; ``Plan.replan(**changes)`` re-runs with changes."""

    model: nn.Module | Callable[[], nn.Module]
    """A model (on ``meta`` or real: it is copied to ``meta``, never changed) or a
    factory (called under ``torch.device("meta")``)."""
    world_size: int
    """Ranks to simulate, on torch's fake process group."""
    batch: Any
    """One rank's example batch, or a factory of it (called under fake tensors, so a
    large batch costs no memory)."""
    loss_fn: LossFn = default_loss
    """``loss_fn(model, batch)``: runs the forward and returns the scalar loss."""
    replicate: int = 1
    """HSDP: replicas (the mesh is ``(replicate, world_size // replicate)``); 1 is FSDP."""
    shard_fn: ShardFn = shard_largest_module_list
    """``shard_fn(model, mesh=..., mp_policy=..., offload_policy=...)`` makes the
    ``fully_shard`` calls, forwarding those keyword arguments."""
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    optimizer: str | OptimizerFactory = "adamw"
    """A name in ``OPTIMIZERS`` or ``factory(params) -> Optimizer``."""
    link_gbps: float = 400.0
    """Per-rank network bandwidth, Gbit/s, for the communication times."""
    tflops: float = 400.0
    """Achieved (not peak) compute throughput per rank, TFLOP/s, for compute times."""
    backend: str = "nccl"
    """The job's collectives: ``"nccl"`` (a reduce-scatter per group) or ``"gloo"``
    (ours reduce-scatters there by an all-to-all plus a local sum, whose receive buffer,
    as large as the input, counts in the peak)."""
    sdpa_backends: tuple[SDPBackend, ...] | None = None
    """The attention kernels ``F.scaled_dot_product_attention`` may pick in the
    simulation (as ``torch.nn.attention.sdpa_kernel`` takes them); ``None``: the
    simulating CPU's choice, its flash kernel, which saves only the output and the
    log-sum-exp for backward. The kernel decides the activations' size: on CUDA, fp32
    inputs with grouped-query attention run the math kernel, which also saves the
    ``batch * heads * seq**2`` attention weights (an H200 measured 24 MiB more per
    block than the CPU's kernel on a 4-block Llama: the peak 13.7% over a plan without
    it); plan such a job with ``(SDPBackend.MATH,)``."""

    def __post_init__(self) -> None:
        if self.batch is None:
            raise ValueError(
                "plan() needs one example batch (or a factory of it): the activations "
                "and the compute depend on it; pass batch=..."
            )
        if not isinstance(self.model, nn.Module) and not callable(self.model):
            raise TypeError(f"model must be an nn.Module or a factory, got {type(self.model)}")
        if self.world_size < 1 or self.replicate < 1:
            raise ValueError(
                f"world_size ({self.world_size}) and replicate ({self.replicate}) must be positive"
            )
        if self.world_size % self.replicate != 0:
            raise ValueError(
                f"world_size ({self.world_size}) is not divisible by replicate "
                f"({self.replicate}): HSDP needs replicate * shard == world_size; pick a "
                "replicate degree that divides the world size"
            )
        if isinstance(self.optimizer, str) and self.optimizer not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {self.optimizer!r}: use one of {sorted(OPTIMIZERS)} or "
                "pass a factory params -> torch.optim.Optimizer"
            )
        if self.backend not in BACKENDS:
            raise ValueError(
                f"unknown backend {self.backend!r}: plan for one of {sorted(BACKENDS)}"
            )
        if self.link_gbps <= 0 or self.tflops <= 0:
            raise ValueError("link_gbps and tflops must be positive")
        if self.sdpa_backends is not None and (
            not self.sdpa_backends
            or not all(isinstance(b, SDPBackend) for b in self.sdpa_backends)
        ):
            raise ValueError(
                f"sdpa_backends must be a non-empty tuple of torch.nn.attention.SDPBackend "
                f"(e.g. (SDPBackend.MATH,)) or None, got {self.sdpa_backends!r}"
            )

    @property
    def shard_size(self) -> int:
        return self.world_size // self.replicate

    def build_meta_model(self) -> nn.Module:
        """A fresh ``meta`` copy of the model: the plan shards it, the user's is kept."""
        if not isinstance(self.model, nn.Module):
            with torch.device("meta"):
                return self.model()
        # Deep-copy the module tree with every tensor replaced by a meta tensor of its
        # shape: a real model is not copied in memory, ties stay ties (same id).
        memo: dict[int, Any] = {}
        for param in self.model.parameters():
            memo[id(param)] = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
        for buffer in self.model.buffers():
            memo[id(buffer)] = torch.empty_like(buffer, device="meta")
        return copy.deepcopy(self.model, memo)

    def make_optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        factory = OPTIMIZERS[self.optimizer] if isinstance(self.optimizer, str) else self.optimizer
        return factory(params)

    @property
    def optimizer_name(self) -> str:
        return self.optimizer if isinstance(self.optimizer, str) else "custom"
