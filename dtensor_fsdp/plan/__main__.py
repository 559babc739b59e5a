"""``python -m dtensor_fsdp.plan``: plan a built-in Llama preset and print the table.

    python -m dtensor_fsdp.plan --model llama3_8b --world-size 64 --mp bf16 --budget-gib 80

The model is the preset on ``meta``; ``fully_shard`` goes on each block, then on the
root (the default grouping of ``plan()``); one rank's batch is ``--batch`` sequences
of ``--seq`` tokens; the loss is the next-token cross-entropy; the optimizer AdamW.
Stacks of more than 4 blocks are simulated with 3 and 4 blocks and composed (see
``compose.py``; exact on every figure but the timeline); ``--whole`` simulates all.
"""

import argparse
import dataclasses
import sys
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend

from ..api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from ..models.llama import PRESETS, Llama, LlamaConfig, cross_entropy_loss
from .compose import compose
from .report import GiB, Plan
from .simulate import plan

# Blocks of the longer of the two simulations composed (compose.py needs >= 4).
_COMPOSED_FROM = 4
MODELS = ("tiny", "small", "llama2_7b", "llama3_8b", "llama3_70b", "llama3_405b")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dtensor_fsdp.plan", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--model", choices=MODELS, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--replicate", type=int, default=1, help="HSDP replicas (default 1: FSDP)")
    parser.add_argument(
        "--mp",
        choices=("fp32", "bf16"),
        default="fp32",
        help="bf16: bf16 params in compute, fp32 gradient reduction",
    )
    parser.add_argument("--offload", action="store_true", help="CPUOffloadPolicy")
    parser.add_argument(
        "--optimizer", choices=("sgd", "sgd_momentum", "adam", "adamw"), default="adamw"
    )
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences per rank")
    parser.add_argument(
        "--budget-gib", type=float, help="per-rank memory budget: does the peak fit?"
    )
    parser.add_argument("--link-gbps", type=float, default=400.0, help="per-rank link, Gbit/s")
    parser.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per rank")
    parser.add_argument(
        "--backend", choices=("nccl", "gloo"), default="nccl", help="the job's collectives"
    )
    parser.add_argument(
        "--sdpa",
        choices=("cpu", "math"),
        default="cpu",
        help="attention kernel to simulate: the CPU's flash kernel, or the math kernel "
        "(saves the attention weights; CUDA runs it for fp32 with grouped-query attention)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    parser.add_argument("--whole", action="store_true", help="simulate every block (slow)")
    args = parser.parse_args(argv)
    if args.world_size < 1 or args.seq < 1 or args.batch < 1:
        parser.error("--world-size, --seq and --batch must be positive")
    return args


def _next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])  # tokens (B, T + 1)


def plan_preset(args: argparse.Namespace) -> Plan:
    config = PRESETS[args.model]()
    config = dataclasses.replace(config, max_seq_len=max(config.max_seq_len, args.seq))
    if args.whole or config.n_layers <= _COMPOSED_FROM:
        return _plan_config(config, args)
    short, longer = (
        _plan_config(dataclasses.replace(config, n_layers=n), args)
        for n in (_COMPOSED_FROM - 1, _COMPOSED_FROM)
    )
    return compose(short, longer, config.n_layers)


def _plan_config(config: LlamaConfig, args: argparse.Namespace) -> Plan:
    mp_policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if args.mp == "bf16"
        else MixedPrecisionPolicy()
    )
    settings: dict[str, Any] = {
        "loss_fn": _next_token_loss,
        "replicate": args.replicate,
        "mp_policy": mp_policy,
        "offload_policy": CPUOffloadPolicy() if args.offload else OffloadPolicy(),
        "optimizer": args.optimizer,
        "link_gbps": args.link_gbps,
        "tflops": args.tflops,
        "backend": args.backend,
        "sdpa_backends": (SDPBackend.MATH,) if args.sdpa == "math" else None,
    }
    return plan(
        lambda: Llama(config),
        world_size=args.world_size,
        batch=lambda: torch.randint(0, config.vocab_size, (args.batch, args.seq + 1)),
        **settings,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        result = plan_preset(args)
    except (ValueError, RuntimeError) as error:
        sys.exit(f"error: {error}")
    print(f"{args.model}: {args.batch} x {args.seq} tokens per rank")
    print(result)
    if args.budget_gib is not None:
        budget = args.budget_gib * GiB
        verdict = "fits" if result.fits(budget) else "does NOT fit"
        print(
            f"budget {args.budget_gib:g} GiB: the predicted peak {verdict} "
            f"({(budget - result.peak_bytes) / GiB:+.2f} GiB to spare)"
        )
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())


if __name__ == "__main__":
    main()
