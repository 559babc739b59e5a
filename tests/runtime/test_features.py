"""FSDPModule setters and training features on 2 gloo ranks, against a single-process
reference on the global batch.

Covered: CPU offload; ``set_gradient_divide_factor``, ``set_force_sum_reduction_for_comms``,
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (recording implementations of
torch's ``AllGather`` / ``ReduceScatter`` interfaces), ``set_all_reduce_hook``,
``set_post_optim_event``, ``set_unshard_in_backward``, ``set_reduce_scatter_unused_params``;
``reset_iter_state`` after an exception in forward and in backward; frozen, tied and
ignored parameters; ``register_fsdp_forward_method``; activation checkpointing;
``clip_grad_norm_``'s collectives; ``GradScaler`` with fp16 compute.

Most scenarios use test_comm.py's 3-group MLP (block 0 Linear(8, 16), block 2
Linear(16, 16), the root's head Linear(16, 3)). One spawn runs every scenario; each
records plain figures and tensors and the tests assert on them in the parent.
"""

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import (
    register_fsdp_forward_method as torch_register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils.checkpoint import checkpoint

from dtensor_fsdp import (
    AllGather,
    CommTrace,
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    ReduceScatter,
    fully_shard,
    register_fsdp_forward_method,
)
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._mlp import mlp, shard_mlp
from tests._parity import assert_pairs_close, full, full_pairs, local_pairs, mean_over_world

# torch 2.13 renamed the single-tensor collectives (the old names warn); 2.11 has only
# the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

WORLD_SIZE = 2
STEPS = 2
BATCH = 4  # rows per rank
CLIP_MAX_NORM = 0.05


# ---------------------------------------------------------------------------
# Models, data, and a lockstep trainer
# ---------------------------------------------------------------------------


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(WORLD_SIZE * BATCH, 8, generator=gen), torch.randn(WORLD_SIZE * BATCH, 3, generator=gen)


def _local(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t.chunk(WORLD_SIZE)[rank]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _lockstep(
    rank: int,
    model: nn.Module,
    ref: nn.Module,
    *,
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    after_step: Callable[[], None] | None = None,
    steps: int = STEPS,
) -> list[dict[str, Any]]:
    """SGD steps of ours on this rank's rows and the reference on the global batch;
    per step the mean loss pair and full grads and params next to the reference's."""
    loss = loss or (lambda m, x, y: F.mse_loss(m(x), y))
    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for step in range(steps):
        x, y = _batch(step)
        ours = loss(model, _local(x, rank), _local(y, rank))
        ours.backward()
        theirs = F.mse_loss(ref(x), y)
        theirs.backward()
        rec = {"loss": (mean_over_world(ours), theirs.item()), "grads": full_pairs(model, ref, grads=True)}
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        if after_step is not None:
            after_step()
        rec["params"] = full_pairs(model, ref, grads=False)
        records.append(rec)
    return records


def _render(trace: CommTrace) -> str:
    return " ".join(
        f"{e.kind}({e.fqn or 'root'},{e.phase[0]})"
        for e in sorted(trace.events, key=lambda e: e.start_s)
    )


def _unsharded_bytes(model: nn.Module) -> int:
    return sum(
        p.unsharded_param.untyped_storage().nbytes()
        for m in model.modules()
        if isinstance(m, FSDPModule) and m._get_fsdp_state().groups
        for p in m._get_fsdp_state().fsdp_params()
    )


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------


def _offload(rank: int, mesh: Any, pin_memory: bool) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh, offload_policy=CPUOffloadPolicy(pin_memory=pin_memory))
    records = _lockstep(rank, model, ref)
    x, y = _batch(0)
    F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    return {
        "records": records,
        "param_devices": {p.to_local().device.type for p in model.parameters()},
        "grad_devices": {p.grad.to_local().device.type for p in model.parameters()},
    }


def _divide_factor(rank: int, mesh: Any, factor: float | None, force_sum: bool) -> dict[str, Any]:
    """With factor 1.0 each rank's loss is its share of the global mean (sum over its
    rows / global rows), so the summed grads are the global mean's."""
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    for module in model.modules():  # not recursive, as torch's: every FSDP module
        if isinstance(module, FSDPModule) and factor is not None:
            module.set_gradient_divide_factor(factor)
        if isinstance(module, FSDPModule) and force_sum:
            module.set_force_sum_reduction_for_comms(True)

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if factor == 1.0:
            return F.mse_loss(m(x), y, reduction="sum") / (WORLD_SIZE * y.numel())
        return F.mse_loss(m(x), y)

    records = _lockstep(rank, model, ref, loss=loss, steps=1)
    if factor == 1.0:  # each rank's loss is 1/W of its mean: the global mean is their sum
        records[0]["loss"] = (records[0]["loss"][0] * WORLD_SIZE, records[0]["loss"][1])
    return {"records": records}


def _divide_factor_on_the_root_only(mesh: Any) -> dict[str, Any]:
    """``set_gradient_divide_factor`` (and force-sum, which torch needs on gloo) on the
    root only: the blocks keep dividing by the world size, in both libraries."""
    base = mlp()
    models = {}
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        model = shard_mlp(copy.deepcopy(base), mesh, shard=shard)
        model.set_gradient_divide_factor(1.0)
        model.set_force_sum_reduction_for_comms(True)
        model(torch.randn(2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
        models[name] = model
    return {"grads": local_pairs(models["ours"], models["torch"], grads=True)}


def _torch_divide_factor_on_gloo(mesh: Any) -> str:
    """torch's FSDP2 with a divide factor alone: what its first backward raises on
    gloo (it reduces with PREMUL_SUM, which gloo lacks); ours trains (above)."""
    model = shard_mlp(mlp(), mesh, shard=torch_fully_shard)
    model.set_gradient_divide_factor(1.0)
    try:
        model(torch.randn(2, 8)).sum().backward()
    except Exception as error:  # noqa: BLE001 - the type is what is compared
        return f"{type(error).__name__}: {error}"
    return "no error"


class RecordingAllGather(AllGather):
    """torch 2.13's AllGather interface on the plain c10d all-gather, counting calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.dtype, int, int]] = []  # (dtype, input dim, output numel)
        self.allocations = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls.append((input_tensor.dtype, input_tensor.dim(), output_tensor.numel()))
        return _all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)


class RecordingReduceScatter(ReduceScatter):
    """torch 2.13's ReduceScatter interface on the plain c10d reduce-scatter."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []  # (op, input numel, output numel)
        self.allocations = 0

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls.append((str(op), input_tensor.numel(), output_tensor.numel()))
        return _reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    gathers = {name: RecordingAllGather() for name in ("root", "0", "2")}
    scatters = {name: RecordingReduceScatter() for name in ("root", "0", "2")}
    for name, module in (("root", model), ("0", model[0]), ("2", model[2])):
        module.set_custom_all_gather(gathers[name])  # not recursive: one per group
        module.set_custom_reduce_scatter(scatters[name])
    records = _lockstep(rank, model, ref)
    return {
        "records": records,
        "gathers": {n: (c.calls, c.allocations) for n, c in gathers.items()},
        "scatters": {n: (c.calls, c.allocations) for n, c in scatters.items()},
    }


def _all_reduce_hook(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    calls: list[tuple[str, int, int]] = []
    for name, module in (("root", model), ("0", model[0]), ("2", model[2])):
        def hook(reduced: torch.Tensor, name: str = name) -> None:
            calls.append((name, reduced.dim(), reduced.numel()))
            reduced.mul_(2)

        module.set_all_reduce_hook(hook)
    return {"records": _lockstep(rank, model, ref, steps=1), "calls": calls}


def _post_optim_event(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    # On a CPU build an Event can be made and waited on but not recorded.
    events = []

    def after_step() -> None:
        event = torch.Event()
        events.append(event)
        model.set_post_optim_event(event)

    return {"records": _lockstep(rank, model, ref, after_step=after_step), "events": len(events)}


class EmbeddingNet(nn.Module):
    """Embedding (its own group) -> Linear block -> root head; embedding backward needs
    no weight values, only the indices."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.block(self.emb(tokens)))).mean(dim=1)


def _unshard_in_backward(rank: int, mesh: Any, unshard_in_backward: bool) -> dict[str, Any]:
    base = EmbeddingNet()
    ref = copy.deepcopy(base)
    fully_shard(base.emb, mesh=mesh)
    fully_shard(base.block, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    model.emb.set_unshard_in_backward(unshard_in_backward)
    trace = CommTrace()
    model.set_comm_trace(trace)
    tokens = torch.randint(0, 16, (WORLD_SIZE * BATCH, 5), generator=torch.Generator().manual_seed(0))

    def loss(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(m(tokens.chunk(WORLD_SIZE)[rank] if m is model else tokens), y)

    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for step in range(STEPS):
        trace.clear()
        _, y = _batch(step)
        loss(model, None, _local(y, rank)).backward()
        loss(ref, None, y).backward()
        records.append({"grads": full_pairs(model, ref, grads=True), "trace": _render(trace)})
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    return {"records": records, "params": full_pairs(model, ref, grads=False)}


class Branchy(nn.Module):
    """``b`` runs only when asked: with different flags per rank, one rank's ``b`` gets
    no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        h = F.relu(self.a(x))
        return h + self.b(h) if use_b else h


class BranchyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.branchy = Branchy()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.head(self.branchy(x, use_b))


def _unused_params(rank: int, mesh: Any) -> dict[str, Any]:
    """Rank 0 uses ``branchy.b``, rank 1 does not; the reference averages the two
    ranks' losses, so b's grad is half of rank 0's."""
    base = BranchyNet()
    ref = copy.deepcopy(base)
    fully_shard(base.branchy, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    model.set_reduce_scatter_unused_params(True)
    trace = CommTrace()
    model.set_comm_trace(trace)
    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for step in range(STEPS):
        trace.clear()
        x, y = _batch(step)
        F.mse_loss(model(_local(x, rank), use_b=rank == 0), _local(y, rank)).backward()
        ref_loss = sum(
            F.mse_loss(ref(_local(x, r), use_b=r == 0), _local(y, r)) for r in range(WORLD_SIZE)
        ) / WORLD_SIZE
        ref_loss.backward()
        records.append({
            "grads": full_pairs(model, ref, grads=True),
            "rs_bytes": [(e.fqn, e.nbytes) for e in trace.events if e.kind == "reduce_scatter"],
        })
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
    return {"records": records, "params": full_pairs(model, ref, grads=False)}


class Flaky(nn.Linear):
    """A Linear that raises inside its forward (its params unsharded) when asked."""

    fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        if self.fail:
            raise RuntimeError("injected forward failure")
        return out


class FlakyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.b0 = nn.Linear(8, 16)
        self.b1 = Flaky(16, 16)
        self.head = nn.Linear(16, 3)
        self.fail_in_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.b0(x))
        if self.fail_in_backward:
            # Fires after b1's backward, so b1's reduce-scatter is already issued.
            h.register_hook(self._raise)
        return self.head(F.relu(self.b1(h)))

    @staticmethod
    def _raise(grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected backward failure")


def _reset_iter_state(rank: int, mesh: Any, where: str) -> dict[str, Any]:
    base = FlakyNet()
    ref = copy.deepcopy(base)
    fully_shard(base.b0, mesh=mesh)
    fully_shard(base.b1, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    x, y = _batch(99)
    # One clean step first, so the failure hits a model in its steady state.
    F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    F.mse_loss(ref(x), y).backward()
    model.zero_grad()
    ref.zero_grad()
    if where == "forward":
        model.b1.fail = True
    else:
        model.fail_in_backward = True
    try:
        F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
        raised = None
    except RuntimeError as error:
        raised = str(error)
    model.b1.fail = model.fail_in_backward = False
    model.reset_iter_state()
    unsharded_after_reset = _unsharded_bytes(model)
    model.zero_grad()
    trace = CommTrace()
    model.set_comm_trace(trace)
    records = _lockstep(rank, model, ref)
    return {
        "raised": raised,
        "unsharded_after_reset": unsharded_after_reset,
        "records": records,
        "trace": _render(trace),
    }


class Generator(nn.Module):
    """``generate`` uses the root's own params directly, not through ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.body(x)))

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.relu(self.body(x)), 2 * self.head.weight)


def _forward_method(rank: int, mesh: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    base = Generator()
    ref = copy.deepcopy(base)
    plain = Generator()
    fully_shard(plain.body, mesh=mesh)
    fully_shard(plain, mesh=mesh)
    try:
        with torch.no_grad():
            plain.generate(torch.randn(2, 8))
        out["unregistered"] = None
    except RuntimeError as error:  # the root's head.weight is still a sharded DTensor
        out["unregistered"] = str(error)
    fully_shard(base.body, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    register_fsdp_forward_method(model, "generate")
    trace = CommTrace()
    model.set_comm_trace(trace)
    x, _ = _batch(0)
    with torch.no_grad():
        generated = model.generate(_local(x, rank))
    out["no_grad_trace"] = [(e, fqn or "root", phase) for e, fqn, phase in trace.schedule()]
    out["no_grad_diff"] = (generated - ref.generate(_local(x, rank))).abs().max().item()
    out["registered_after"] = {n: type(p).__name__ for n, p in model.named_parameters()}
    theirs = Generator()
    torch_fully_shard(theirs.body, mesh=mesh)
    torch_fully_shard(theirs, mesh=mesh)
    torch_register_fsdp_forward_method(theirs, "generate")
    with torch.no_grad():
        theirs.generate(_local(x, rank))
    out["torch_registered_after"] = {n: type(p).__name__ for n, p in theirs.named_parameters()}
    # With grad: generate's output drives a backward that reduce-scatters as usual.
    trace.clear()
    model.generate(_local(x, rank)).pow(2).mean().backward()
    ref_loss = sum(ref.generate(_local(x, r)).pow(2).mean() for r in range(WORLD_SIZE)) / WORLD_SIZE
    ref_loss.backward()
    out["grads"] = _trainable_grads(model, ref)
    out["grad_is_none"] = {n: p.grad is None for n, p in model.named_parameters()}
    out["ref_grad_is_none"] = {n: p.grad is None for n, p in ref.named_parameters()}
    out["grad_trace"] = _render(trace)
    return out


class ACNet(nn.Module):
    """Two blocks and a head; ``mode`` checkpoints each block from outside (the
    module call, so FSDP's hooks run again on recompute) or inside (a function of
    the block's forward, so no hook runs on recompute)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([ACBlock(8, 16), ACBlock(16, 16)])
        self.head = nn.Linear(16, 3)
        self.outer = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.outer else block(x)
        return self.head(x)


class ACBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)
        self.inner = False
        self.recomputes = 0

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        self.recomputes += 1
        return F.relu(self.linear(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._body, x, use_reentrant=False) if self.inner else self._body(x)


def _activation_checkpointing(rank: int, mesh: Any, mode: str) -> dict[str, Any]:
    base = ACNet()
    ref = copy.deepcopy(base)
    for block in base.blocks:
        block.inner = mode == "inner"
        fully_shard(block, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    model.outer = mode == "outer"
    trace = CommTrace()
    model.set_comm_trace(trace)
    records = _lockstep(rank, model, ref)
    steps = len(trace.events) // STEPS
    trace.events[:] = trace.events[-steps:]
    return {
        "records": records,
        "trace": _render(trace),
        "body_calls": [b.recomputes for b in model.blocks],  # forwards + recomputes
    }


def _clip(rank: int, mesh: Any, foreach: bool | None) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(base, mesh)
    x, y = _batch(0)
    F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    F.mse_loss(ref(x), y).backward()
    with CommDebugMode() as comm_mode:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX_NORM, foreach=foreach)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP_MAX_NORM, foreach=foreach)
    return {
        "norm": (full(norm).item(), ref_norm.item()),
        "norm_type": type(norm).__name__,
        "comm_counts": {str(op).split(".")[-1]: n for op, n in comm_mode.get_comm_counts().items()},
        "total_comms": comm_mode.get_total_counts(),
        "clipped_grads": full_pairs(model, ref, grads=True),
    }


def _grad_scaler(rank: int, mesh: Any) -> dict[str, Any]:
    """fp16 compute with torch.amp.GradScaler("cpu"), one step per batch."""
    base = mlp()
    ref = copy.deepcopy(base)
    model = shard_mlp(
        base, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = F.mse_loss(model(_local(x, rank)).float(), _local(y, rank))
        scaler.scale(loss).backward()
        scaled_grad = full(model[0].weight.grad)
        scaler.unscale_(optim)
        F.mse_loss(ref(x), y).backward()
        rec = {
            "scaled_over_unscaled": (scaled_grad.norm() / full(model[0].weight.grad).norm()).item(),
            "grads": full_pairs(model, ref, grads=True),
        }
        scaler.step(optim)
        scaler.update()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        rec["scale"] = scaler.get_scale()
        rec["params"] = full_pairs(model, ref, grads=False)
        records.append(rec)
    return {"records": records}


def _grad_scaler_inf_on_one_rank(rank: int, mesh: Any) -> dict[str, Any]:
    """An inf in rank 1's grad shard only: every rank must skip the step and halve the
    scale, or the ranks' shards would drift apart."""
    base = mlp()
    model = shard_mlp(
        base, mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    optim = _sgd(model)
    x, y = _batch(0)
    scaler.scale(F.mse_loss(model(_local(x, rank)).float(), _local(y, rank))).backward()
    if rank == 1:
        model[0].weight.grad.to_local()[0, 0] = float("inf")
    before = [p.to_local().detach().clone() for p in model.parameters()]
    scaler.step(optim)
    scaler.update()
    return {
        "scale": scaler.get_scale(),
        "stepped": [not torch.equal(b, p.to_local()) for b, p in zip(before, model.parameters())],
    }


class LoRALinear(nn.Module):
    """A frozen Linear(16, 16) plus a trainable rank-4 update."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.lora_a = nn.Linear(16, 4, bias=False)
        self.lora_b = nn.Linear(4, 16, bias=False)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


def _frozen(rank: int, mesh: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), LoRALinear(), nn.ReLU(), nn.Linear(16, 3))
    base[0].requires_grad_(False)
    ref = copy.deepcopy(base)
    frozen_before = {n: p.detach().clone() for n, p in base.named_parameters() if not p.requires_grad}
    fully_shard(base[2], mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    trace = CommTrace()
    model.set_comm_trace(trace)
    optim = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    ref_optim = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1)
    records = []
    for step in range(STEPS):
        trace.clear()
        x, y = _batch(step)
        F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
        F.mse_loss(ref(x), y).backward()
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        rec = {
            "grad_is_none": {n: p.grad is None for n, p in model.named_parameters()},
            "grads": {n: pair for n, pair in _trainable_grads(model, ref).items() if n in trainable},
            "comms": [(e.kind, e.fqn, e.nbytes) for e in sorted(trace.events, key=lambda e: e.start_s)],
        }
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        rec["params"] = full_pairs(model, ref, grads=False)
        records.append(rec)
    frozen_moved = {
        n: not torch.equal(full(p), frozen_before[n])
        for n, p in model.named_parameters() if n in frozen_before
    }
    return {"records": records, "frozen_moved": frozen_moved}


def _trainable_grads(model: nn.Module, ref: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    ref_params = dict(ref.named_parameters())
    return {
        n: (full(p.grad), ref_params[n].grad.clone())
        for n, p in model.named_parameters()
        if p.grad is not None
    }


class TiedNet(nn.Module):
    """Embedding and output head share one weight; both are the root's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, 8)
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.block(self.emb(tokens))))


def _tied(rank: int, mesh: Any) -> dict[str, Any]:
    base = TiedNet()
    ref = copy.deepcopy(base)
    fully_shard(base.block, mesh=mesh)
    model = fully_shard(base, mesh=mesh)
    gen = torch.Generator().manual_seed(0)
    optim, ref_optim = _sgd(model), _sgd(ref)
    records = []
    for _ in range(STEPS):
        tokens = torch.randint(0, 16, (WORLD_SIZE * BATCH, 6), generator=gen)
        inp, tgt = tokens[:, :-1], tokens[:, 1:]

        def ce(m: nn.Module, i: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(m(i).flatten(0, 1), t.flatten(0, 1))

        ce(model, _local(inp, rank), _local(tgt, rank)).backward()
        ce(ref, inp, tgt).backward()
        records.append({"grads": full_pairs(model, ref, grads=True)})
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        records[-1]["params"] = full_pairs(model, ref, grads=False)
    return {
        "records": records,
        "still_tied": model.head.weight is model.emb.weight,
        "param_names": [n for n, _ in model.named_parameters()],
    }


def _tied_across_groups(mesh: Any) -> dict[str, Any]:
    model = TiedNet()
    fully_shard(model.emb, mesh=mesh)
    try:
        fully_shard(model.head, mesh=mesh)
        return {"error": None}
    except ValueError as error:
        return {
            "error": str(error),
            "head_untouched": type(model.head) is nn.Linear and not isinstance(model.head.weight, DTensor),
        }


def _ignored(rank: int, mesh: Any) -> dict[str, Any]:
    base = mlp()
    ref = copy.deepcopy(base)
    ref_local = copy.deepcopy(base)  # this rank's rows only: the unreduced grad
    fully_shard(base[0], mesh=mesh)
    fully_shard(base[2], mesh=mesh)
    model = fully_shard(base, mesh=mesh, ignored_params={base[4].weight})
    trace = CommTrace()
    model.set_comm_trace(trace)
    x, y = _batch(0)
    F.mse_loss(model(_local(x, rank)), _local(y, rank)).backward()
    F.mse_loss(ref(x), y).backward()
    F.mse_loss(ref_local(_local(x, rank)), _local(y, rank)).backward()
    return {
        "types": {n: type(p).__name__ for n, p in model.named_parameters()},
        "ignored_grad": (model[4].weight.grad.clone(), ref_local[4].weight.grad.clone()),
        "global_grad": ref[4].weight.grad.clone(),
        "grads": {n: pair for n, pair in full_pairs(model, ref, grads=True).items() if n != "4.weight"},
        "root_bytes": [(e.kind, e.nbytes) for e in trace.events if e.fqn == ""],
    }


def _run(rank: int, world_size: int) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios({
        "offload": lambda: _offload(rank, mesh, pin_memory=True),
        "offload_unpinned": lambda: _offload(rank, mesh, pin_memory=False),
        "divide_factor_1": lambda: _divide_factor(rank, mesh, 1.0, force_sum=False),
        "divide_factor_4": lambda: _divide_factor(rank, mesh, 4.0, force_sum=False),
        "force_sum": lambda: _divide_factor(rank, mesh, None, force_sum=True),
        "force_sum_factor_1": lambda: _divide_factor(rank, mesh, 1.0, force_sum=True),
        "torch_divide_factor": lambda: _torch_divide_factor_on_gloo(mesh),
        "divide_factor_root_only": lambda: _divide_factor_on_the_root_only(mesh),
        "custom_comms": lambda: _custom_comms(rank, mesh),
        "all_reduce_hook": lambda: _all_reduce_hook(rank, mesh),
        "post_optim_event": lambda: _post_optim_event(rank, mesh),
        "unshard_in_backward": lambda: _unshard_in_backward(rank, mesh, True),
        "no_unshard_in_backward": lambda: _unshard_in_backward(rank, mesh, False),
        "unused_params": lambda: _unused_params(rank, mesh),
        "reset_forward": lambda: _reset_iter_state(rank, mesh, "forward"),
        "reset_backward": lambda: _reset_iter_state(rank, mesh, "backward"),
        "forward_method": lambda: _forward_method(rank, mesh),
        "ac_none": lambda: _activation_checkpointing(rank, mesh, "none"),
        "ac_outer": lambda: _activation_checkpointing(rank, mesh, "outer"),
        "ac_inner": lambda: _activation_checkpointing(rank, mesh, "inner"),
        "clip": lambda: _clip(rank, mesh, foreach=None),
        "clip_no_foreach": lambda: _clip(rank, mesh, foreach=False),
        "grad_scaler": lambda: _grad_scaler(rank, mesh),
        "grad_scaler_inf": lambda: _grad_scaler_inf_on_one_rank(rank, mesh),
        "frozen": lambda: _frozen(rank, mesh),
        "tied": lambda: _tied(rank, mesh),
        "tied_across_groups": lambda: _tied_across_groups(mesh),
        "ignored": lambda: _ignored(rank, mesh),
    })


@pytest.fixture(scope="module")
def run() -> list[dict[str, Any]]:
    return run_distributed(_run, WORLD_SIZE, timeout=180)


def _assert_parity(records: list[dict[str, Any]], what: str, grad_scale: float = 1.0) -> None:
    for step, rec in enumerate(records):
        if "loss" in rec:
            ours, ref = rec["loss"]
            assert ours == pytest.approx(ref, rel=1e-5), f"{what} step {step} loss"
        scaled = {n: (a, grad_scale * b) for n, (a, b) in rec["grads"].items()}
        assert_pairs_close(scaled, f"{what} step {step} grad")
        if "params" in rec:
            assert_pairs_close(rec["params"], f"{what} step {step} param")


# ---------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["offload", "offload_unpinned"])
def test_cpu_offload_matches_reference_with_shards_on_cpu(run, name):
    for rec in scenario_records(run, name):
        _assert_parity(rec["records"], name)
        assert rec["param_devices"] == rec["grad_devices"] == {"cpu"}


@pytest.mark.parametrize("name", ["divide_factor_1", "force_sum", "force_sum_factor_1"])
def test_divide_factor_and_sum_reduction_keep_the_numbers(run, name):
    for rec in scenario_records(run, name):
        _assert_parity(rec["records"], name)


def test_divide_factor_alone_works_on_gloo_where_torchs_raises(run):
    # README, differences: ours divides after a SUM on any backend; torch's asks gloo
    # for PREMUL_SUM (torchtitan adds set_force_sum_reduction_for_comms(True) for it).
    for outcome in scenario_records(run, "torch_divide_factor"):
        assert outcome.startswith("RuntimeError") and "PREMUL_SUM" in outcome, outcome
    for rec in scenario_records(run, "divide_factor_1"):
        _assert_parity(rec["records"], "factor 1 without force_sum")


def test_divide_factor_applies_to_the_module_it_is_set_on(run):
    # The blocks' grads are means over the 2 ranks, the root's sums: as torch's. A
    # recursive setter would double the blocks' grads.
    for rec in scenario_records(run, "divide_factor_root_only"):
        assert_pairs_close(rec["grads"], "root-only divide factor")


def test_divide_factor_divides_the_sum(run):
    # Mean losses per rank, summed over 2 ranks and divided by 4: half the average.
    for rec in scenario_records(run, "divide_factor_4"):
        _assert_parity([{"grads": rec["records"][0]["grads"]}], "factor 4", grad_scale=0.5)


def test_custom_all_gather_and_reduce_scatter_are_used(run):
    for rec in scenario_records(run, "custom_comms"):
        _assert_parity(rec["records"], "custom comms")
        gathers, scatters = rec["gathers"], rec["scatters"]
        # Per step: every group all-gathers in forward, the blocks again in backward (the
        # root keeps its params); 1-D uint8 buffers of W x the padded shard bytes (see
        # test_comm.py).
        assert gathers == {
            "root": ([(torch.uint8, 1, 272)] * STEPS, STEPS),
            "0": ([(torch.uint8, 1, 576)] * 2 * STEPS, 2 * STEPS),
            "2": ([(torch.uint8, 1, 1088)] * 2 * STEPS, 2 * STEPS),
        }
        # One SUM reduce-scatter per group per step: fp32 numels in, 1/W out.
        sum_op = str(dist.ReduceOp.SUM)
        assert scatters == {
            "root": ([(sum_op, 68, 34)] * STEPS, STEPS),
            "0": ([(sum_op, 144, 72)] * STEPS, STEPS),
            "2": ([(sum_op, 272, 136)] * STEPS, STEPS),
        }


def test_all_reduce_hook_sees_each_reduced_buffer_and_can_scale_it(run):
    for rec in scenario_records(run, "all_reduce_hook"):
        _assert_parity([{"grads": rec["records"][0]["grads"]}], "hook x2", grad_scale=2.0)
        # Once per group, on the 1-D reduced shard (padded numel / W), in backward order.
        assert rec["calls"] == [("2", 1, 136), ("root", 1, 34), ("0", 1, 72)]


def test_post_optim_event_leaves_training_unchanged(run):
    for rec in scenario_records(run, "post_optim_event"):
        assert rec["events"] == STEPS
        _assert_parity(rec["records"], "post_optim_event")


def test_unshard_in_backward_false_skips_the_backward_all_gather(run):
    default = scenario_records(run, "unshard_in_backward")[0]["records"]
    skipped = scenario_records(run, "no_unshard_in_backward")
    # By default the block's pre-backward prefetches the embedding's params.
    assert default[1]["trace"] == (
        "all_gather(root,f) all_gather(emb,f) all_gather(block,f) all_gather(block,b) "
        "all_gather(emb,b) reduce_scatter(block,b) reduce_scatter(root,b) reduce_scatter(emb,b)"
    )
    assert skipped[0]["records"][1]["trace"] == (
        "all_gather(root,f) all_gather(emb,f) all_gather(block,f) all_gather(block,b) "
        "reduce_scatter(block,b) reduce_scatter(root,b) reduce_scatter(emb,b)"
    )
    for rec in skipped:
        for step in rec["records"]:
            assert_pairs_close(step["grads"], "no unshard in backward grad")
        assert_pairs_close(rec["params"], "no unshard in backward param")


def test_reduce_scatter_unused_params(run):
    for rank, rec in enumerate(scenario_records(run, "unused_params")):
        for step in rec["records"]:
            assert_pairs_close(step["grads"], f"rank {rank} grad")
            # Both ranks reduce-scatter the whole group: a (2, 8) padded a and b, fp32.
            # x has no grad, so neither group's post-backward node fires: both reduce-scatter
            # from the final callback, the root first.
            assert step["rs_bytes"] == [("", 2 * (2 * 8 + 2) * 4), ("branchy", 2 * (8 * 8 + 8) * 4)]
        assert_pairs_close(rec["params"], f"rank {rank} param")
        grad_b = rec["records"][0]["grads"]["branchy.b.weight"][0]
        assert grad_b.abs().sum() > 0


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_reset_iter_state_after_an_exception(run, where):
    for rank, rec in enumerate(scenario_records(run, f"reset_{where}")):
        assert rec["raised"] == f"injected {where} failure"
        assert rec["unsharded_after_reset"] == 0
        _assert_parity(rec["records"], f"rank {rank} after a {where} failure")
    # The steps after the reset run the normal schedule.
    trace = scenario_records(run, f"reset_{where}")[0]["trace"]
    step = (
        "all_gather(root,f) all_gather(b0,f) all_gather(b1,f) all_gather(b1,b) all_gather(b0,b) "
        "reduce_scatter(b1,b) reduce_scatter(root,b) reduce_scatter(b0,b)"
    )
    assert trace == " ".join([step] * STEPS)


def test_registered_forward_method_unshards_and_reshards(run):
    for rec in scenario_records(run, "forward_method"):
        # Unregistered, generate meets the root's sharded DTensor head.weight.
        assert rec["unregistered"] is not None and "DTensor" in rec["unregistered"]
        assert rec["no_grad_diff"] < 1e-6
        # The root stays unsharded after a no_grad call, as torch's (generate calls no
        # forward here: HF's, which does, is resharded at its end; test_eval_generate.py).
        assert rec["registered_after"] == rec["torch_registered_after"] == {
            "body.weight": "DTensor", "body.bias": "DTensor",
            "head.weight": "Parameter", "head.bias": "Parameter",
        }
        assert_pairs_close(rec["grads"], "generate grad")
        # generate does not use head.bias: no grad for it, as on the reference.
        assert rec["grad_is_none"] == rec["ref_grad_is_none"] == {
            "body.weight": False, "body.bias": False, "head.weight": False, "head.bias": True,
        }
    rec = scenario_records(run, "forward_method")[0]
    assert_expected_inline("\n".join(" ".join(t) for t in rec["no_grad_trace"]), """\
unshard root forward
unshard body forward
reshard body forward""")
    # The root is still unsharded from the no_grad call (its sharded params unchanged),
    # so only the body is all-gathered. x has no grad, so both groups reduce-scatter from
    # the final callback, root first.
    assert rec["grad_trace"] == (
        "all_gather(body,f) all_gather(body,b) reduce_scatter(root,b) reduce_scatter(body,b)"
    )


@pytest.mark.parametrize("mode", ["none", "outer", "inner"])
def test_activation_checkpointing_matches_and_adds_no_all_gather(run, mode):
    for rec in scenario_records(run, f"ac_{mode}"):
        _assert_parity(rec["records"], f"AC {mode}")
        # Recompute runs each block's body once more per step, without communicating.
        assert rec["body_calls"] == [STEPS * (1 if mode == "none" else 2)] * 2
    assert scenario_records(run, f"ac_{mode}")[0]["trace"] == (
        "all_gather(root,f) all_gather(blocks.0,f) all_gather(blocks.1,f) all_gather(blocks.1,b) "
        "all_gather(blocks.0,b) reduce_scatter(blocks.1,b) reduce_scatter(root,b) "
        "reduce_scatter(blocks.0,b)"
    )


@pytest.mark.parametrize("name", ["clip", "clip_no_foreach"])
def test_clip_grad_norm(run, name):
    for rec in scenario_records(run, name):
        norm, ref_norm = rec["norm"]
        assert ref_norm > CLIP_MAX_NORM
        assert norm == pytest.approx(ref_norm, rel=1e-5)
        assert rec["norm_type"] == "DTensor"
        assert_pairs_close(rec["clipped_grads"], f"{name} clipped grad")
    # The issue asks for one all-reduce for the total norm, not one per parameter.
    assert scenario_records(run, name)[0]["comm_counts"] == {"all_reduce": 1}


def test_grad_scaler_with_fp16_compute(run):
    for rec in scenario_records(run, "grad_scaler"):
        for step, step_rec in enumerate(rec["records"]):
            # The scaled grads were unscaled by the init scale, and no inf was found.
            assert step_rec["scaled_over_unscaled"] == pytest.approx(2.0**10, rel=1e-3)
            assert step_rec["scale"] == 2.0**10
            assert_pairs_close(step_rec["grads"], f"fp16 step {step} grad", atol=5e-3, rtol=5e-2)
            assert_pairs_close(step_rec["params"], f"fp16 step {step} param", atol=1e-3, rtol=1e-2)


def test_grad_scaler_skips_the_step_on_every_rank_if_one_has_inf(run):
    # DTensor's unscale_ combines found_inf over the mesh, so no ShardedGradScaler needed.
    for rec in scenario_records(run, "grad_scaler_inf"):
        assert rec == {"scale": 2.0**9, "stepped": [False] * 6}


def test_frozen_params_get_no_grad_and_no_reduce_scatter_bytes(run):
    for rec in scenario_records(run, "frozen"):
        for step in rec["records"]:
            assert step["grad_is_none"] == {
                "0.weight": True, "0.bias": True,
                "2.base.weight": True, "2.base.bias": True,
                "2.lora_a.weight": False, "2.lora_b.weight": False,
                "4.weight": False, "4.bias": False,
            }
            assert_pairs_close(step["grads"], "trainable grad")
            assert_pairs_close(step["params"], "param")
        assert rec["frozen_moved"] == {"0.weight": False, "0.bias": False, "2.base.weight": False, "2.base.bias": False}
    comms = scenario_records(run, "frozen")[0]["records"][0]["comms"]
    # All-gathers carry every param: group 2 is (16x16 + 16 + 4x16 + 16x4) fp32, the
    # root 0's (16x8 + 16) and 4's (2 ranks x 2 rows x 16, 2 x 2) padded. Reduce-scatters
    # carry the trainable ones only: the root 4.weight and 4.bias padded as above, group
    # 2 lora_a (4x16) + lora_b (16x4). Group 2 resharded after forward and is gathered
    # again for backward. Its input comes from a frozen layer and has no grad, so it
    # reduce-scatters from the final callback, after the root.
    assert comms == [
        ("all_gather", "", (16 * 8 + 16 + 4 * 16 + 4) * 4),
        ("all_gather", "2", (16 * 16 + 16 + 4 * 16 + 16 * 4) * 4),
        ("all_gather", "2", (16 * 16 + 16 + 4 * 16 + 16 * 4) * 4),
        ("reduce_scatter", "", (4 * 16 + 4) * 4),
        ("reduce_scatter", "2", (4 * 16 + 16 * 4) * 4),
    ]


def test_tied_params_in_one_group(run):
    for rec in scenario_records(run, "tied"):
        assert rec["still_tied"]
        assert rec["param_names"] == ["emb.weight", "block.weight", "block.bias"]
        for step in rec["records"]:
            assert_pairs_close(step["grads"], "tied grad")
            assert_pairs_close(step["params"], "tied param")


def test_tied_params_across_groups_raise(run):
    rec = scenario_records(run, "tied_across_groups")[0]
    assert rec["error"] is not None and "shared with a parameter already managed by another FSDP group" in rec["error"]
    assert rec["head_untouched"]


def test_ignored_params_stay_plain_and_unreduced(run):
    for rank, rec in enumerate(scenario_records(run, "ignored")):
        assert rec["types"] == {
            "0.weight": "DTensor", "0.bias": "DTensor", "2.weight": "DTensor",
            "2.bias": "DTensor", "4.weight": "Parameter", "4.bias": "DTensor",
        }
        ours, local_ref = rec["ignored_grad"]
        torch.testing.assert_close(ours, local_ref, atol=1e-6, rtol=1e-5)
        assert not torch.allclose(ours, rec["global_grad"])  # not averaged over ranks
        assert_pairs_close(rec["grads"], f"rank {rank} grad")
        # The root group holds 4.bias only: 3 values padded to 2 per rank, fp32.
        assert rec["root_bytes"] == [("all_gather", 16), ("reduce_scatter", 16)]
