"""plan() against real gloo runs: the peak of ``plan(backend="gloo")`` within 5% of
the one MemTracker measures in the same step, and the collectives counted at the c10d
level equal, count, kind and bytes (the gloo plan's all-to-alls are ours' gloo
reduce-scatters), for ours and, with the NCCL plan, for torch's ``fully_shard`` where
the groups match.

Why 5%: the simulation runs the same code on fake tensors, so the live bytes are the
same program's (measured: byte for byte, here and in benchmarks/bench_plan.py); what
may differ is what fake tensors cannot know (a kernel's data-dependent workspace) and
gloo holding a finished collective's tensors a moment longer on a busy machine. The
issue's target is 5%.

Frozen parameters (fine-tuning: a block, the embedding, both, a peft LoRA model whose
root group is all frozen) are all-gathered but not reduce-scattered, by torch's
``fully_shard`` as by ours, and the plan predicts both. The real runs are measured with
``FrozenSafeMemTracker`` (torch's MemTracker raises on a frozen parameter; for a model
without one it is MemTracker unchanged).
"""

import contextlib
import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

from dtensor_fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard, plan
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss
from dtensor_fsdp.plan.recorders import FrozenSafeMemTracker, collective_totals
from dtensor_fsdp.plan.settings import largest_module_list
from tests._c10d import C10dRecorder
from tests._harness import end_watchdog, run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests._tiny_llama import frozen_tiny_llama

CONFIG = LlamaConfig.tiny()
BATCH = (2, 33)  # (sequences per rank, tokens + 1)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


def _llama() -> nn.Module:
    return Llama(CONFIG)


def _lora() -> nn.Module:
    """peft LoRA on the attention's query and value: every other parameter frozen, the
    root's group (embedding, norm, output) wholly."""
    from peft import LoraConfig, get_peft_model  # optional: the [test] extra

    return get_peft_model(Llama(CONFIG), LoraConfig(r=4, target_modules=["wq", "wv"]))


HAS_PEFT = importlib.util.find_spec("peft") is not None
# Scenarios whose model is not the plain tiny Llama.
MODELS: dict[str, Callable[[], nn.Module]] = {
    # The backward reaches the frozen block (its input needs grad): gathered again.
    "frozen_block": frozen_tiny_llama("layers.0"),
    "frozen_embedding": frozen_tiny_llama("tok_embeddings"),
    # The backward does not reach layers.0: gathered again only as layers.1's prefetch.
    "frozen_prefix": frozen_tiny_llama("tok_embeddings", "layers.0"),
    "lora": _lora,
}
# Scenarios also run by torch's fully_shard ("torch_<name>"), same groups and settings.
ON_TORCH = ("fp32", *MODELS)


def _runnable(name: str) -> bool:
    return HAS_PEFT or name != "lora"


def _params(names: Any) -> list:
    needs_peft = pytest.mark.skipif(not HAS_PEFT, reason="needs peft (the [test] extra)")
    return [pytest.param(n, marks=needs_peft) if n == "lora" else n for n in names]


def _keep_last_block(model: nn.Module, **kwargs: Any) -> None:
    """Every block resharded after forward but the last; then the root."""
    for i, block in enumerate(model.layers):
        fully_shard(block, reshard_after_forward=i < len(model.layers) - 1, **kwargs)
    fully_shard(model, **kwargs)


def _per_block(shard: Callable[..., Any]) -> Callable[..., None]:
    def apply(model: nn.Module, **kwargs: Any) -> None:
        for block in largest_module_list(model):
            shard(block, **kwargs)
        shard(model, **kwargs)

    return apply


# name -> (world size, plan() settings); torch_<name> (ON_TORCH) is the same, run by torch.
SCENARIOS: dict[str, tuple[int, dict[str, Any]]] = {
    "fp32": (2, {}),
    "bf16": (2, {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16)}),
    "last_block_kept": (2, {"shard_fn": _keep_last_block}),
    "offload": (2, {"offload_policy": CPUOffloadPolicy(pin_memory=False)}),
    "hsdp_2x2": (4, {"replicate": 2}),
    # The attention kernel CUDA runs for fp32 grouped-query attention (the real run
    # under sdpa_kernel too): it saves the attention weights the CPU's kernel does not.
    "math_sdpa": (2, {"sdpa_backends": (SDPBackend.MATH,)}),
    **{name: (2, {}) for name in MODELS},
}


def _measure(name: str, shard: Callable[..., Any]) -> tuple[int, list]:
    """Step 2's peak of live bytes (MemTracker, restarted at the step's start, as the
    benchmarks do) and its c10d collectives, on this real rank."""
    settings = SCENARIOS[name][1]
    world = torch.distributed.get_world_size()
    replicate = settings.get("replicate", 1)
    mesh = (
        init_device_mesh("cpu", (world,))
        if replicate == 1
        else init_device_mesh("cpu", (replicate, world // replicate), mesh_dim_names=("r", "s"))
    )
    torch.manual_seed(0)
    model = MODELS.get(name, _llama)()
    settings.get("shard_fn", _per_block(shard))(
        model,
        mesh=mesh,
        mp_policy=settings.get("mp_policy", MixedPrecisionPolicy()),
        offload_policy=settings.get("offload_policy", OffloadPolicy()),
    )
    tokens = torch.randint(0, CONFIG.vocab_size, BATCH)
    kernels = settings.get("sdpa_backends")
    attention = sdpa_kernel(list(kernels)) if kernels else contextlib.nullcontext()
    with FrozenSafeMemTracker() as tracker, attention:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(2):
            tracker.reset_mod_stats()
            # MemTracker has no public reset: the two fields its __enter__ sets.
            tracker._peak_mem_snap = tracker.get_tracker_snapshot("current")
            tracker._peak_mem = {d: s["Total"] for d, s in tracker._peak_mem_snap.items()}
            recorder = C10dRecorder()
            with recorder:
                _loss(model, tokens).backward()
                optimizer.step()
            optimizer.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
    end_watchdog(model)
    return sum(s["Total"] for d, s in peak.items() if d.type == "cpu"), recorder.records


def _run(rank: int, world_size: int) -> dict[str, tuple[str, Any]]:
    cases = {
        name: (lambda n=name: _measure(n, fully_shard))
        for name, (world, _) in SCENARIOS.items()
        if world == world_size and _runnable(name)
    }
    if world_size == 2:
        for name in filter(_runnable, ON_TORCH):
            cases[f"torch_{name}"] = lambda n=name: _measure(n, torch_fully_shard)
    return run_scenarios(cases)


@pytest.fixture(scope="module")
def runs(gloo_pool: GlooPools) -> dict[int, list]:
    return {world: run_distributed(_run, world, pool=gloo_pool) for world in (2, 4)}


# Once per scenario and backend: the NCCL plan of an ON_TORCH scenario serves both tests
# (a plan is deterministic: fake tensors, the same settings).
@functools.cache
def _plan(name: str, backend: str = "nccl"):
    world, settings = SCENARIOS[name]
    return plan(
        MODELS.get(name, _llama),
        world_size=world,
        batch=lambda: torch.randint(0, CONFIG.vocab_size, BATCH),
        loss_fn=_loss,
        backend=backend,
        **settings,
    )


@pytest.mark.parametrize("name", _params(SCENARIOS))
def test_plan_matches_real_run(runs: dict[int, list], name: str) -> None:
    world, _ = SCENARIOS[name]
    measured = scenario_records(runs[world], name)
    predicted, on_gloo = _plan(name), _plan(name, backend="gloo")
    for rank, (peak, records) in enumerate(measured):
        print(f"{name} rank {rank}: predicted/measured peak {on_gloo.peak_bytes / peak:.4f}")
        assert abs(on_gloo.peak_bytes / peak - 1) <= 0.05, (
            name,
            rank,
            on_gloo.peak_bytes,
            peak,
        )
        # The gloo plan sends what the run sent, kinds included; the NCCL plan's
        # reduce-scatters are carried by all-to-alls on gloo.
        assert on_gloo.collectives == collective_totals(records), (name, rank)
        nccl_view = collective_totals(records, all_to_all_as="reduce_scatter")
        assert predicted.collectives == nccl_view, (name, rank)
    # The per-group figures (ours' trace) add up to the c10d count.
    for kind, entry in predicted.collectives.items():
        assert (
            sum(g.collectives.get(kind, {}).get("count", 0) for g in predicted.groups)
            == entry["count"]
        )
        assert (
            sum(g.collectives.get(kind, {}).get("bytes", 0) for g in predicted.groups)
            == entry["bytes"]
        )


@pytest.mark.parametrize("name", _params(ON_TORCH))
def test_plan_matches_torch_fully_shard(runs: dict[int, list], name: str) -> None:
    """The same groups under torch's fully_shard send what ours' plan predicts."""
    predicted = _plan(name)
    for _, records in scenario_records(runs[2], f"torch_{name}"):
        assert predicted.collectives == collective_totals(records, all_to_all_as="reduce_scatter")

