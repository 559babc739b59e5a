"""How many reduce-scatters to keep in flight: memory and step time of ours with
``set_reduce_scatter_max_input_buffers(k)`` for k = 1, 2, 3, against torch's
``fully_shard`` at its default (1), in one run.

    torchrun --nproc-per-node 2 benchmarks/bench_inflight.py                # small, CPU/gloo
    torchrun --nproc-per-node 2 benchmarks/bench_inflight.py --n-layers 8   # deeper

The model, data, optimizer and timing method are ``bench_train.py``'s (same flags):
interleaved rounds with a rotating order, one step per configuration per round, each
step timed on its slowest rank. Configurations: ``ours-1``, ``ours-2``, ``ours-3`` (k
reduce-scatters in flight) and ``torch``.

Memory is measured per configuration in isolation (the others not built), on step 2:

- ``backward peak``: MemTracker's peak of live tensor memory from the start of
  ``loss.backward()`` to its end (activations, unsharded params and grads, and the
  gradient-reduction buffers), counted from before the model was built;
- ``RS inputs``: the peak bytes of live reduce-scatter input buffers (the buffers
  ``max_input_buffers`` bounds), read when each reduce-scatter (ours on gloo: an
  all-to-all) is issued, from weak references to the inputs of the earlier ones: the
  one being issued plus those still in flight or retained.

``exposed RS ms`` is ours' ``CommTrace.summary()["reduce_scatter"]["exposed_s"]`` per
step over the timed rounds (max over ranks): host time blocked waiting for a
reduce-scatter, what overlap did not hide. The number in flight changes no arithmetic:
every configuration of ours must print the same losses (checked).
"""

import argparse
import dataclasses
import gc
import json
import statistics

import torch.distributed as dist
from _train_report import MiB  # same directory
from bench_train import (  # same directory
    Impl,
    batch_for_step,
    build_config,
    build_impl,
    cross_entropy_loss,
    parse_args,
    time_rounds,
    train_step,
)
from common.dist import init_distributed, leave_process_group, reduce_over_ranks
from common.tensor_memory import reset_peak, total_bytes
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.device_mesh import init_device_mesh

import dtensor_fsdp
from tests._c10d import ReduceScatterInputs

IN_FLIGHT = (1, 2, 3)


def build(name: str, config, mesh, device, args) -> Impl:
    if name == "torch":
        return build_impl("torch", config, mesh, device, args)
    impl = build_impl("ours", config, mesh, device, args)
    impl.model.set_reduce_scatter_max_input_buffers(int(name.split("-")[1]))
    return dataclasses.replace(impl, name=name)


def measure_memory(name: str, config, mesh, device, args) -> dict[str, int]:
    """Step 1 (lazy init, optimizer states), then step 2 with the peak restarted at the
    start of backward."""
    with MemTracker() as tracker:
        impl = build(name, config, mesh, device, args)
        train_step(impl, config, args, device)
        tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
        tokens = batch_for_step(impl.steps_taken, config, args, device)
        loss = cross_entropy_loss(impl.model(tokens[:, :-1]), tokens[:, 1:])  # (B, T) each
        at_backward = total_bytes(tracker.get_tracker_snapshot("current"))
        reset_peak(tracker)
        with ReduceScatterInputs() as inputs:
            loss.backward()
        peak = total_bytes(tracker.get_tracker_snapshot("peak"))
        impl.optimizer.step()
        impl.optimizer.zero_grad(set_to_none=True)
    del impl, loss
    gc.collect()  # FSDP state <-> module cycles: free this config before the next one
    return {
        "at_backward_bytes": at_backward,
        "backward_peak_bytes": peak,
        "rs_input_peak_bytes": inputs.peak_bytes,
        "rs_inputs_live_peak": inputs.peak_count,
    }


def timed(impls: list[Impl], config, args, device):
    """bench_train's interleaved rounds, with ours' CommTrace cleared after the warmup."""
    traces = {}
    for impl in impls:
        if impl.name != "torch":
            traces[impl.name] = dtensor_fsdp.CommTrace()
            impl.model.set_comm_trace(traces[impl.name])
    warmup_only = argparse.Namespace(**{**vars(args), "steps": 0})
    time_rounds(impls, config, warmup_only, device)
    for trace in traces.values():
        trace.clear()
    times, losses = time_rounds(
        impls, config, argparse.Namespace(**{**vars(args), "warmup": 0}), device
    )
    exposed = reduce_over_ranks(
        [traces[n].summary(args.steps)["reduce_scatter"]["exposed_s"] for n in traces],
        dist.ReduceOp.MAX,
    )
    return times, losses, dict(zip(traces, exposed, strict=True))


def main() -> None:
    args = parse_args()
    device = init_distributed(args.device)
    try:
        if device.type != "cpu":  # inside the try: the group is destroyed on the way out
            raise SystemExit("bench_inflight measures memory with MemTracker: pass --device cpu")
        config = build_config(args)
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        names = [f"ours-{k}" for k in IN_FLIGHT] + ["torch"]
        memory = {name: measure_memory(name, config, mesh, device, args) for name in names}
        impls = [build(name, config, mesh, device, args) for name in names]
        times, losses, exposed = timed(impls, config, args, device)
        if dist.get_rank() == 0:
            for name in names[1:-1]:
                assert losses[name] == losses[names[0]], f"{name} changed the losses"
            report(args, config, names, memory, times, losses, exposed)
        del impls
    finally:
        leave_process_group()


def report(args, config, names, memory, times, losses, exposed) -> None:
    torch_ms = statistics.median(times["torch"])
    torch_mem = memory["torch"]
    results = {}
    for name in names:
        mem, median = memory[name], statistics.median(times[name])
        results[name] = {
            "median_step_ms": 1e3 * median,
            "time_ratio_vs_torch": median / torch_ms,
            **mem,
            "backward_peak_ratio_vs_torch": mem["backward_peak_bytes"]
            / torch_mem["backward_peak_bytes"],
            "rs_input_peak_ratio_vs_torch": mem["rs_input_peak_bytes"]
            / torch_mem["rs_input_peak_bytes"],
            "exposed_rs_ms_per_step": 1e3 * exposed[name] if name in exposed else None,
            "max_loss_diff_vs_torch": max(
                abs(a - b) for a, b in zip(losses[name], losses["torch"], strict=True)
            ),
        }
    print(
        f"\nmodel {args.model}, {config.n_layers} layers | world {dist.get_world_size()} | "
        f"batch {args.batch_size}x{args.seq_len} per rank | {args.steps} timed rounds after "
        f"{args.warmup} warmup"
    )
    header = (
        f"{'config':<8}{'step ms':>9}{'vs torch':>10}{'bwd peak MiB':>14}{'vs torch':>10}"
        f"{'RS inputs MiB':>15}{'live':>6}{'vs torch':>10}{'exposed RS ms':>15}"
    )
    print(header + "\n" + "-" * len(header))
    for name, r in results.items():
        exposed_ms = r["exposed_rs_ms_per_step"]
        print(
            f"{name:<8}{r['median_step_ms']:>9.1f}{r['time_ratio_vs_torch']:>10.3f}"
            f"{r['backward_peak_bytes'] / MiB:>14.2f}{r['backward_peak_ratio_vs_torch']:>10.3f}"
            f"{r['rs_input_peak_bytes'] / MiB:>15.2f}{r['rs_inputs_live_peak']:>6}"
            f"{r['rs_input_peak_ratio_vs_torch']:>10.3f}"
            f"{'-' if exposed_ms is None else f'{exposed_ms:.2f}':>15}"
        )
    payload = {"model": args.model, "n_layers": config.n_layers, "results": results}
    print("BENCH_JSON " + json.dumps(payload), flush=True)


if __name__ == "__main__":
    main()
