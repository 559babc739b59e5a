"""What the failure checks cost: step time with the divergence check and the non-finite
gradient guard on, against ours with both off and torch's ``fully_shard``, in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_checks.py                 # small, CPU/gloo
    torchrun --nproc-per-node 2 benchmarks/bench_checks.py --model tiny --steps 30

The model, data, optimizer and timing method are ``bench_train.py``'s (same flags):
interleaved rounds, one step per configuration per round, each step timed on its
slowest rank. Configurations:

- ``ours``: ``dtensor_fsdp.fully_shard``, checks off (the default);
- ``ours+divergence``: ``set_divergence_check(True)``;
- ``ours+nonfinite``: ``set_nonfinite_grad_check(True)``;
- ``ours+both``: both;
- ``torch``: ``torch.distributed.fsdp.fully_shard``, for scale.

The checks change no arithmetic: every configuration of ours must print the same
losses (checked). It also counts the check's all-gathers per step at the c10d level.
"""

import dataclasses
import gc
import json
import statistics

import torch.distributed as dist
from bench_train import (  # same directory
    C10dRecorder,
    Impl,
    build_config,
    build_impl,
    init_distributed,
    parse_args,
    time_rounds,
    train_step,
)
from torch.distributed.device_mesh import init_device_mesh

CONFIGS = {
    "ours": (False, False),
    "ours+divergence": (True, False),
    "ours+nonfinite": (False, True),
    "ours+both": (True, True),
}


def build(name: str, config, mesh, device, args) -> Impl:
    if name == "torch":
        return build_impl("torch", config, mesh, device, args)
    impl = build_impl("ours", config, mesh, device, args)
    divergence, nonfinite = CONFIGS[name]
    impl.model.set_divergence_check(divergence)
    impl.model.set_nonfinite_grad_check(nonfinite)
    return dataclasses.replace(impl, name=name)


def check_all_gathers_per_step(impl: Impl, config, args, device) -> int:
    """The check's (W, 6) int64 all-gathers in one step, counted at the c10d level."""
    check_nbytes = dist.get_world_size() * 6 * 8
    with C10dRecorder() as recorder:
        train_step(impl, config, args, device)
    return sum(
        1 for kind, nbytes in recorder.records if kind == "all_gather" and nbytes == check_nbytes
    )


def main() -> None:
    args = parse_args()
    device = init_distributed(args.device)
    try:
        config = build_config(args)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        names = [*CONFIGS, "torch"]
        impls = [build(name, config, mesh, device, args) for name in names]
        times, losses = time_rounds(impls, config, args, device)
        checks = {
            impl.name: check_all_gathers_per_step(impl, config, args, device) for impl in impls
        }
        if dist.get_rank() == 0:
            for name in CONFIGS:
                assert losses[name] == losses["ours"], f"{name} changed the losses"
            base = statistics.median(times["ours"])
            results = {
                name: {
                    "median_step_ms": 1e3 * statistics.median(times[name]),
                    "ratio_to_ours": statistics.median(times[name]) / base,
                    "check_all_gathers_per_step": checks[name],
                }
                for name in names
            }
            print(f"{'config':<18}{'step ms':>10}{'vs ours':>10}{'checks/step':>13}")
            for name, row in results.items():
                print(
                    f"{name:<18}{row['median_step_ms']:>10.2f}{row['ratio_to_ours']:>10.3f}"
                    f"{row['check_all_gathers_per_step']:>13}"
                )
            print("BENCH_JSON " + json.dumps({"model": args.model, "results": results}), flush=True)
        del impls
    finally:
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
