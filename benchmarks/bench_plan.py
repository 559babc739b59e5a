"""How good is ``dtensor_fsdp.plan``: its predictions against real gloo runs and the
fake-tensor step of ``scale_sim.py``, its planning time, and auto groups.

    python benchmarks/bench_plan.py            # ~5 min on 2 cores
    python benchmarks/bench_plan.py --quick    # ~1.2 min: a subset of each part

One launch, one process (the gloo ranks are spawned from it, W=2 and W=4):

1. Predicted against measured: each configuration of ``_plan_cases.py`` (Llama tiny and
   small, torch's ``nn.TransformerEncoder``; fp32, bf16 params with fp32 reduction,
   last block not resharded, CPU offload, HSDP 2x2) is planned here, then trained on
   real gloo ranks: step 2's peak of live bytes (MemTracker, as ``bench_train.py``) and
   its collectives at the c10d level, against the plan's peak and collectives; and the
   same step on real tensors on the fake process group (ours' NCCL path, as the plan
   simulates it), which separates what fake tensors get wrong from what gloo adds.
2. Against ``scale_sim.step_peak``: the plan (the CLI's: 3 and 4 blocks simulated and
   composed) against a whole fake-tensor step of every block, fp32 AdamW.
3. Planning time of Llama-3 8B, 70B and 405B at W=1024 and 4096 (bf16, 1 x 2048 tokens).
4. Auto groups against one group per module (``_bench_autogroups.auto_group_ratios``).

The last line reads
``plan: predicted/measured peak min=X max=Y; auto-groups collectives=C step=S``.
"""

import argparse
import dataclasses
import functools
import json
import os
import sys
import time
from typing import Any

import scale_sim  # same directory
from _plan_cases import (
    CASES,
    QUICK_CASES,
    Case,
    Measured,
    build_model,
    make_batch,
    measure_cases,
    measure_on_fake_group,
    plan_kwargs,
)
from common.spawn import run_ranks

from dtensor_fsdp.plan import Plan, plan
from dtensor_fsdp.plan.__main__ import parse_args as plan_cli_args
from dtensor_fsdp.plan.__main__ import plan_preset

MiB, GiB = 2**20, 2**30
# (model, world size, the target in seconds or None)
PLANNING = [
    ("llama3_8b", 1024, None),
    ("llama3_8b", 4096, None),
    ("llama3_70b", 1024, 10.0),
    ("llama3_70b", 4096, None),
    ("llama3_405b", 1024, None),
    ("llama3_405b", 4096, 30.0),
]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fast subset of every part")
    return parser.parse_args()


@dataclasses.dataclass(frozen=True)
class RealRow:
    """One configuration of part 1: the plan and what was measured."""

    case: Case
    predicted: Plan  # plan(backend="gloo"): ours' all-to-all reduce-scatter, as measured
    predicted_nccl: Plan  # plan(backend="nccl"): what on_fake_group runs
    measured: list[Measured]  # by rank
    on_fake_group: Measured  # real tensors, fake process group (see measure_on_fake_group)

    @property
    def ratios(self) -> list[float]:
        return [self.predicted.peak_bytes / m.peak_bytes for m in self.measured]

    @property
    def fake_group_ratio(self) -> float:
        return self.predicted_nccl.peak_bytes / self.on_fake_group.peak_bytes

    def differences(self) -> str:
        """Where the largest measured peak and the prediction differ, by MemTracker
        category (measured minus predicted), e.g. "Temp +384.5 KiB"."""
        measured = max(self.measured, key=lambda m: m.peak_bytes).peak_breakdown
        predicted = self.predicted.peak_breakdown
        parts = [
            f"{name} {(measured.get(name, 0) - predicted.get(name, 0)) / 2**10:+.1f} KiB"
            for name in sorted(set(measured) | set(predicted))
            if measured.get(name, 0) != predicted.get(name, 0)
        ]
        return ", ".join(parts) or "none"

    @property
    def collectives_equal(self) -> bool:
        # The NCCL plan's reduce-scatters: the measurement counts gloo's all-to-all as one.
        return all(self.predicted_nccl.collectives == m.collectives for m in self.measured)


def predicted_vs_measured(cases: list[Case]) -> list[RealRow]:
    """Plan every case here (before any process group exists in this process), then
    measure them on spawned gloo ranks, one launch per world size."""
    plans = {
        (case, backend): plan(
            functools.partial(build_model, case.model),
            world_size=case.world_size,
            batch=functools.partial(make_batch, case.model),
            backend=backend,
            **plan_kwargs(case),
        )
        for case in cases
        for backend in ("gloo", "nccl")
    }
    on_fake_group = {case: measure_on_fake_group(case) for case in cases}
    measured: dict[Case, list[Measured]] = {}
    for world in sorted({case.world_size for case in cases}):
        subset = [case for case in cases if case.world_size == world]
        by_rank = run_ranks(functools.partial(measure_cases, subset), world)
        for i, case in enumerate(subset):
            measured[case] = [results[i] for results in by_rank]
    return [
        RealRow(case, plans[case, "gloo"], plans[case, "nccl"], measured[case], on_fake_group[case])
        for case in cases
    ]


def print_real(rows: list[RealRow]) -> None:
    print("1. predicted vs measured | CPU | step 2 | AdamW | MemTracker")
    header = (
        f"{'config':<26} {'predicted MiB':>13} {'gloo MiB':>10} {'pred/gloo':>13} "
        f"{'fake-group MiB':>14} {'pred/fake-group':>15} {'collectives':>11}  "
        "gloo - predicted at the peak"
    )
    print(header + "\n" + "-" * len(header))
    for row in rows:
        low, high = min(row.ratios), max(row.ratios)
        ratio = f"{low:.4f}" if low == high else f"{low:.4f}-{high:.4f}"
        measured = max(m.peak_bytes for m in row.measured)
        print(
            f"{row.case.name:<26} {row.predicted.peak_bytes / MiB:>13.3f} "
            f"{measured / MiB:>10.3f} {ratio:>13} {row.on_fake_group.peak_bytes / MiB:>14.3f} "
            f"{row.fake_group_ratio:>15.4f} {'equal' if row.collectives_equal else 'DIFFER':>11}  "
            f"{row.differences()}"
        )
    print(
        "predicted: plan(backend='gloo'), which simulates ours' reduce-scatter on gloo (an "
        "all-to-all, whose receive buffer is as large as its input). gloo: measured on real "
        "gloo ranks, the largest over ranks (pred/gloo: over every rank). fake-group: "
        "measured on real tensors as rank 0 of the fake process group, where ours "
        "reduce-scatters as on NCCL, against plan(backend='nccl') (pred/fake-group). "
        "collectives: count and bytes per kind at the c10d level on every gloo rank against "
        "the NCCL plan's (an all-to-all counted as the reduce-scatter it carries). Last "
        "column: by MemTracker category\n"
    )


def against_scale_sim(model: str, worlds: list[int], seq: int) -> list[dict[str, Any]]:
    rows = []
    for world in worlds:
        args = plan_cli_args(["--model", model, "--world-size", str(world), "--seq", str(seq)])
        predicted = plan_preset(args)
        _, step = scale_sim.step_peak(model, world, "ours", seq)
        rows.append({"model": model, "world": world, "plan": predicted.peak_bytes, "step": step})
    return rows


def print_scale_sim(rows: list[dict[str, Any]], seq: int) -> None:
    print("2. plan (composed from 3 and 4 blocks) vs scale_sim.step_peak (every block)")
    print(f"   fake tensors, rank 0 | fp32 | AdamW | 1 x {seq} tokens | step 2")
    header = f"{'model':<12} {'W':>5} {'plan GiB':>10} {'step GiB':>10} {'plan/step':>10}"
    print(header + "\n" + "-" * len(header))
    for r in rows:
        print(
            f"{r['model']:<12} {r['world']:>5} {r['plan'] / GiB:>10.3f} {r['step'] / GiB:>10.3f} "
            f"{r['plan'] / r['step']:>10.4f}"
        )
    print()


def planning_times(quick: bool) -> list[dict[str, Any]]:
    rows = []
    for model, world, target in PLANNING:
        if quick and target is None:
            continue
        args = plan_cli_args(["--model", model, "--world-size", str(world), "--mp", "bf16"])
        predicted = plan_preset(args)
        rows.append(
            {
                "model": model,
                "world": world,
                "seconds": predicted.planning_s,
                "target": target,
                "peak": predicted.peak_bytes,
            }
        )
    return rows


def print_planning(rows: list[dict[str, Any]]) -> None:
    load = os.getloadavg()[0]
    print(
        f"3. planning time | bf16, AdamW, 1 x 2048 tokens | composed from 3 and 4 blocks | "
        f"load average {load:.2f} on {os.cpu_count()} cores (shared machine: provisional)"
    )
    header = f"{'model':<12} {'W':>5} {'planning s':>11} {'target s':>9} {'peak GiB':>9}"
    print(header + "\n" + "-" * len(header))
    for r in rows:
        target = f"<= {r['target']:g}" if r["target"] is not None else "-"
        print(
            f"{r['model']:<12} {r['world']:>5} {r['seconds']:>11.2f} {target:>9} "
            f"{r['peak'] / GiB:>9.2f}"
        )
    print()


def auto_groups(quick: bool) -> tuple[float, float] | str:
    """Part 4's ratios, or why it was skipped (its module or a package it needs is
    missing): the other parts' figures are printed either way."""
    try:
        from _bench_autogroups import auto_group_ratios  # same directory

        collectives, step, lines = auto_group_ratios(quick=quick)
    except ImportError as error:
        if error.name == "_bench_autogroups":
            reason = "not built (benchmarks/_bench_autogroups.py is missing)"
        else:
            reason = f"skipped ({error})"
        print(f"4. auto groups: {reason}\n")
        return reason
    print("4. auto groups vs one group per module")
    print("\n".join(lines) + "\n")
    return collectives, step


def main() -> None:
    args = parse_args()
    start = time.perf_counter()
    print(f"bench_plan{' --quick' if args.quick else ''} | load average {os.getloadavg()[0]:.2f}\n")
    real = predicted_vs_measured(QUICK_CASES if args.quick else CASES)
    print_real(real)
    sim_model, seq = ("small", 256) if args.quick else ("llama2_7b", 256)
    sim = against_scale_sim(sim_model, [8, 1024], seq)
    print_scale_sim(sim, seq)
    times = planning_times(args.quick)
    print_planning(times)
    ratios = auto_groups(args.quick)
    report = {
        "real": [
            {
                "config": row.case.name,
                "predicted": row.predicted.peak_bytes,
                "measured": [m.peak_bytes for m in row.measured],
                "on_fake_group": row.on_fake_group.peak_bytes,
                "collectives_equal": row.collectives_equal,
            }
            for row in real
        ],
        "scale_sim": sim,
        "planning": times,
        "auto_groups": ratios,
    }
    print("BENCH_JSON " + json.dumps(report))
    print(f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
    all_ratios = [ratio for row in real for ratio in row.ratios]
    line = f"plan: predicted/measured peak min={min(all_ratios):.4f} max={max(all_ratios):.4f}"
    if isinstance(ratios, str):
        print(f"{line}; auto-groups: {ratios}")
    else:
        print(f"{line}; auto-groups collectives={ratios[0]:.3f} step={ratios[1]:.3f}")


if __name__ == "__main__":
    main()
