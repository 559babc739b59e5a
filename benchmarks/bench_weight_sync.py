"""Post-training figures (issue 40): streamed weights, generation on the trainer, phase
offload; one launch, CPU/gloo.

    MALLOC_MMAP_THRESHOLD_=1048576 torchrun --nproc-per-node 2 benchmarks/bench_weight_sync.py
    ... --skip speed            # without the 1B model (about 9 GB of host memory at W=2)
    ... --speed-layers 4        # a smaller model for the speed part

Parts, each printed as it finishes:

- ``bitwise``: for each layout (FSDP, HSDP, FSDP x TP, expert parallel, tied, CPU
  offload, mixed precision masters and ``param_dtype``, ``llama_to_hf`` fused to bf16,
  peft LoRA merged), every streamed tensor against torch's
  ``get_model_state_dict(full_state_dict=True)`` with the same mapping
  (``_weight_sync_layouts.py``).
- ``memory``: a stack of bias-free ``Linear(dim, dim)`` (fp32; one group per layer and
  the root), streamed in ``--bucket-mb`` buckets on every rank into an unsharded copy
  (``load_weights``, allocated before the measurement), against torch's
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` of torch's
  ``fully_shard`` of it: the peak resident set above the start, the largest over the
  ranks, measured as ``bench_full_export.py`` measures (``common/rss.py``). X is
  ours over the bucket size; the target is 2 buckets and the largest parameter.
- ``speed``: a Llama of ``--speed-*`` shapes (1.1B parameters by default, its shards
  filled with a constant: values do not change the time) streamed in bf16, against
  plain gloo ``all_gather_into_tensor`` of bucket-sized uint8 buffers holding the same
  bytes, and against the same bytes as one broadcast per rank (what the stream issues
  on gloo). Y = all-gather time / stream time; each the slowest rank's, the fastest of
  ``--speed-repeats`` interleaved rounds (the machine's load comes and goes).
- ``generate``: ``generate()`` of a 4-layer Hugging Face Llama (5 groups), 32 new
  tokens, inside ``keep_unsharded``: all-gathers at the c10d level per group (Z).
- ``offload``: 2 AdamW steps, ``offload_states``/``reload_states``, 2 more, against 4
  steps without: losses and local shards bitwise?

The last line:
``weight-sync: bitwise=yes|no peak_extra/bucket=X stream/allgather=Y
generate_allgathers/groups=Z offload_roundtrip=bitwise|differs``.
"""

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from _weight_sync_layouts import layouts
from common.dist import reduce_over_ranks, slowest_seconds
from common.rss import MIB, linear_stack, measure, mmap_threshold_set
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from dtensor_fsdp import fully_shard
from dtensor_fsdp.models.llama import Llama, LlamaConfig
from dtensor_fsdp.post_training import (
    keep_unsharded,
    load_weights,
    offload_states,
    reload_states,
    stream_weights,
)
from tests._c10d import C10dRecorder, count_of

PARTS = ("bitwise", "memory", "speed", "generate", "offload")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--skip", default="", help=f"comma-separated parts of {PARTS}")
    parser.add_argument("--bucket-mb", type=float, default=32.0, help="memory part's buckets")
    parser.add_argument("--memory-layers", type=int, default=48)
    parser.add_argument("--memory-dim", type=int, default=1024)  # 4 MiB: 1/8 of a bucket
    parser.add_argument("--speed-bucket-mb", type=float, default=512.0)
    parser.add_argument("--speed-layers", type=int, default=16)
    parser.add_argument("--speed-dim", type=int, default=2048)
    parser.add_argument("--speed-ffn", type=int, default=8192)
    parser.add_argument("--speed-vocab", type=int, default=32000)
    parser.add_argument("--speed-repeats", type=int, default=3, help="rounds; the fastest counts")
    args = parser.parse_args()
    args.skip = {p for p in args.skip.split(",") if p}
    unknown = args.skip - set(PARTS)
    if unknown:
        parser.error(f"--skip: unknown parts {sorted(unknown)}; the parts are {PARTS}")
    return args


def say(text: str) -> None:
    if dist.get_rank() == 0:
        print(text, flush=True)


# Bitwise #


def bitwise() -> bool:
    say("bitwise: every streamed tensor vs get_model_state_dict(full_state_dict=True) + mapping")
    ok = True
    for name, check in layouts(dist.get_world_size()).items():
        differing = check()
        agreed = reduce_over_ranks([float(len(differing))], dist.ReduceOp.MAX)[0] == 0
        ok = ok and agreed
        say(f"  {name:<32} {'yes' if agreed else 'NO: ' + ', '.join(differing[:4])}")
    return ok


# Memory #


def _drain(buckets: Iterator[list[tuple[str, torch.Tensor]]]) -> None:
    for bucket in buckets:
        del bucket  # a consumer that copies what it needs and keeps nothing


def memory(args: argparse.Namespace) -> float:
    if not mmap_threshold_set():
        say("  (MALLOC_MMAP_THRESHOLD_ is not set: the resident set does not follow the tensors)")
    bucket = args.bucket_mb * MIB
    largest = args.memory_dim**2 * 4
    ours = linear_stack(args.memory_layers, args.memory_dim, fully_shard)
    # The engine: the same model unsharded, allocated before the measurement; loading
    # each bucket into it takes long enough for the next bucket to arrive meanwhile.
    engine = nn.Sequential(*(nn.Linear(args.memory_dim, args.memory_dim, bias=False)
                             for _ in range(args.memory_layers)))  # fmt: skip

    def load() -> None:
        for bucket in stream_weights(ours, bucket_mb=args.bucket_mb):
            load_weights(engine, bucket)

    row = measure(load)
    theirs = linear_stack(args.memory_layers, args.memory_dim, torch_fully_shard)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    torch_row = measure(lambda: get_model_state_dict(theirs, options=options))
    ours_mib, torch_mib = reduce_over_ranks([row["rss"], torch_row["rss"]], dist.ReduceOp.MAX)
    x = ours_mib * MIB / bucket
    say(
        f"memory: model {args.memory_layers * largest / MIB:.0f} MiB, largest tensor "
        f"{largest / MIB:.0f} MiB ({largest / bucket:.3f} of a bucket), bucket "
        f"{args.bucket_mb:g} MiB, W={dist.get_world_size()}; peak resident set above the "
        "start, largest over ranks"
    )
    say(f"  ours  stream_weights             {ours_mib:8.1f} MiB = {x:.2f} buckets "
        f"(target <= {2 + largest / bucket:.2f})")  # fmt: skip
    say(
        f"  torch get_model_state_dict(full) {torch_mib:8.1f} MiB = {torch_mib * MIB / bucket:.2f} buckets"
    )
    return x


# Speed #


def _llama_on_host(args: argparse.Namespace) -> nn.Module:
    config = LlamaConfig(
        vocab_size=args.speed_vocab, dim=args.speed_dim, n_layers=args.speed_layers,
        n_heads=args.speed_dim // 64, n_kv_heads=max(1, args.speed_dim // 256),
        ffn_hidden_dim=args.speed_ffn, max_seq_len=128,
    )  # fmt: skip
    with torch.device("meta"):
        model = Llama(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.to_local().fill_(0.01)  # the time does not depend on the values
    return model


def _bucketed_bytes(nbytes: int, bucket: int) -> list[int]:
    return [min(bucket, nbytes - start) for start in range(0, nbytes, bucket)]


def speed(args: argparse.Namespace) -> tuple[float, dict[str, float]]:
    model = _llama_on_host(args)
    numel = sum(p.numel() for p in model.parameters())
    world = dist.get_world_size()
    # What the stream gathers: each parameter's padded full tensor, in bf16.
    nbytes = sum(-(-p.shape[0] // world) * world * (p.numel() // p.shape[0]) * 2
                 for p in model.parameters())  # fmt: skip
    chunks = _bucketed_bytes(nbytes // world, int(args.speed_bucket_mb * MIB) // world)
    shard = torch.ones(max(chunks), dtype=torch.uint8)

    def stream() -> None:
        _drain(stream_weights(model, bucket_mb=args.speed_bucket_mb, dtype=torch.bfloat16))

    def all_gather() -> None:
        for size in chunks:
            out = torch.empty(size * world, dtype=torch.uint8)
            dist.all_gather_into_tensor(out, shard[:size])

    def broadcasts() -> None:
        for size in chunks:
            rows = torch.empty(world, size, dtype=torch.uint8)
            rows[dist.get_rank()].copy_(shard[:size])
            works = [dist.broadcast(rows[r], src=r, async_op=True) for r in range(world)]
            for work in works:
                work.wait()

    methods = {"stream": stream, "all_gather": all_gather, "broadcasts": broadcasts}
    times = dict.fromkeys(methods, float("inf"))
    for _ in range(args.speed_repeats):
        for name, method in methods.items():
            times[name] = min(times[name], slowest_seconds(method))
    y = times["all_gather"] / times["stream"]
    say(f"speed: Llama {numel / 1e9:.2f}B parameters ({args.speed_layers} layers, dim "
        f"{args.speed_dim}), streamed in bf16, {nbytes / 2**30:.2f} GiB gathered per rank, "
        f"{args.speed_bucket_mb:g} MiB buckets, W={world}; slowest rank")  # fmt: skip
    for name, seconds in times.items():
        say(f"  {name:<11} {seconds:7.2f} s  {nbytes / 2**30 / seconds:6.2f} GiB/s")
    say(f"  stream/allgather throughput {y:.2f}, stream/broadcasts "
        f"{times['broadcasts'] / times['stream']:.2f}")  # fmt: skip
    return y, {**times, "params": numel, "gib": nbytes / 2**30}


# Generate #


def generate() -> float:
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    config = HFConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        attn_implementation="sdpa",
    )  # fmt: skip
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kwargs = {"max_new_tokens": 32, "min_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    counts = {}
    for name in ("plain", "keep_unsharded"):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()  # a fresh model: every group sharded
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        groups = len(model.describe_groups())
        context = keep_unsharded(model) if name == "keep_unsharded" else contextlib.nullcontext()
        with C10dRecorder() as recorder, torch.no_grad(), context:
            model.generate(torch.tensor([[5, 6, 7, 8]]), **kwargs)
        counts[name] = count_of(recorder.records, "all_gather")
    say(f"generate: 4-layer HF Llama, {groups} groups, 32 new tokens, W={dist.get_world_size()}: "
        f"{counts['plain']} all-gathers plain, {counts['keep_unsharded']} in keep_unsharded")  # fmt: skip
    return counts["keep_unsharded"] / groups


# Offload #


def offload() -> bool:
    def train(round_trip: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = Llama(LlamaConfig.tiny())
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(1))
        out = []
        for step in range(4):
            loss = model(tokens[:, :-1]).float().logsumexp(-1).mean()
            loss.backward()
            if round_trip and step == 2:
                reload_states(offload_states(model, optimizer))
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.detach())
        return out + [p.to_local().clone() for p in model.parameters()]

    same = all(torch.equal(a, b) for a, b in zip(train(False), train(True), strict=True))
    same = reduce_over_ranks([float(same)], dist.ReduceOp.MIN)[0] == 1.0
    say(f"offload: 4 AdamW steps with a round trip before the third step: "
        f"{'bitwise' if same else 'DIFFERS'} vs without")  # fmt: skip
    return same


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    run = [p for p in PARTS if p not in args.skip]
    results: dict[str, object] = {}
    if "bitwise" in run:
        results["bitwise"] = bitwise()
    if "memory" in run:
        results["peak_extra_per_bucket"] = memory(args)
    if "speed" in run:
        results["stream_per_allgather"], results["speed"] = speed(args)
    if "generate" in run:
        results["generate_allgathers_per_group"] = generate()
    if "offload" in run:
        results["offload_bitwise"] = offload()
    say("BENCH_JSON " + json.dumps(results))

    def show(key: str, fmt: Callable[[object], str]) -> str:
        return fmt(results[key]) if key in results else "skipped"

    say(
        "weight-sync: "
        f"bitwise={show('bitwise', lambda v: 'yes' if v else 'no')} "
        f"peak_extra/bucket={show('peak_extra_per_bucket', lambda v: f'{v:.2f}')} "
        f"stream/allgather={show('stream_per_allgather', lambda v: f'{v:.2f}')} "
        f"generate_allgathers/groups={show('generate_allgathers_per_group', lambda v: f'{v:g}')} "
        f"offload_roundtrip={show('offload_bitwise', lambda v: 'bitwise' if v else 'differs')}"
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
