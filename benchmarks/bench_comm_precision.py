"""Quantized communication (``CommPrecisionPolicy``): wire bytes, convergence and step time.

    torchrun --nproc-per-node 2 benchmarks/bench_comm_precision.py              # 300 steps
    torchrun --nproc-per-node 2 benchmarks/bench_comm_precision.py --steps 40   # quick look
    torchrun --nproc-per-node 2 benchmarks/bench_comm_precision.py --bf16 mp    # see below

The default run takes about 8 minutes on 2 shared CPU cores (6 configs x 300 steps x
~0.25 s); rank 0 prints the tables and writes ``comm_precision.json`` (every figure,
per-step losses included) and ``comm_precision_losses.png`` to ``--out``.

One launch trains the main job's model (``train.py``'s defaults: the ``tiny`` Llama, 8
sequences of 128 tokens per rank, AdamW lr 3e-3, gradient clipping at 1.0, every block
and the root sharded with ``reshard_after_forward=True``, the same seed and the same
``synthetic_batch`` stream; the functions are ``train.py``'s own) under six configs:

- ``fp32``:     exact communication (the reference);
- ``bf16``:     ``CommPrecisionPolicy(all_gather="bf16", reduce_scatter="bf16")``, i.e.
  bf16 on the wire, fp32 compute. ``--bf16 mp`` uses bf16 mixed precision instead
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: bf16 all-gather and
  compute, fp32 reduce-scatter). It is not the default because bf16 matmuls are about
  7x slower than fp32 on CPU (1.4 s against 0.2 s a step here): 300 steps of it alone
  would take ~7 minutes, and it times the CPU's bf16 kernels, not communication;
- ``int8``:     ``CommPrecisionPolicy(all_gather="int8", reduce_scatter="int8")``;
- ``int8_ef``:  the same with ``error_feedback=True``;
- ``fp8_int8``: ``CommPrecisionPolicy(all_gather="fp8_e4m3", reduce_scatter="int8")``;
- ``int8_exact_emb``: ``int8`` with the token embedding kept exact too (a
  ``param_filter`` that leaves it out): measures whether the default filter should.

All quantized configs use ``--block-size`` (256) and the default ``param_filter``
(params with 2+ dims; the RMSNorm gains stay exact) unless said otherwise.

Method
------
The models are built side by side and trained in lockstep: at every step each
config runs one training step (``train.train_step``: forward, backward, clipping,
AdamW), in an order rotated every step so drift and other load on the machine are
shared. A barrier precedes every timed step; a step's time is the slowest rank's.
Step 1 (lazy init, optimizer state) and the recorded step are not timed.

*Bytes* are recorded at the c10d op level (``tests/_c10d.py``'s ``C10dRecorder``, a
``TorchDispatchMode``) over one step (``--record-step``, default 2): each collective's
buffer, i.e. the all-gather output and the reduce-scatter input (dtensor_fsdp
reduce-scatters by all-to-all on gloo; the recorder sees ``alltoall_base_``). For a
quantized config the buffer is uint8 and holds the codes *and* the float32 scales.
Any other collective is reported as "other": gradient clipping's all-reduce of the
grad norm (4 bytes: ``train.py`` clips on the local shards, one all-reduce). The measured bytes are checked against the analytic count below
("analytic: match").

*Loss*: per step, the mean over ranks of the local losses (every config sees the same
batches). The final loss is the mean of the last 20 steps; its relative difference is
``(final - final_ref) / final_ref``.

Formulas
--------
Per parameter of shape ``(d0, ...)`` at world size ``W``: its padded shard has
``s = ceil(d0 / W) * prod(d1...)`` elements. Its bytes in one collective buffer
(all-gather output or reduce-scatter input, W rows):

    exact:          W * s * itemsize           (fp32: 4, bf16: 2)
    int8 / fp8:     W * (ceil(s / bs) * bs + 4 * ceil(s / bs))
                    ~= W * s * (1 + 4 / bs)    (1-byte codes + one fp32 scale per block)

so the quantized/fp32 ratio is ``(1 + 4/bs) / 4``: 0.2539 at ``bs = 256``, 0.2578 at 128,
0.2656 at 64. Per step, with every group resharded after forward (train.py passes
``reshard_after_forward=True`` to the root too, so, as in torch's FSDP2, the root is
all-gathered again in backward; the default ``None`` would keep it and save one):

    all-gather buffer  A = sum_groups 2 * B_ag(group)
    reduce buffer      R = sum_groups B_rs(group)

A ring all-gather or reduce-scatter (and an all-to-all) sends ``(W - 1) / W`` of its
buffer per rank, so the per-rank wire bytes per step are ``(W - 1) / W * (A + R)``.

Projection to an inter-node link: assumptions
    * bandwidth-bound: time = bytes / B, with B = ``--link-gbps`` / 8 (100 Gb/s ->
      12.5 GB/s) available to *each* rank (e.g. one NIC per GPU); with several ranks
      sharing one NIC, divide B by the ranks per NIC. No latency term, no congestion,
      no intra-node shortcut (a flat ring over W = ``--project-world`` ranks, every hop
      inter-node, which is what a 64-rank FSDP group spanning 8+ nodes does on its
      slowest hop).
    * the quantization kernels are free (on a GPU they are memory-bound and take
      microseconds per MB; here on CPU they are not, see the step times).
    * hiding: FSDP overlaps block i+1's all-gather and block i's reduce-scatter with
      compute, so communication is hidden if a step's compute takes at least
      ``T_comm = (W - 1) / W * (A + R) / B``. Compute per step is ``6 * N * tokens``
      FLOPs (forward 2N + backward 4N per token, attention ignored) at
      ``--achieved-tflops`` (400: ~40% of an H100's dense bf16 peak), so hiding needs
      ``tokens per rank per step >= T_comm * F / (6 * N)``. Since ``A + R`` is about
      ``3 * N * bytes_per_element``, this is ``(W - 1) / W * 3 * bytes_per_element * F /
      (6 * B)``: independent of the model size (fp32: ~63k tokens per rank per step at
      the defaults, bf16 ~31.5k, int8 ~16k).
The projection is printed twice: from the measured bytes of this model (scaled by
``(W - 1) / W``; padding at the other W ignored) and analytically for a realistic
size (``--project-model``, default ``llama_7b``: 6.74B params), per config.
"""

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _comm_precision_report import GB, plot, print_report  # same directory
from common.comms import ring_wire_bytes
from common.dist import leave_process_group, reduce_over_ranks
from common.stats import percentile
from common.workload import group_params

from dtensor_fsdp import CommPrecisionPolicy
from dtensor_fsdp.comm_precision.wire_format import WireLayout
from dtensor_fsdp.models.llama import PRESETS, Llama, LlamaConfig
from tests._c10d import C10dRecorder


def _load_train_module() -> Any:
    """The main job's ``train.py`` (repository root), loaded by path: it is a script,
    not a package module, and the benchmark must run exactly its pipeline."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "train.py")
    spec = importlib.util.spec_from_file_location("train", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load_train_module()

CONFIGS = ("fp32", "bf16", "int8", "int8_ef", "fp8_int8", "int8_exact_emb")
FINAL_WINDOW = 20


@dataclasses.dataclass(frozen=True)
class CommSpec:
    """One config's communication: all-gather and reduce formats (None: exact), the
    exact all-gather itemsize (param_dtype) and the exact reduce itemsize (reduce_dtype)."""

    ag_fmt: str | None
    rs_fmt: str | None
    ag_exact_bytes: int = 4
    rs_exact_bytes: int = 4
    # False: the token embedding stays exact too (a param_filter choice to measure).
    quantize_embedding: bool = True


# Setup #


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per config")
    parser.add_argument("--out", default="benchmarks/out", help="directory for the PNG and JSON")
    parser.add_argument(
        "--bf16",
        choices=("wire", "mp"),
        default="wire",
        help="the bf16 config: bf16 on the wire (CommPrecisionPolicy), or bf16 mixed "
        "precision (MixedPrecisionPolicy; ~7x slower on CPU)",
    )
    parser.add_argument("--block-size", type=int, default=256, help="quantization block")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset")
    parser.add_argument("--record-step", type=int, default=2, help="step whose bytes are counted")
    parser.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--link-gbps", type=float, default=100.0, help="projection: Gb/s per rank")
    parser.add_argument("--project-world", type=int, default=64, help="projection: ranks")
    parser.add_argument("--project-model", choices=sorted(PRESETS), default="llama_7b")
    parser.add_argument(
        "--achieved-tflops", type=float, default=400.0, help="projection: compute per rank"
    )
    parser.add_argument(
        "--tokens-per-rank",
        type=int,
        default=8192,
        help="projection: tokens per rank per step for the exposed-communication column",
    )
    args = parser.parse_args()
    args.configs = [name for name in args.configs.split(",") if name]
    if "fp32" not in args.configs or any(name not in CONFIGS for name in args.configs):
        parser.error(f"--configs must be a subset of {','.join(CONFIGS)} including fp32")
    if args.steps < max(FINAL_WINDOW, args.record_step + 2):
        parser.error(f"--steps must be at least {max(FINAL_WINDOW, args.record_step + 2)}")
    return args


def comm_spec(name: str, args: argparse.Namespace) -> CommSpec:
    if name == "bf16" and args.bf16 == "mp":
        return CommSpec(None, None, ag_exact_bytes=2)
    return {
        "fp32": CommSpec(None, None),
        "bf16": CommSpec("bf16", "bf16"),
        "int8": CommSpec("int8", "int8"),
        "int8_ef": CommSpec("int8", "int8"),
        "fp8_int8": CommSpec("fp8_e4m3", "int8"),
        "int8_exact_emb": CommSpec("int8", "int8", quantize_embedding=False),
    }[name]


def comm_policy(name: str, args: argparse.Namespace) -> CommPrecisionPolicy | None:
    spec = comm_spec(name, args)
    if spec.ag_fmt is None and spec.rs_fmt is None:
        return None
    return CommPrecisionPolicy(
        all_gather=spec.ag_fmt,
        reduce_scatter=spec.rs_fmt,
        block_size=args.block_size,
        error_feedback=name == "int8_ef",
        param_filter=_matrices if spec.quantize_embedding else _matrices_but_embedding,
    )


def _matrices(fqn: str, param: torch.nn.Parameter) -> bool:
    return param.ndim >= 2  # CommPrecisionPolicy's default


def _matrices_but_embedding(fqn: str, param: torch.nn.Parameter) -> bool:
    return param.ndim >= 2 and not fqn.startswith("tok_embeddings.")


@dataclasses.dataclass
class Run:
    """One config's model, optimizer, data stream and measurements."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator
    train_args: argparse.Namespace
    local_losses: list[torch.Tensor] = dataclasses.field(default_factory=list)
    times: list[float] = dataclasses.field(default_factory=list)
    records: list[tuple[str, int]] = dataclasses.field(default_factory=list)


def build_run(name: str, args: argparse.Namespace, parallelism: Any, device: torch.device) -> Run:
    """train.py's model, sharding and optimizer for one config, then its comm policy."""
    argv = ["--model", args.model, "--batch-size", str(args.batch_size)]
    argv += ["--lr", str(args.lr), "--seed", str(args.seed)]
    if name == "bf16" and args.bf16 == "mp":
        argv += ["--mixed-precision", "bf16"]
    train_args = train.parse_args(argv)
    config = train.build_config(train_args)
    model = train.build_model(config, parallelism, device, train_args)
    model.set_comm_precision(comm_policy(name, args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=train_args.lr, foreach=True)
    generator = torch.Generator().manual_seed(train_args.seed)
    return Run(name, model, optimizer, generator, train_args)


# Training #


def train_all(runs: list[Run], config: LlamaConfig, args: argparse.Namespace, dp: Any) -> None:
    """Lockstep training; each config's step order rotates every step."""
    device = next(runs[0].model.parameters()).device
    for step in range(1, args.steps + 1):
        shift = step % len(runs)
        for run in runs[shift:] + runs[:shift]:
            rows = run.train_args.batch_size * dp.dp_size
            batch = train.synthetic_batch(
                run.generator, rows, config.max_seq_len, config.vocab_size
            )
            tokens = train.local_rows(batch, dp.dp_rank, dp.dp_size).to(device)
            dist.barrier()
            start = time.perf_counter()
            if step == args.record_step:
                with C10dRecorder() as recorder:
                    loss, _ = train.train_step(run.model, [run.optimizer], tokens, run.train_args)
                run.records = recorder.records
            else:
                loss, _ = train.train_step(run.model, [run.optimizer], tokens, run.train_args)
            elapsed = time.perf_counter() - start
            run.local_losses.append(loss)
            if step > 1 and step != args.record_step:
                run.times.append(elapsed)
        if dist.get_rank() == 0 and (step % 50 == 0 or step == args.steps):
            latest = " | ".join(f"{r.name} {r.local_losses[-1].item():.4f}" for r in runs)
            print(f"step {step:4d} | rank-0 loss: {latest}", flush=True)


def gather_results(runs: list[Run]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per config: losses averaged over ranks, step times maxed over ranks."""
    losses, times = {}, {}
    world = dist.get_world_size()
    for run in runs:
        total = torch.stack(run.local_losses).to(torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        losses[run.name] = (total / world).tolist()
        # A step lasts as long as its slowest rank.
        times[run.name] = reduce_over_ranks(run.times, dist.ReduceOp.MAX)
    return losses, times


# Bytes #


def summarize_records(records: list[tuple[str, int]], world: int) -> dict[str, dict[str, float]]:
    """kind -> count, buffer bytes, ring wire bytes per rank; kinds: all_gather,
    reduce_scatter (the all-to-all on gloo) and other."""
    kind_of = {"all_gather": "all_gather", "all_to_all": "reduce_scatter"}
    kind_of["reduce_scatter"] = "reduce_scatter"
    out = {k: {"count": 0, "buffer_bytes": 0, "wire_bytes": 0.0} for k in kind_of.values()}
    out["other"] = {"count": 0, "buffer_bytes": 0, "wire_bytes": 0.0}
    for op, nbytes in records:
        kind = kind_of.get(op, "other")
        out[kind]["count"] += 1
        out[kind]["buffer_bytes"] += nbytes
        out[kind]["wire_bytes"] += ring_wire_bytes(op, nbytes, world)
    return out


def param_buffer_bytes(
    param: torch.Tensor, world: int, fmt: str | None, exact: int, bs: int, quantized: bool
) -> int:
    """One param's bytes in a W-row collective buffer (see the module docstring)."""
    shard = -(-param.shape[0] // world) * param[0].numel()  # padded shard elements
    if fmt is not None and quantized:
        return world * WireLayout(fmt, bs, (shard,)).nbytes
    return world * shard * exact


def analytic_bytes(
    config: LlamaConfig, world: int, spec: CommSpec, block_size: int
) -> dict[str, float]:
    """Per-step all-gather and reduce buffer bytes of train.py's FSDP layout."""
    with torch.device("meta"):
        model = Llama(config)

    def quantized(param: torch.Tensor) -> bool:
        return param.ndim >= 2 and (
            spec.quantize_embedding or param is not model.tok_embeddings.weight
        )

    def group_bytes(params: list[torch.Tensor], fmt: str | None, exact: int) -> int:
        return sum(
            param_buffer_bytes(p, world, fmt, exact, block_size, quantized(p)) for p in params
        )

    groups = group_params(model)
    # Forward and backward all-gather each: train.py reshards every group, root included.
    ag = sum(2 * group_bytes(g, spec.ag_fmt, spec.ag_exact_bytes) for g in groups)
    rs = sum(group_bytes(g, spec.rs_fmt, spec.rs_exact_bytes) for g in groups)
    n_params = sum(p.numel() for p in model.parameters())
    return {"n_params": n_params, "all_gather_bytes": ag, "reduce_scatter_bytes": rs}


# Projection #


def projection_row(
    ag_buffer: float, rs_buffer: float, n_params: int, args: argparse.Namespace
) -> dict[str, float]:
    """Communication time per step at W = --project-world on a --link-gbps link, and
    the compute needed to hide it (see the module docstring)."""
    world = args.project_world
    bandwidth = args.link_gbps / 8 * GB  # bytes/s per rank
    wire = (world - 1) / world * (ag_buffer + rs_buffer)
    comm_s = wire / bandwidth
    flops_per_token = 6 * n_params
    achieved = args.achieved_tflops * 1e12
    compute_s = args.tokens_per_rank * flops_per_token / achieved
    return {
        "wire_bytes": wire,
        "all_gather_s": (world - 1) / world * ag_buffer / bandwidth,
        "reduce_scatter_s": (world - 1) / world * rs_buffer / bandwidth,
        "comm_s": comm_s,
        "tokens_per_rank_to_hide": comm_s * achieved / flops_per_token,
        "compute_s_at_tokens": compute_s,
        "exposed_s_at_tokens": max(0.0, comm_s - compute_s),
    }


# Report #


def final_loss(losses: list[float]) -> float:
    return statistics.fmean(losses[-FINAL_WINDOW:])


def build_results(args, config, runs, losses, times) -> dict[str, Any]:
    world = dist.get_world_size()
    big_config = PRESETS[args.project_model]()
    results: dict[str, Any] = {
        "model": args.model,
        "config": dataclasses.asdict(config),
        "world_size": world,
        "backend": dist.get_backend(),
        "torch": torch.__version__,
        "steps": args.steps,
        "bf16_config": args.bf16,
        "block_size": args.block_size,
        "record_step": args.record_step,
        "final_window": FINAL_WINDOW,
        "projection_assumptions": {
            "world": args.project_world,
            "link_gbps": args.link_gbps,
            "bytes_per_s_per_rank": args.link_gbps / 8 * GB,
            "achieved_tflops": args.achieved_tflops,
            "tokens_per_rank": args.tokens_per_rank,
            "flops_per_token": "6 * n_params",
            "model": args.project_model,
        },
        "configs": {},
    }
    ref = results["configs"]
    for run in runs:
        spec = comm_spec(run.name, args)
        comms = summarize_records(run.records, world)
        analytic = analytic_bytes(config, world, spec, args.block_size)
        big = analytic_bytes(big_config, args.project_world, spec, args.block_size)
        ag, rs = comms["all_gather"]["buffer_bytes"], comms["reduce_scatter"]["buffer_bytes"]
        step_times = times[run.name]
        ref[run.name] = {
            "policy": repr(comm_policy(run.name, args)),
            "mixed_precision": run.train_args.mixed_precision,
            "comms": comms,
            "analytic": analytic,
            "analytic_matches": analytic["all_gather_bytes"] == ag
            and analytic["reduce_scatter_bytes"] == rs,
            "median_s": statistics.median(step_times),
            "p10_s": percentile(step_times, 0.1),
            "p90_s": percentile(step_times, 0.9),
            "losses": losses[run.name],
            "final_loss": final_loss(losses[run.name]),
            "projection_measured": projection_row(ag, rs, analytic["n_params"], args),
            "projection_big": projection_row(
                big["all_gather_bytes"], big["reduce_scatter_bytes"], big["n_params"], args
            ),
            "big_analytic": big,
        }
    for r in ref.values():
        for other in ("fp32", "bf16"):
            if other not in ref:
                continue
            o = ref[other]
            for kind in ("all_gather", "reduce_scatter"):
                r[f"{kind}_ratio_vs_{other}"] = (
                    r["comms"][kind]["buffer_bytes"] / o["comms"][kind]["buffer_bytes"]
                )
            r[f"final_loss_rel_diff_vs_{other}"] = (r["final_loss"] - o["final_loss"]) / o[
                "final_loss"
            ]
            r[f"time_ratio_vs_{other}"] = r["median_s"] / o["median_s"]
    return results


def main() -> None:
    args = parse_args()
    device = train.init_distributed("cpu")
    try:
        parallelism = train.build_mesh(device, replicate=1, tp=1)
        runs = [build_run(name, args, parallelism, device) for name in args.configs]
        config = train.build_config(runs[0].train_args)
        if dist.get_rank() == 0:
            print(f"configs: {', '.join(args.configs)} | {args.steps} steps each", flush=True)
        train_all(runs, config, args, parallelism)
        losses, times = gather_results(runs)
        if dist.get_rank() == 0:
            results = build_results(args, config, runs, losses, times)
            print_report(results)
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "comm_precision.json"), "w") as f:
                json.dump(results, f, indent=1)
            png = os.path.join(args.out, "comm_precision_losses.png")
            plot(results, png)
            print(f"\nwrote {png} ({os.path.getsize(png) / 1024:.0f} KiB) and comm_precision.json")
        del runs
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
