"""The GPU check's rows that launch the repo's own commands under torchrun (one
process: NCCL on CUDA) and judge what they print and write: the main job's flags
(``train.py``) and the benchmark (``benchmarks/bench_train.py``). They run in the
checking process itself, which only starts and reads subprocesses.
"""

import dataclasses
import json
import math
import shutil
from pathlib import Path

from gpu_check.launch import Finished, free_ports, run_commands, torchrun
from gpu_check.report import Outcome

# Flash attention's backward accumulates with atomics (seen on an H200), so
# two bf16 runs part in the last bits from step 2 on, and CPU offload runs AdamW on the
# CPU, which rounds otherwise than the device's: Adam then amplifies those bits in
# elements whose gradient is near its eps. 0.01 of a loss near ln(512) = 6.24 is far
# above that and far below what a wrong gradient or a skipped micro-batch does.
TRAIN_LOSS_ATOL = 1e-2
# bench_train.py's runs use the default (nondeterministic) attention kernels too.
BENCH_LOSS_ATOL = 1e-3


@dataclasses.dataclass(frozen=True)
class JobContext:
    device_type: str
    quick: bool
    logs: Path  # packed with the results
    artifacts: Path  # packed with the results
    scratch: Path  # not packed (metrics files with every parameter)
    timeout_s: float


# train.py's runs, each beside the reference: (flags, whether it is compared with it).
# Every one starts from the same initial values and tokens (init_unsharded draws on the
# compute device, also under --cpu-offload): a compared run's step-1 loss is bitwise the
# reference's, and its later losses within TRAIN_LOSS_ATOL (under offload the optimizer
# steps on the host: other kernels, other rounding).
TRAIN_RUNS = {
    "ref": ([], False),
    "meta_ac": (["--meta-init", "--activation-checkpointing"], True),
    "offload": (["--cpu-offload"], True),
    "meta_offload": (["--meta-init", "--cpu-offload"], True),
    "all": (
        ["--cpu-offload", "--activation-checkpointing", "--meta-init", "--compile"],
        False,  # inductor's kernels round otherwise: trains, finite, reported
    ),
}
TRACED_RUN = "meta_ac"  # also --trace-comms: its CommTrace comes back with the results


def train_flags(ctx: JobContext) -> Outcome:
    common = [
        "--device", ctx.device_type, "--model", "tiny", "--seq-len", "64", "--batch-size", "4",
        "--steps", "5", "--mixed-precision", "bf16", "--grad-accum", "2",
    ]  # fmt: skip
    commands, logs = [], []
    comms = str(ctx.artifacts / "train_commtrace.json")
    for (name, (flags, _)), port in zip(TRAIN_RUNS.items(), free_ports(len(TRAIN_RUNS))):
        metrics = ["--metrics-out", str(ctx.scratch / f"train_{name}.json")]
        traced = ["--trace-comms", comms] if name == TRACED_RUN else []
        commands.append(torchrun("train.py", *common, *flags, *traced, *metrics, port=port))
        logs.append(ctx.logs / f"train_{name}.log")
    finished = dict(zip(TRAIN_RUNS, run_commands(commands, logs, ctx.timeout_s)))
    outcome = Outcome()
    losses = {name: _losses(name, finished[name], ctx, outcome) for name in TRAIN_RUNS}
    reference = losses["ref"]
    for name, (flags, compared) in TRAIN_RUNS.items():
        if losses[name] is None or reference is None or name == "ref":
            continue
        diff = max(abs(a - b) for a, b in zip(losses[name], reference))
        if not compared:
            outcome.notes.append(f"{name}: max |loss diff| from ref {diff:.3g}")
            continue
        same_start = losses[name][0] == reference[0]
        outcome.check(
            f"{name} = ref", same_start and diff <= TRAIN_LOSS_ATOL,
            f"step-1 loss {'bitwise' if same_start else f'{losses[name][0]!r} vs {reference[0]!r}'}"
            f", max |diff| {diff:.3g} <= {TRAIN_LOSS_ATOL:g}",
        )  # fmt: skip
    outcome.check("commtrace written", Path(comms).exists(), "train.py --trace-comms")
    return outcome


def _losses(name: str, finished: Finished, ctx: JobContext, outcome: Outcome) -> list[float] | None:
    """The run's per-step losses, once it exited cleanly, trained (the last loss below
    the first) and stayed finite; None (and a failed check) otherwise."""
    path = ctx.scratch / f"train_{name}.json"
    if finished.returncode != 0 or not path.exists():
        code = (
            "killed at the deadline"
            if finished.returncode is None
            else f"exit {finished.returncode}"
        )
        outcome.check(f"{name} runs", False, f"{code}; log: {_tail(finished.output)}")
        return None
    losses = json.loads(path.read_text())["losses"]
    ok = all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    outcome.check(f"{name} trains", ok, f"losses {losses[0]:.4f} -> {losses[-1]:.4f}")
    return losses if ok else None


def bench_train(ctx: JobContext, profile: bool) -> Outcome:
    """``bench_train.py --impls ours,torch,unsharded`` on one process, with or without
    ``--profile``: it finishes, prints its JSON, ours' losses follow torch's."""
    model = "small" if ctx.device_type == "cuda" else "tiny"
    args = ["--device", ctx.device_type, "--impls", "ours,torch,unsharded", "--model", model,
            "--steps", "5" if profile else "3", "--warmup", "2" if profile else "1"]  # fmt: skip
    folder = ctx.scratch / "bench_profile"
    if profile:
        args += ["--profile", str(folder), "--profile-steps", "1"]
    log = ctx.logs / f"bench_train{'_profile' if profile else ''}.log"
    (port,) = free_ports(1)
    command = torchrun("benchmarks/bench_train.py", *args, port=port)
    (finished,) = run_commands([command], [log], ctx.timeout_s)
    outcome = Outcome()
    lines = [line for line in finished.output.splitlines() if line.startswith("BENCH_JSON ")]
    if finished.returncode != 0 or not lines:
        code = (
            "killed at the deadline"
            if finished.returncode is None
            else f"exit {finished.returncode}"
        )
        outcome.check("runs", False, f"{code}; log: {_tail(finished.output)}")
        return outcome
    ours = json.loads(lines[-1].removeprefix("BENCH_JSON "))["impls"]["ours"]
    diff = ours.get("max_loss_diff_vs_torch", math.nan)
    outcome.check("ours ~ torch", diff <= BENCH_LOSS_ATOL, f"max |loss diff| {diff:.3g}")
    for key, source in (("time_vs_torch", "time_ratio_vs_torch"),
                        ("time_vs_plain", "time_ratio_vs_unsharded"),
                        ("peak_vs_torch", "peak_ratio_vs_torch")):  # fmt: skip
        if source in ours:
            outcome.metrics[key] = ours[source]
    if profile:
        expected = ["ours_rank0.json", "torch_rank0.json", "unsharded_rank0.json",
                    "ours_commtrace_rank0.json"]  # fmt: skip
        missing = [name for name in expected if not (folder / name).exists()]
        outcome.check("profiles", not missing, f"missing {missing}" if missing else "4 traces")
        for name in expected:
            if (folder / name).exists():
                shutil.copy(folder / name, ctx.artifacts / f"bench_{name}")
    return outcome


def _tail(output: str, lines: int = 6) -> str:
    return " | ".join(output.strip().splitlines()[-lines:])
