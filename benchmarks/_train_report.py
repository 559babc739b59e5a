"""bench_train.py's report: the results dict (printed as ``BENCH_JSON``) and the table.

Kept apart from the measuring code so that each file reads on its own: everything here
is plain arithmetic on what ``bench_train.py`` measured; nothing here runs a step.
"""

import dataclasses
import statistics
from typing import Any

from common.stats import percentile

MiB = 2**20
# dtensor_fsdp reduce-scatters by all-to-all plus a local sum on gloo (see its README).
LABELS = {"all_to_all": "reduce_scatter (all_to_all)"}
# Issue 13's targets at world size 1: ours within 3% of the plain model, and no slower
# than torch's fully_shard.
TARGET_VS_UNSHARDED = 1.03
TARGET_VS_TORCH = 1.0


def comm_totals(comms: dict[str, dict[str, float]]) -> tuple[int, float, float]:
    """(collectives, unsharded bytes, ring wire bytes) per step, over all kinds."""
    kinds = [entry for kind, entry in comms.items() if kind != "broadcast"]
    return (
        int(sum(e["count"] for e in kinds)),
        sum(e["nbytes"] for e in kinds),
        sum(e["wire_bytes"] for e in kinds),
    )


def build_results(
    args, config, run: dict[str, Any], analytic: dict[str, float], isolated, times, losses
) -> dict[str, Any]:
    """``run``: world_size, device, backend, torch (version); ``isolated``: name ->
    bench_train.Isolated; ``times``/``losses``: name -> per-step lists."""
    results: dict[str, Any] = {
        "model": args.model,
        "config": dataclasses.asdict(config),
        **run,
        "steps": args.steps,
        "warmup": args.warmup,
        "block": args.block,
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "analytic_fsdp": analytic,
        "impls": {},
    }
    for name, iso in isolated.items():
        count, nbytes, wire = comm_totals(iso.comms)
        gloo_wire = wire
        if name == "torch" and run["backend"] == "gloo" and "reduce_scatter" in iso.comms:
            gloo_wire += iso.comms["reduce_scatter"]["wire_bytes"]  # all-reduce + copy on gloo
        step_times = times[name]
        results["impls"][name] = {
            "median_s": statistics.median(step_times),
            "p10_s": percentile(step_times, 0.1),
            "p90_s": percentile(step_times, 0.9),
            "peak_bytes": iso.peak_bytes,
            "peak_without_all_to_all_bytes": iso.peak_without_all_to_all_bytes,
            "live_at_step_bytes": iso.live_at_step_bytes,
            "collectives": count,
            "nbytes": nbytes,
            "wire_bytes": wire,
            "backend_wire_bytes": gloo_wire,
            "comms": iso.comms,
            "first_loss": losses[name][0],
            "last_loss": losses[name][-1],
            "ddp_bucket_sizes": iso.ddp_bucket_sizes,
            "trace_summary": iso.trace_summary,
        }
    if "torch" in losses:
        for name in losses:
            diff = max(abs(a - b) for a, b in zip(losses[name], losses["torch"]))
            results["impls"][name]["max_loss_diff_vs_torch"] = diff
    return results


def print_report(results: dict[str, Any]) -> None:
    impls, analytic = results["impls"], results["analytic_fsdp"]
    print(
        f"\nmodel {results['model']} ({analytic['param_bytes'] / MiB:.1f} MiB params, "
        f"{analytic['groups']} FSDP groups) | world {results['world_size']} | "
        f"{results['device']}/{results['backend']} | torch {results['torch']} | batch "
        f"{results['batch_size']}x{results['seq_len']} per rank | {results['steps']} timed "
        f"rounds x {results['block']} after {results['warmup']} warmup"
    )
    header = (
        f"{'impl':<9} {'median ms':>10} {'p10 ms':>8} {'p90 ms':>8} {'peak MiB':>9} "
        f"{'peak-a2a':>9} "
        f"{'states MiB':>10} {'colls':>6} {'MiB/step':>9} {'wire MiB':>9} "
        f"{'loss diff':>10}"
    )
    print(header + "\n" + "-" * len(header))
    for name, r in impls.items():
        print(
            f"{name:<9} {r['median_s'] * 1e3:>10.1f} {r['p10_s'] * 1e3:>8.1f} "
            f"{r['p90_s'] * 1e3:>8.1f} {r['peak_bytes'] / MiB:>9.1f} "
            f"{r['peak_without_all_to_all_bytes'] / MiB:>9.1f} "
            f"{r['live_at_step_bytes'] / MiB:>10.1f} {r['collectives']:>6} "
            f"{r['nbytes'] / MiB:>9.2f} {r['wire_bytes'] / MiB:>9.2f} "
            f"{r.get('max_loss_diff_vs_torch', float('nan')):>10.2e}"
        )
    for name, r in impls.items():
        kinds = ", ".join(
            f"{LABELS.get(k, k)} {int(v['count'])} x {v['nbytes'] / MiB:.2f} MiB"
            for k, v in r["comms"].items()
        )
        extra = ""
        if r["ddp_bucket_sizes"] is not None:
            extra = f" (analytic from DDP's {len(r['ddp_bucket_sizes'])} buckets)"
        if r["backend_wire_bytes"] != r["wire_bytes"]:
            extra += (
                f" (gloo reduce_scatter_tensor = all-reduce: real wire "
                f"{r['backend_wire_bytes'] / MiB:.2f} MiB)"
            )
        if name != "unsharded":
            print(f"  {name}: {kinds or 'no collectives'}{extra}")
    if "unsharded" in impls:
        print(f"  unsharded: {unsharded_note(results['world_size'])}")
    print(
        f"analytic FSDP per step: {analytic['all_gathers']} all-gathers + "
        f"{analytic['reduce_scatters']} reduce-scatters, ring wire bound "
        f"{analytic['wire_bytes_bound'] / MiB:.2f} MiB"
    )
    for name in ("ours", "torch"):
        if name in impls and analytic["wire_bytes_bound"] > 0:  # 0 at W=1: nothing on a wire
            ratio = impls[name]["wire_bytes"] / analytic["wire_bytes_bound"]
            impls[name]["wire_vs_bound"] = ratio
            print(f"  {name} ring wire / bound = {ratio:.4f}")
    print_ratios(impls)
    print_targets(impls, results["world_size"])


def unsharded_note(world: int) -> str:
    if world == 1:
        return "the plain model, no wrapper, no collectives: the compute floor"
    return (
        f"the plain model, no wrapper, no collectives; at W={world} each rank trains its "
        "own copy on its own batch (no gradient averaging), so its losses part from the "
        "others' after step 1 and its time is the compute floor, not a data-parallel run"
    )


def print_ratios(impls: dict[str, Any]) -> None:
    """ours against each other impl; every impl against the plain model."""
    pairs = [("ours", other) for other in ("torch", "ddp", "unsharded")]
    pairs += [(name, "unsharded") for name in ("torch", "ddp")]
    for name, other in pairs:
        if name in impls and other in impls:
            t = impls[name]["median_s"] / impls[other]["median_s"]
            m = impls[name]["peak_bytes"] / impls[other]["peak_bytes"]
            # Without all-to-all receive buffers: ours' on gloo is counted, while gloo's
            # own buffers inside torch's reduce_scatter_tensor are not.
            m_a2a = (
                impls[name]["peak_without_all_to_all_bytes"]
                / impls[other]["peak_without_all_to_all_bytes"]
            )
            impls[name][f"time_ratio_vs_{other}"] = t
            impls[name][f"peak_ratio_vs_{other}"] = m
            impls[name][f"peak_without_all_to_all_ratio_vs_{other}"] = m_a2a
            print(
                f"{name}/{other}: time {t:.3f}x, peak memory {m:.3f}x "
                f"({m_a2a:.3f}x without all-to-all receive buffers)"
            )


def print_targets(impls: dict[str, Any], world: int) -> None:
    """Issue 13's step-time targets, stated at world size 1 only."""
    ours = impls.get("ours", {})
    if world != 1 or "time_ratio_vs_unsharded" not in ours or "time_ratio_vs_torch" not in ours:
        return
    checks = {
        f"ours/unsharded <= {TARGET_VS_UNSHARDED}": (
            ours["time_ratio_vs_unsharded"] <= TARGET_VS_UNSHARDED
        ),
        f"ours/torch <= {TARGET_VS_TORCH}": ours["time_ratio_vs_torch"] <= TARGET_VS_TORCH,
    }
    ours["targets_w1"] = checks
    print(
        "targets at W=1: "
        + ", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in checks.items())
    )
