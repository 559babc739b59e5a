"""torch.compile with torch's ``fully_shard`` and ours: the compile matrix (issue 19).

    torchrun --nproc-per-node 2 benchmarks/bench_compile.py                 # the matrix
    torchrun --nproc-per-node 2 benchmarks/bench_compile.py --out compile.json
    torchrun --nproc-per-node 2 benchmarks/bench_compile.py --rows eager,titan
    torchrun --nproc-per-node 2 benchmarks/bench_compile.py --time          # step times

**Matrix** (default): a tiny Llama (``dtensor_fsdp/models/llama.py``: dim 64, 2 blocks,
vocab 256, 32 tokens x 2 rows per rank; fp32, gloo) trains 3 AdamW steps from one seed
on the same batches, once per row and FSDP (torch's ``fully_shard``, then ours). A row
is one way to combine ``torch.compile`` with FSDP, as users and torchtitan do (listed in
``_compile_recipes.py``). Per row and FSDP, rank 0 prints:

- ``graphs``: dynamo graphs compiled (``counters["stats"]["unique_graphs"]``, each with
  its forward and backward) and ``breaks``: graph breaks (the sum of
  ``counters["graph_break"]``), both counted from ``torch._dynamo.reset()`` and cleared
  counters before the run (up to the failure, for a run that fails);
- ``step ms``: the median step time after ``--warmup`` (compiling) steps, of the slowest
  rank; informative only (2 steps on a shared CPU);
- ``=torch`` (ours only): losses and final local shards bitwise equal to torch's, on
  every rank: the same compiled code on the same values gives the same bits;
- ``=eager``: the same for this FSDP's eager row (inductor fuses, so it may differ;
  not for mixed precision);
- the per-step losses (mean over ranks), or ``FAIL`` with the exception's class and
  first line (for dynamo's wrappers, also the root cause's); the next run goes on.

Then the rows' descriptions and the first graph-break reason of each run that broke.

**Time** (``--time``): the "small" Llama (dim 256, 4 blocks, 128 tokens x 4 rows per
rank) under four configurations built side by side: {torch's, ours} x {eager, each
block ``.compile(backend="inductor", fullgraph=True)`` before ``fully_shard``}.
``--warmup`` rounds (compilation) then ``--time-steps`` rounds, one step of each
configuration per round in a rotating order, each step timed on its slowest rank;
medians and the ratios compiled/eager and ours/torch. A configuration that fails in
its warm-up is reported and left out.

Every rank runs the same rows in the same order; a failure is caught on each rank and
the ranks agree on it before the next row. The process group has a ``--timeout`` so a
rank that fails alone (its peer blocked in a collective) ends as an error, not a hang.
"""

import argparse
import dataclasses
import gc
import json
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _compile_recipes import FSDP, IMPLS, ROWS, Build, Row, compile_blocks, eager, fsdp_impl
from common.dist import leave_process_group
from common.workload import rank_tokens
from torch import nn
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss, swiglu_hidden_dim

MATRIX_CONFIG = LlamaConfig(
    vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
    ffn_hidden_dim=swiglu_hidden_dim(64), max_seq_len=32,
)  # fmt: skip


# Running #


def batch(step: int, config: LlamaConfig, rows: int, seed: int) -> torch.Tensor:
    """This rank's (rows, seq_len + 1) tokens of global step ``step``: the same for every
    run, different on every rank."""
    return rank_tokens(seed * 1_000_003 + step, config.vocab_size, rows, config.max_seq_len)


@dataclasses.dataclass
class Trainer:
    """A model to train, its optimizer and the steps it has taken."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: LlamaConfig
    rows: int
    seed: int
    steps_taken: int = 0

    def step(self) -> tuple[torch.Tensor, float]:
        """One AdamW step; (local loss, this rank's seconds after a barrier)."""
        tokens = batch(self.steps_taken, self.config, self.rows, self.seed)
        dist.barrier()
        start = time.perf_counter()
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # each (B, T)
        loss = cross_entropy_loss(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps_taken += 1
        return loss.detach(), time.perf_counter() - start


def build_trainer(
    name: str, fsdp: FSDP, build: Build, config: LlamaConfig, mesh: DeviceMesh,
    rows: int, seed: int,
) -> Trainer:  # fmt: skip
    torch.manual_seed(seed)
    model = build(Llama(config), fsdp, mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return Trainer(name, model, optimizer, config, rows, seed)


@dataclasses.dataclass
class Run:
    """One row under one FSDP, on this rank."""

    error: str | None = None
    local_losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    shards: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    seconds: list[float] = dataclasses.field(default_factory=list)
    graphs: int = 0
    graph_breaks: int = 0
    break_reasons: list[str] = dataclasses.field(default_factory=list)


def one_line(error: BaseException) -> str:
    """``Class: first line``; dynamo wraps the real error (``TorchRuntimeError: RuntimeError
    when making fake tensor call``), so the root cause's line follows after ``<-``."""

    def line(e: BaseException) -> str:
        lines = str(e).strip().splitlines()
        return f"{type(e).__name__}: {lines[0] if lines else ''}"

    root = error
    while root.__cause__ is not None:
        root = root.__cause__
    return line(error) if root is error else f"{line(error)} <- {line(root)}"


def run_row(row: Row, fsdp: FSDP, mesh: DeviceMesh, args: argparse.Namespace) -> Run:
    """Build and train; any exception is recorded, not raised."""
    torch._dynamo.reset()
    counters.clear()
    run = Run()
    try:
        with torch._dynamo.config.patch(row.dynamo_config):
            trainer = build_trainer(
                row.name, fsdp, row.build, MATRIX_CONFIG, mesh, args.batch_size, args.seed
            )
            for _ in range(args.steps):
                loss, seconds = trainer.step()
                run.local_losses.append(loss)
                run.seconds.append(seconds)
        run.shards = {
            name: (p.to_local() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in trainer.model.named_parameters()
        }
    except Exception as error:  # noqa: BLE001 - a failing row is a result
        run.error = one_line(error)
    run.graphs = counters["stats"]["unique_graphs"]
    run.graph_breaks = sum(counters["graph_break"].values())
    run.break_reasons = [reason.splitlines()[0] for reason in counters["graph_break"]]
    trainer = None
    gc.collect()  # FSDP state <-> module cycles: free this run before the next one
    return run


def agree(run: Run) -> str | None:
    """The ranks' errors, merged: None only if every rank finished."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, run.error)
    distinct = sorted({e for e in errors if e is not None})
    if not distinct:
        return None
    failed = [rank for rank, e in enumerate(errors) if e is not None]
    where = "" if len(failed) == len(errors) else f" (ranks {failed} only)"
    return "; ".join(distinct) + where


def bitwise_equal(run: Run, reference: Run) -> bool:
    """Losses and local shards equal on this rank and every other. Shards are matched
    in order: a compiled root's names carry ``_orig_mod.``, the eager one's do not."""
    same = len(run.local_losses) == len(reference.local_losses) and all(
        torch.equal(a, b) for a, b in zip(run.local_losses, reference.local_losses)
    )
    same = same and len(run.shards) == len(reference.shards)
    same = same and all(
        torch.equal(a, b) for a, b in zip(run.shards.values(), reference.shards.values())
    )
    flag = torch.tensor(int(same))
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def summarize(run: Run, error: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """What rank 0 reports: ranks' mean losses and the slowest rank's step times."""
    result: dict[str, Any] = {
        "ok": error is None,
        "error": error,
        "graphs": run.graphs,
        "graph_breaks": run.graph_breaks,
        "break_reasons": run.break_reasons,
    }
    if error is not None:
        return result
    losses = torch.stack(run.local_losses)
    dist.all_reduce(losses)
    seconds = torch.tensor(run.seconds, dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # a step lasts as long as its slowest rank
    timed = seconds.tolist()[args.warmup :] or seconds.tolist()
    result["losses"] = (losses / dist.get_world_size()).tolist()
    result["step_ms"] = 1e3 * statistics.median(timed)
    return result


def run_matrix(mesh: DeviceMesh, args: argparse.Namespace) -> dict[str, Any]:
    """Every selected row, in ``ROWS`` order (eager first: the others compare with it)."""
    results: dict[str, Any] = {}
    eager_runs: dict[str, Run] = {}
    for row in (row for row in ROWS if row.name in args.rows):
        runs: dict[str, Run] = {}
        results[row.name] = {"what": row.what}
        for name in args.impls:
            if dist.get_rank() == 0:
                print(f"... {row.name}: {name}", flush=True)
            runs[name] = run_row(row, fsdp_impl(name), mesh, args)
            result = summarize(runs[name], agree(runs[name]), args)
            results[row.name][name] = result
            if row is ROWS[0] and result["ok"]:
                eager_runs[name] = runs[name]
            elif name in eager_runs and result["ok"] and row.fp32:
                result["bitwise_vs_eager"] = bitwise_equal(runs[name], eager_runs[name])
        if all(results[row.name].get(name, {}).get("ok") for name in IMPLS):
            results[row.name]["ours"]["bitwise_vs_torch"] = bitwise_equal(
                runs["ours"], runs["torch"]
            )
        del runs
        gc.collect()
    return results


# Report #


def print_matrix(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"\ncompile matrix | torch {torch.__version__} | world {dist.get_world_size()} | "
        f"gloo, CPU, fp32 | {MATRIX_CONFIG.n_layers} blocks, dim {MATRIX_CONFIG.dim} | "
        f"{args.steps} AdamW steps, step ms = median after step {args.warmup} (slowest rank)"
    )
    header = (
        f"{'row':<26} {'fsdp':<6} {'graphs':>6} {'breaks':>6} {'step ms':>8} "
        f"{'=torch':>6} {'=eager':>6}  losses / error"
    )
    print(header + "\n" + "-" * len(header))
    verdict = {True: "yes", False: "NO", None: ""}
    for row_name, row in results.items():
        for index, name in enumerate(n for n in IMPLS if n in row):
            r = row[name]
            label = row_name if index == 0 else ""
            step_ms = f"{r['step_ms']:.1f}" if r["ok"] else "-"
            detail = " ".join(f"{v:.6f}" for v in r["losses"]) if r["ok"] else f"FAIL {r['error']}"
            print(
                f"{label:<26} {name:<6} {r['graphs']:>6} {r['graph_breaks']:>6} {step_ms:>8} "
                f"{verdict[r.get('bitwise_vs_torch')]:>6} "
                f"{verdict[r.get('bitwise_vs_eager')]:>6}  {detail[:160]}"
            )
    print("\nrows:")
    for row_name, row in results.items():
        print(f"  {row_name:<26} {row['what']}")
    reasons = {
        (row_name, name): row[name]["break_reasons"]
        for row_name, row in results.items()
        for name in IMPLS
        if name in row and row[name]["break_reasons"]
    }
    if reasons:
        print("\nfirst graph-break reason per run:")
        for (row_name, name), listed in reasons.items():
            print(f"  {row_name} / {name}: {listed[0][:140]}")


# Time mode #


def run_time(mesh: DeviceMesh, args: argparse.Namespace) -> dict[str, Any]:
    """{torch, ours} x {eager, per-block inductor}, interleaved rounds."""
    config = dataclasses.replace(LlamaConfig.small(), max_seq_len=args.time_seq_len)
    builds = {"eager": eager, "compiled": compile_blocks(backend="inductor", fullgraph=True)}
    trainers: list[Trainer] = []
    errors: dict[str, str] = {}
    for impl in args.impls:
        for mode, build in builds.items():
            name = f"{impl} {mode}"
            trainer, error = None, None
            try:
                trainer = build_trainer(
                    name, fsdp_impl(impl), build, config, mesh, args.time_batch_size, args.seed
                )
                for _ in range(args.warmup):
                    trainer.step()
            except Exception as exc:  # noqa: BLE001 - a failing configuration is a result
                error = one_line(exc)
            error = agree(Run(error=error))
            if error is None:
                trainers.append(trainer)
            else:
                errors[name] = error
            if dist.get_rank() == 0:
                print(f"... warmed up {name}: {error or 'ok'}", flush=True)
    times: dict[str, list[float]] = {t.name: [] for t in trainers}
    losses: dict[str, list[float]] = {t.name: [] for t in trainers}
    for round_index in range(args.time_steps):
        shift = round_index % max(len(trainers), 1)
        for trainer in trainers[shift:] + trainers[:shift]:
            loss, seconds = trainer.step()
            times[trainer.name].append(seconds)
            losses[trainer.name].append(loss.item())
    medians = {}
    for name, values in times.items():
        slowest = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        medians[name] = statistics.median(slowest.tolist())
    del trainers
    gc.collect()
    return {
        "config": dataclasses.asdict(config),
        "batch_size": args.time_batch_size,
        "rounds": args.time_steps,
        "median_s": medians,
        "rank0_losses": losses,
        "errors": errors,
    }


def print_time(results: dict[str, Any]) -> None:
    medians = results["median_s"]
    config = results["config"]
    print(
        f"\ncompiled vs eager | torch {torch.__version__} | world {dist.get_world_size()} | "
        f"'small' Llama (dim {config['dim']}, {config['n_layers']} blocks), "
        f"{results['batch_size']} x {config['max_seq_len']} tokens per rank | median of "
        f"{results['rounds']} interleaved rounds, slowest rank"
    )
    for name, seconds in medians.items():
        print(f"  {name:<16} {seconds * 1e3:9.1f} ms")
    for name, error in results["errors"].items():
        print(f"  {name:<16} FAIL {error[:140]}")
    ratios = {}
    for impl in IMPLS:
        if f"{impl} eager" in medians and f"{impl} compiled" in medians:
            compiled, eager_s = medians[f"{impl} compiled"], medians[f"{impl} eager"]
            ratios[f"{impl} compiled/eager"] = compiled / eager_s
    for mode in ("eager", "compiled"):
        if f"ours {mode}" in medians and f"torch {mode}" in medians:
            ratios[f"{mode} ours/torch"] = medians[f"ours {mode}"] / medians[f"torch {mode}"]
    for name, ratio in ratios.items():
        print(f"  {name:<24} {ratio:.3f}")
    losses = results["rank0_losses"]
    for mode in ("eager", "compiled"):
        pair = losses.get(f"ours {mode}"), losses.get(f"torch {mode}")
        if None not in pair:
            same = "bitwise equal" if pair[0] == pair[1] else "DIFFER"
            print(f"  {mode} losses ours vs torch (rank 0): {same}")
    results["ratios"] = ratios


# Main #


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(r.name for r in ROWS),
                        help="comma-separated subset of the matrix rows")  # fmt: skip
    parser.add_argument("--impls", default=",".join(IMPLS), help="torch,ours or one of them")
    parser.add_argument("--steps", type=int, default=3, help="matrix: AdamW steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="steps left out of step times")
    parser.add_argument("--batch-size", type=int, default=2, help="matrix: rows per rank")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time", action="store_true", help="compiled vs eager step times")
    parser.add_argument("--time-steps", type=int, default=20, help="--time: timed rounds")
    parser.add_argument("--time-seq-len", type=int, default=128)
    parser.add_argument("--time-batch-size", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds a collective may wait (process group timeout)")  # fmt: skip
    parser.add_argument("--out", metavar="PATH", help="rank 0 writes the results as JSON")
    args = parser.parse_args()
    args.rows = [name for name in args.rows.split(",") if name]
    args.impls = [name for name in args.impls.split(",") if name]
    unknown = set(args.rows) - {r.name for r in ROWS}
    if unknown:
        parser.error(f"unknown --rows {sorted(unknown)}; known: {[r.name for r in ROWS]}")
    if not args.impls or set(args.impls) - set(IMPLS):
        parser.error(f"--impls must be a comma-separated subset of {','.join(IMPLS)}")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    return args


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        results: dict[str, Any] = {"torch": torch.__version__, "world_size": mesh.size()}
        if args.time:
            results["time"] = run_time(mesh, args)
        else:
            results["matrix"] = run_matrix(mesh, args)
        if dist.get_rank() == 0:
            if args.time:
                print_time(results["time"])
            else:
                print_matrix(results["matrix"], args)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
