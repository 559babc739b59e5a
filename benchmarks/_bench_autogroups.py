"""Automatic groups (``auto_shard``) against one group per block, on a model of many
small modules, on 2 real gloo ranks; ``bench_plan.py`` prints its figures last.

    python benchmarks/_bench_autogroups.py [--quick]

Three models (``CASES``), fp32, AdamW, W=2 gloo:

- ``blocks``, the issue's many small modules: ``BlockStack``
  (``dtensor_fsdp/models/block_stack.py``), 64 residual blocks of two
  ``Linear(128, 128)`` (32 with ``--quick``), a norm and a head in the root; a batch
  of 32 rows per rank; budget 1.25 x the predicted peak of one group per block, fully
  resharded (the smallest budget ``auto_shard`` accepts is 1 x);
- ``llama_tiny`` and ``llama`` (not with ``--quick``): the ``tiny`` preset (train.py's
  default, the main job's) and the ``small`` one, 4 x 128 tokens per rank; budget 1.3 x
  that peak, as the issue asks.

The baseline is one group per block, every block resharded after forward, the root
kept (torch's default). This process plans (``auto_shard`` needs no process group,
``backend="gloo"`` and this CPU's figures for the time model: ``CPU_LINK_GBPS``,
``CPU_TFLOPS``) and reports the predicted step times next to the measured ones; one
``torchrun`` launch of 2 ranks per model then, per rank:

1. measures the auto groups' peak of live bytes with MemTracker in step 2 (the model
   alone, as the plan simulates it) and checks it against the budget;
2. counts each variant's collectives in one step (ours' ``CommTrace``, whose counts
   ``tests/plan/test_plan_gloo.py`` checks equal to the c10d level's);
3. times both variants in interleaved rounds (the order alternating), one step each,
   every step timed on its slowest rank; the median over the rounds after the warm-up
   (30 rounds for ``blocks``, 100 for the Llamas, whose difference is smaller).
"""

import argparse
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from common.dist import slowest_seconds
from common.tensor_memory import restart_step, total_bytes
from torch import nn
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh

from dtensor_fsdp import AutoPlan, CommTrace, auto_shard, fully_shard
from dtensor_fsdp.models.block_stack import BlockStack
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss
from dtensor_fsdp.plan import plan
from dtensor_fsdp.plan.auto import AutoGroup, apply_calls
from dtensor_fsdp.plan.candidates import count
from dtensor_fsdp.plan.settings import largest_module_list

REPO = Path(__file__).resolve().parents[1]
WORLD = 2
MiB = 2**20
# The time model's link and compute for this CPU (plan()'s defaults are a GPU's),
# measured with 2 gloo ranks on 2 cores, one thread each: an all-gather moves about
# 10 Gbit/s past its 0.3 ms latency; a matmul of the tiny Llama's shapes runs at about
# 0.09 TFLOP/s. A collective's fixed cost is auto_shard's gloo default (1 ms).
CPU_LINK_GBPS, CPU_TFLOPS = 10.0, 0.09


@dataclass(frozen=True)
class Case:
    """A model, one rank's batch and the loss; the budget is ``over_finest`` times
    the predicted peak of one group per block, every block resharded after forward."""

    describe: str
    model: Callable[[int], nn.Module]  # n_blocks -> model
    batch: Callable[[], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    over_finest: float


def _blocks_batch() -> torch.Tensor:
    return torch.randn(32, 128)


def _tokens() -> torch.Tensor:
    return torch.randint(0, LlamaConfig.small().vocab_size, (4, 129))


def _tiny_tokens() -> torch.Tensor:
    return torch.randint(0, LlamaConfig.tiny().vocab_size, (4, 129))


def _llama_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])


CASES = {
    "blocks": Case(
        "BlockStack 2 x Linear(128, 128) per block, batch 32",
        lambda n: BlockStack(n, 128),
        _blocks_batch,
        lambda model, x: model(x).sum(),
        1.25,
    ),
    "llama_tiny": Case(
        "Llama tiny (2 blocks, dim 128: train.py's default), 4 x 128 tokens",
        lambda n: Llama(LlamaConfig.tiny()),
        _tiny_tokens,
        _llama_loss,
        1.3,
    ),
    "llama": Case(
        "Llama small (4 blocks, dim 256), 4 x 128 tokens",
        lambda n: Llama(LlamaConfig.small()),
        _tokens,
        _llama_loss,
        1.3,
    ),
}


def auto_group_ratios(quick: bool = False) -> tuple[float, float, list[str]]:
    """(collectives per step, step time), auto groups / one group per block on the
    many-small-modules model, and the report lines (with the Llama's unless ``quick``).
    Plans here, then measures in one torchrun launch of 2 gloo ranks per model."""
    n_blocks, rounds = (32, 12) if quick else (64, 30)
    collectives, step, lines = _compare("blocks", n_blocks, rounds)
    if not quick:
        # The Llamas' steps differ by a few percent, within this CPU's run-to-run noise
        # at 30 rounds (0.87 to 0.96 for the same choice): 100 rounds.
        lines += _compare("llama_tiny", 0, 100)[2]  # the main job's (train.py's default)
        lines += _compare("llama", 0, 100)[2]
    return collectives, step, lines


def _compare(name: str, n_blocks: int, rounds: int) -> tuple[float, float, list[str]]:
    case = CASES[name]
    # The runs are gloo's: plan ours' gloo reduce-scatter (an all-to-all whose receive
    # buffer counts in the peak), so the whole budget is planned for.
    settings = {
        "world_size": WORLD,
        "batch": case.batch,
        "loss_fn": case.loss,
        "backend": "gloo",
        "link_gbps": CPU_LINK_GBPS,
        "tflops": CPU_TFLOPS,
    }
    finest = plan(lambda: case.model(n_blocks), **settings)
    budget = int(case.over_finest * finest.peak_bytes)
    start = time.perf_counter()
    auto = auto_shard(lambda: case.model(n_blocks), budget_bytes=budget, **settings)
    planning_s = time.perf_counter() - start
    measured = _launch(name, n_blocks, rounds, auto)
    collectives = measured["collectives"]["auto"] / measured["collectives"]["per_block"]
    step = measured["step_s"]["auto"] / measured["step_s"]["per_block"]
    return collectives, step, _report(case, auto, budget, planning_s, measured, rounds)


def _report(
    case: Case, auto: AutoPlan, budget: int, planning_s: float, measured: dict, rounds: int
) -> list[str]:
    sizes = sorted({len(g.fqns) for g in auto.groups})
    kept = sum(not g.reshard_after_forward for g in auto.groups)
    counts, times = measured["collectives"], measured["step_s"]
    return [
        (
            f"auto-groups: {case.describe}, {len(auto.baseline.groups) - 1} blocks, W={WORLD} "
            f"gloo, fp32, AdamW; budget {case.over_finest} x the peak of one group per block "
            f"= {budget / MiB:.2f} MiB (planned with backend='gloo')"
        ),
        (
            f"  chosen in {planning_s:.1f} s ({auto.simulations} simulations): "
            f"{count(len(auto.groups), 'group')} of {'/'.join(map(str, sizes))} blocks, "
            f"{kept} kept "
            f"unsharded after forward, forward prefetch depth {auto.forward_prefetch}; "
            f"predicted step {auto.step_s * 1e3:.1f} vs {auto.baseline_step_s * 1e3:.1f} ms = "
            f"{auto.step_s / auto.baseline_step_s:.3f}"
        ),
        (
            f"  peak: predicted {auto.plan.peak_bytes / MiB:.2f} MiB, measured (MemTracker, "
            f"step 2) {measured['peak'] / MiB:.2f} MiB, "
            f"{'within' if measured['peak'] <= budget else 'OVER'} the budget"
        ),
        (
            f"  collectives per step: {counts['auto']} vs {counts['per_block']} one group "
            f"per block = {counts['auto'] / counts['per_block']:.3f}"
        ),
        (
            f"  step time (median of {rounds - measured['warmup']} interleaved rounds): "
            f"{times['auto'] * 1e3:.1f} ms vs {times['per_block'] * 1e3:.1f} ms = "
            f"{times['auto'] / times['per_block']:.3f}; losses equal: {measured['losses_equal']}"
        ),
    ]


def _launch(name: str, n_blocks: int, rounds: int, auto: AutoPlan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        calls, out = Path(tmp, "calls.json"), Path(tmp, "out.json")
        groups = [[list(g.fqns), g.reshard_after_forward] for g in auto.groups]
        calls.write_text(json.dumps({"groups": groups, "forward_prefetch": auto.forward_prefetch}))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        command = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
            "--nproc-per-node", str(WORLD), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", __file__, "--worker", name,
            "--calls", str(calls), "--out", str(out), "--n-blocks", str(n_blocks),
            "--rounds", str(rounds),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=900, check=False
        )
        if not out.exists():  # gloo may abort at exit after writing: trust the file
            raise RuntimeError(f"the auto-groups launch wrote nothing:\n{done.stderr[-4000:]}")
        return json.loads(out.read_text())


def _worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    case = CASES[args.worker]
    mesh = init_device_mesh("cpu", (WORLD,))
    calls = json.loads(Path(args.calls).read_text())
    groups = tuple(AutoGroup(tuple(f), r) for f, r in calls["groups"])
    forward_prefetch = calls["forward_prefetch"]
    variants: dict[str, Callable[[nn.Module], Any]] = {
        "auto": lambda m: apply_calls(m, groups, forward_prefetch, mesh=mesh),
        "per_block": lambda m: _per_block(m, mesh),
    }
    build = functools.partial(_build, case, args.n_blocks)
    torch.manual_seed(1 + dist.get_rank())
    batches = [case.batch() for _ in range(4)]
    peak = _peak(case, build(variants["auto"]), batches[0])
    models = {name: build(apply) for name, apply in variants.items()}
    collectives = {name: _count(case, *models[name], batches[0]) for name in models}
    warmup = 3
    times: dict[str, list[float]] = {name: [] for name in models}
    losses: dict[str, list[float]] = {name: [] for name in models}
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            elapsed, loss = _timed_step(case, *models[name], batches[r % len(batches)])
            losses[name].append(loss)
            if r >= warmup:
                times[name].append(elapsed)
    if dist.get_rank() == 0:
        result = {
            "peak": peak,
            "collectives": collectives,
            "step_s": {name: statistics.median(t) for name, t in times.items()},
            "warmup": warmup,
            "losses_equal": losses["auto"] == losses["per_block"],
        }
        Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


def _per_block(model: nn.Module, mesh: Any) -> None:
    """One group per block, every block resharded after forward; then the root."""
    for block in largest_module_list(model) or ():
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)


def _build(case: Case, n_blocks: int, apply: Callable) -> tuple[Any, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = case.model(n_blocks)
    apply(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(case: Case, model: Any, optimizer: torch.optim.Optimizer, batch: Any) -> float:
    loss = case.loss(model, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def _peak(case: Case, built: tuple[Any, torch.optim.Optimizer], batch: Any) -> int:
    """Step 2's peak of live bytes, the model alone (as ``tests/plan/test_plan_gloo.py``)."""
    model, optimizer = built
    with MemTracker() as tracker:
        for _ in range(2):
            restart_step(tracker)
            _step(case, model, optimizer, batch)
        return total_bytes(tracker.get_tracker_snapshot("peak"))


def _count(case: Case, model: Any, optimizer: torch.optim.Optimizer, batch: Any) -> int:
    trace = CommTrace()
    model.set_comm_trace(trace)
    _step(case, model, optimizer, batch)
    model.set_comm_trace(None)
    return len(trace.events)


def _timed_step(case: Case, model: Any, optimizer: torch.optim.Optimizer, batch: Any) -> tuple:
    losses = []
    seconds = slowest_seconds(lambda: losses.append(_step(case, model, optimizer, batch)))
    return seconds, losses[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=list(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--calls", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--n-blocks", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args)
        return
    collectives, step, lines = auto_group_ratios(args.quick)
    print("\n".join(lines))
    print(f"auto-groups collectives={collectives:.3f} step={step:.3f}")


if __name__ == "__main__":
    main()
