"""``bench_comm_precision.py``'s report: the tables of bytes, convergence and step time,
the projection to a large world, and the loss curves' PNG; plain formatting of the
results dict that the benchmark builds (nothing here runs a step).
"""

from typing import Any

import torch

GB = 1e9


def print_report(results: dict[str, Any]) -> None:
    configs = results["configs"]
    c = results["config"]
    print(
        f"\nmodel {results['model']} (dim {c['dim']}, {c['n_layers']} layers, vocab "
        f"{c['vocab_size']}, {configs['fp32']['analytic']['n_params']:,} params) | world "
        f"{results['world_size']} | {results['backend']} | torch {results['torch']} | "
        f"{results['steps']} steps | block {results['block_size']} | bf16 config: "
        f"{'bf16 wire (CommPrecisionPolicy)' if results['bf16_config'] == 'wire' else 'bf16 MP'}"
    )
    print("\nbytes per step (c10d buffers: all-gather output, reduce-scatter/all-to-all input)")
    header = (
        f"{'config':<9} {'AG n':>4} {'AG KiB':>9} {'AG/fp32':>8} {'AG/bf16':>8} {'RS n':>4} "
        f"{'RS KiB':>9} {'RS/fp32':>8} {'RS/bf16':>8} {'other KiB':>9} {'wire KiB':>9} "
        f"{'analytic':>8}"
    )
    print(header + "\n" + "-" * len(header))
    for name, r in configs.items():
        ag, rs, other = (r["comms"][k] for k in ("all_gather", "reduce_scatter", "other"))
        wire = ag["wire_bytes"] + rs["wire_bytes"]
        print(
            f"{name:<9} {ag['count']:>4} {ag['buffer_bytes'] / 1024:>9.1f} "
            f"{r['all_gather_ratio_vs_fp32']:>8.4f} {r.get('all_gather_ratio_vs_bf16', 0):>8.4f} "
            f"{rs['count']:>4} {rs['buffer_bytes'] / 1024:>9.1f} "
            f"{r['reduce_scatter_ratio_vs_fp32']:>8.4f} "
            f"{r.get('reduce_scatter_ratio_vs_bf16', 0):>8.4f} "
            f"{other['buffer_bytes'] / 1024:>9.2f} {wire / 1024:>9.1f} "
            f"{'match' if r['analytic_matches'] else 'MISMATCH':>8}"
        )
    print(
        f"\nconvergence and step time (final loss = mean of the last "
        f"{results['final_window']} steps)"
    )
    header = (
        f"{'config':<9} {'final loss':>10} {'vs fp32':>9} {'vs bf16':>9} {'median ms':>10} "
        f"{'p10 ms':>8} {'p90 ms':>8} {'t/fp32':>7}"
    )
    print(header + "\n" + "-" * len(header))
    for name, r in configs.items():
        print(
            f"{name:<9} {r['final_loss']:>10.4f} {r['final_loss_rel_diff_vs_fp32']:>+9.3%} "
            f"{r.get('final_loss_rel_diff_vs_bf16', 0):>+9.3%} {r['median_s'] * 1e3:>10.1f} "
            f"{r['p10_s'] * 1e3:>8.1f} {r['p90_s'] * 1e3:>8.1f} {r['time_ratio_vs_fp32']:>7.3f}"
        )
    print_projection(results)


def print_projection(results: dict[str, Any]) -> None:
    a = results["projection_assumptions"]
    configs = results["configs"]
    print(
        f"\nprojection: W = {a['world']} ranks, {a['link_gbps']:g} Gb/s = "
        f"{a['bytes_per_s_per_rank'] / GB:g} GB/s per rank, bandwidth-bound ring, codec "
        f"free; hiding needs compute >= comm; compute = 6 N FLOPs/token at "
        f"{a['achieved_tflops']:g} TFLOP/s; exposed = comm - compute at "
        f"{a['tokens_per_rank']} tokens/rank"
    )
    big = configs["fp32"]["big_analytic"]["n_params"]
    for key, label in (
        ("projection_measured", f"{results['model']} (measured bytes x (W-1)/W)"),
        ("projection_big", f"{a['model']} ({big / 1e9:.2f}B params, analytic)"),
    ):
        print(f"  {label}")
        header = (
            f"  {'config':<9} {'wire GB':>9} {'AG s':>8} {'RS s':>8} {'comm s':>8} "
            f"{'vs fp32':>7} {'tokens/rank to hide':>19} {'exposed s':>9}"
        )
        print(header + "\n  " + "-" * (len(header) - 2))
        fp32 = configs["fp32"][key]["comm_s"]
        for name, r in configs.items():
            p = r[key]
            print(
                f"  {name:<9} {p['wire_bytes'] / GB:>9.4g} {p['all_gather_s']:>8.4g} "
                f"{p['reduce_scatter_s']:>8.4g} {p['comm_s']:>8.4g} {p['comm_s'] / fp32:>7.3f} "
                f"{p['tokens_per_rank_to_hide']:>19,.0f} {p['exposed_s_at_tokens']:>9.3g}"
            )


def plot(results: dict[str, Any], path: str) -> None:
    """Loss curves (left) and each config's loss minus fp32's, smoothed (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = results["configs"]
    window = results["final_window"]
    ref = torch.tensor(configs["fp32"]["losses"], dtype=torch.float64)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for index, (name, r) in enumerate(configs.items()):
        losses = torch.tensor(r["losses"], dtype=torch.float64)
        steps = range(1, len(losses) + 1)
        left.plot(
            steps,
            losses.tolist(),
            label=f"{name} (final {r['final_loss']:.4f})",
            lw=1,
            color=f"C{index}",
        )
        if name == "fp32":
            continue
        diff = losses - ref
        # Moving average over `window` steps (trailing; shorter at the start).
        cumsum = torch.cat([torch.zeros(1, dtype=torch.float64), diff.cumsum(0)])
        starts = torch.clamp(torch.arange(1, len(diff) + 1) - window, min=0)
        smooth = (cumsum[1:] - cumsum[starts]) / (torch.arange(1, len(diff) + 1) - starts)
        right.plot(steps, smooth.tolist(), label=name, lw=1, color=f"C{index}")
    left.set(xlabel="step", ylabel="loss (mean over ranks)", title="training loss")
    left.legend()
    right.axhline(0.0, color="C0", lw=0.8, label="fp32")
    right.set(
        xlabel="step",
        ylabel=f"loss - fp32 loss ({window}-step moving average)",
        title="difference to fp32",
    )
    right.legend()
    fig.suptitle(
        f"CommPrecisionPolicy, {results['model']} Llama, {results['world_size']} ranks, "
        f"block {results['block_size']}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
