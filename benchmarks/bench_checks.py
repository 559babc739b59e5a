"""What the failure checks cost: step time with the divergence check and the non-finite
gradient guard on, and with the default collective watchdog off, against the defaults
and torch's ``fully_shard``, in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_checks.py --steps 60      # small, CPU/gloo
    torchrun --nproc-per-node 2 benchmarks/bench_checks.py --model tiny --steps 60

The model, data, optimizer and timing method are ``bench_train.py``'s (same flags):
interleaved rounds, one step per configuration per round, each step timed on its
slowest rank. Configurations:

- ``ours``: ``dtensor_fsdp.fully_shard``, the defaults: checks off, the collective
  watchdog (flight recorder) on;
- ``ours-watchdog``: ``set_collective_watchdog(False)``: nothing recorded;
- ``ours+divergence``: ``set_divergence_check(True)``;
- ``ours+nonfinite``: ``set_nonfinite_grad_check(True)``;
- ``ours+both``: both;
- ``torch``: ``torch.distributed.fsdp.fully_shard``, for scale.

The checks change no arithmetic: every configuration of ours must print the same
losses (checked). Per configuration it also counts, over one step: the check's
all-gathers and all collectives at the c10d level, the c10d store calls (the default's
hot path must make none: its records are compared only when a wait outlasts the
deadline), and the Python calls (cProfile, deterministic), whose difference between
``ours`` and ``ours-watchdog`` is what the default watchdog adds per step; the step
guard's own calls (an optimizer step between forward and backward, always on) are
counted apart.
"""

import cProfile
import dataclasses
import json
import pstats
import statistics

import torch.distributed as dist
from bench_train import (  # same directory
    Impl,
    build_config,
    build_impl,
    parse_args,
    time_rounds,
    train_step,
)
from common.dist import init_distributed, leave_process_group
from torch.distributed.device_mesh import init_device_mesh

from tests._c10d import C10dRecorder

CONFIGS = {  # (divergence check, non-finite check, watchdog)
    "ours": (False, False, True),
    "ours-watchdog": (False, False, False),
    "ours+divergence": (True, False, True),
    "ours+nonfinite": (False, True, True),
    "ours+both": (True, True, True),
}
# The c10d Store methods, as cProfile names pybind's methods (by module, not class:
# ``wait`` is left out, as Work.wait has the same name; so the count is a lower bound,
# and the watchdog's only wait is in its own thread, which cProfile does not see).
STORE_METHODS = (
    "set", "get", "check", "add", "multi_set", "multi_get", "compare_set", "delete_key",
    "append", "num_keys", "queue_push", "queue_pop",
)  # fmt: skip
STORE_CALL_NAMES = {f"<built-in method torch._C._distributed_c10d.{m}>" for m in STORE_METHODS}


def build(name: str, config, mesh, device, args) -> Impl:
    if name == "torch":
        return build_impl("torch", config, mesh, device, args)
    impl = build_impl("ours", config, mesh, device, args)
    divergence, nonfinite, watchdog = CONFIGS[name]
    impl.model.set_divergence_check(divergence)
    impl.model.set_nonfinite_grad_check(nonfinite)
    impl.model.set_collective_watchdog(watchdog)
    return dataclasses.replace(impl, name=name)


def count_step(impl: Impl, config, args, device) -> dict[str, int]:
    """One step's Python calls and c10d store calls, by cProfile: the step alone (the
    collectives are counted on another step, so that the recorder's own calls are not
    counted here)."""
    profiler = cProfile.Profile()
    profiler.enable()
    train_step(impl, config, args, device)
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    store_calls = sum(
        calls for (_, _, name), (_, calls, *_) in stats.items() if name in STORE_CALL_NAMES
    )
    # The step guard (runtime/step_guard.py) is on in every configuration of ours:
    # its own calls, the optimizer hook included (its callers add one builtin each).
    guard_calls = sum(
        calls for (path, _, _), (_, calls, *_) in stats.items() if path.endswith("step_guard.py")
    )
    return {
        "python_calls": pstats.Stats(profiler).total_calls,  # type: ignore[attr-defined]
        "store_calls": store_calls,
        "step_guard_calls": guard_calls,
    }


def count_collectives(impl: Impl, config, args, device) -> dict[str, int]:
    """One step's collectives (all kinds) and, among them, the check's (W, 6) int64
    all-gathers, counted at the c10d level."""
    check_nbytes = dist.get_world_size() * 6 * 8
    with C10dRecorder() as recorder:
        train_step(impl, config, args, device)
    checks = sum(
        1 for kind, nbytes in recorder.records if kind == "all_gather" and nbytes == check_nbytes
    )
    return {"collectives": len(recorder.records), "check_all_gathers_per_step": checks}


def main() -> None:
    args = parse_args()
    device = init_distributed(args.device)
    try:
        config = build_config(args)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        names = [*CONFIGS, "torch"]
        impls = [build(name, config, mesh, device, args) for name in names]
        times, losses = time_rounds(impls, config, args, device)
        collectives = {impl.name: count_collectives(impl, config, args, device) for impl in impls}
        counts = {impl.name: count_step(impl, config, args, device) for impl in impls}
        if dist.get_rank() == 0:
            for name in CONFIGS:
                assert losses[name] == losses["ours"], f"{name} changed the losses"
            base = statistics.median(times["ours"])
            results = {
                name: {
                    "median_step_ms": 1e3 * statistics.median(times[name]),
                    "ratio_to_ours": statistics.median(times[name]) / base,
                    **collectives[name],
                    **counts[name],
                }
                for name in names
            }
            header = f"{'config':<18}{'step ms':>10}{'vs ours':>10}{'checks/step':>13}"
            print(header + f"{'collectives':>13}{'store calls':>13}{'py calls':>10}")
            for name, row in results.items():
                print(
                    f"{name:<18}{row['median_step_ms']:>10.2f}{row['ratio_to_ours']:>10.3f}"
                    f"{row['check_all_gathers_per_step']:>13}{row['collectives']:>13}"
                    f"{row['store_calls']:>13}{row['python_calls']:>10}"
                )
            on, off = results["ours"], results["ours-watchdog"]
            added = on["python_calls"] - off["python_calls"]
            print(
                f"default watchdog: +{added} Python calls per step "
                f"({100 * added / on['python_calls']:.2f}% of the step's), "
                f"{on['collectives'] - off['collectives']} more collectives, "
                f"{on['store_calls']} store calls; step time "
                f"{statistics.median(times['ours']) / statistics.median(times['ours-watchdog']):.3f}x"
                f" of watchdog off (medians of {len(times['ours'])} interleaved steps)"
            )
            guard = on["step_guard_calls"]
            print(
                f"step guard (always on): {guard} calls per step in runtime/step_guard.py "
                f"({100 * guard / on['python_calls']:.2f}% of the step's)"
            )
            print("BENCH_JSON " + json.dumps({"model": args.model, "results": results}), flush=True)
        del impls
    finally:
        leave_process_group()


if __name__ == "__main__":
    main()
