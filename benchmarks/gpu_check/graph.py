"""The GPU check's graph-mode rows (issue 39): the targets only a GPU shows. Written
in a session without a GPU: unverified until a GPU check runs them.

- ``graph_targets``: ``benchmarks/bench_graph.py --device cuda --skip host,bitwise``
  (fake process group W=8, one process): the 8B-shaped step in graph mode at most 0.80x
  torch's eager step; the 0.88B model (16 x dim 2048, bf16) in graph mode with CUDA
  graphs (``mode="reduce-overhead"``) busy at least 90% of its step.
- ``symm_mem``: W=1 on NCCL, ``set_symm_mem_for_comm`` on every FSDP module (torch's
  symmetric-memory strategies) against the default strategies: 3 AdamW steps bitwise
  (at W=1 no all-gather is issued, as torch's: the strategy is built, its barrier and
  symmetric-memory backend set up; a W >= 2 NCCL run needs 2 GPUs).
"""

import json
import sys

import torch

from gpu_check.jobs import JobContext
from gpu_check.launch import RankSpec, join_group, run_commands
from gpu_check.report import Outcome

EIGHT_B_VS_TORCH = 0.80  # graph mode's 8B-shaped step over torch's eager step, at most
BUSY = 0.90  # the 0.88B step with CUDA graphs: kernel time over step time, at least


def graph_targets(ctx: JobContext) -> Outcome:
    out = ctx.scratch / "bench_graph.json"
    command = [
        sys.executable, "benchmarks/bench_graph.py", "--device", ctx.device_type,
        "--skip", "host,bitwise", "--steps", "8", "--warmup", "2", "--json", str(out),
    ]  # fmt: skip
    (finished,) = run_commands([command], [ctx.logs / "bench_graph.log"], ctx.timeout_s)
    outcome = Outcome()
    if finished.returncode != 0 or not out.exists():
        outcome.check("runs", False, f"exit {finished.returncode}: {finished.output[-600:]}")
        return outcome
    workloads = json.loads(out.read_text())["workloads"]
    eight_b, busy = workloads.get("8b", {}), workloads.get("busy", {})
    if "graph" in eight_b and "torch" in eight_b:
        ratio = eight_b["graph"]["median_ms"] / eight_b["torch"]["median_ms"]
        outcome.metrics["eight_b_graph_vs_torch"] = ratio
        outcome.check("8B graph / torch eager", ratio <= EIGHT_B_VS_TORCH, f"{ratio:.3f}")
    else:
        outcome.check("8B graph / torch eager", False, f"configs measured: {sorted(eight_b)}")
    fraction = (busy.get("graph+cudagraphs") or {}).get("busy")
    if fraction is not None:
        outcome.metrics["busy_graph_cudagraphs"] = fraction
    outcome.check(
        "0.88B busy with CUDA graphs",
        fraction is not None and fraction >= BUSY,
        f"{fraction:.3f}" if fraction is not None else f"configs measured: {sorted(busy)}",
    )
    return outcome


def symm_mem(spec: RankSpec) -> Outcome:
    import dtensor_fsdp
    from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss

    device = join_group(spec)
    records = {}
    for label in ("default", "symm_mem"):
        torch.manual_seed(0)
        model = Llama(LlamaConfig.tiny()).to(device)
        for block in model.layers:
            dtensor_fsdp.fully_shard(block)
        dtensor_fsdp.fully_shard(model)
        if label == "symm_mem":
            for module in model.modules():
                if isinstance(module, dtensor_fsdp.FSDPModule):
                    module.set_symm_mem_for_comm()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(step))
            tokens = tokens.to(device)
            loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        params = [p.to_local().detach().cpu() for p in model.parameters()]
        records[label] = (losses, params)
    (losses_a, params_a), (losses_b, params_b) = records["default"], records["symm_mem"]
    same = losses_a == losses_b and all(torch.equal(a, b) for a, b in zip(params_a, params_b))
    outcome = Outcome()
    outcome.check("symm_mem = default", same, f"losses {losses_b}")
    return outcome
