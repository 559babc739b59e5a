"""Healthy jobs that FSDP's default checks must not stop, under ``torchrun``, for
``test_no_false_alarm.py``: each scenario trains the same way with ``--impl torch``
(torch's ``fully_shard``) and ``--impl ours`` (dtensor_fsdp's defaults: the collective
watchdog and the optimizer step guard on), and writes its losses and a digest of the
final parameters, so that the test can ask for torch's result and no error.

- ``dcgan``: DCGAN's loop with one Adam over the generator's and the discriminator's
  param groups: the discriminator's step runs while the generator's forward awaits its
  backward (the generator's grads are None then: Adam skips them).
- ``gil_hold``: at step 1 rank 0 alone, between its backward and its optimizer step,
  holds the GIL in one C call (a regular expression that backtracks catastrophically,
  sized at start for at least ``--hold-s`` seconds) while rank 1 waits in the next
  forward's all-gather; ours runs with ``--deadline`` (the watchdog compares, and rank
  0's watchdog thread cannot answer until the call returns). The other scenarios run
  ours' defaults (a short deadline would also warn, rightly, when a loaded machine
  stalls a rank for that long: not what they test).
- ``late_waits``: rank 0 starts every step, and every block's forward, 0-3 ms late,
  so that rank 1's next wait outlasts a 1 ms slice of the bounded wait two times in
  three (ours: the slice set to 1 ms, a test-only knob); ours until ``--until-stalls``
  waits outlasted it, torch's as many steps. (Late per block, not only per step: each
  step then gives about 5 such waits instead of 2, so the 10,000 take half the time.)

Each rank writes ``--out``.rank{r}.json: per scenario, the exception it raised (type,
message, or None), the FSDP warnings it issued, the losses, the digest, and for ours
the host waits that outlasted their first slice (``stalls``), the measured hold, and
the threads and store keys of ``late_waits`` after 200 steps and at its end.
"""

import argparse
import hashlib
import json
import random
import re
import threading
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

DIM = 16
LATE_SLICE = timedelta(milliseconds=1)
# late_waits: torch's run trains this many steps; ours' losses and parameters then are
# compared with them, and ours trains on until its late waits are counted.
COMPARED_STEPS = 200


def shard(impl: str, model: nn.Module, mesh, deadline_s: float | None = None) -> nn.Module:
    """Each Linear and the whole ``fully_shard``; ours with the watchdog's default
    deadline, or ``deadline_s``."""
    if impl == "ours":
        from dtensor_fsdp import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if impl == "ours" and deadline_s is not None:
        model.set_collective_watchdog(deadline=deadline_s)
    return model


def mlp(out: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(DIM, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, out)
    )


def digest(*models: nn.Module) -> str:
    sha = hashlib.sha256()
    for model in models:
        for param in model.parameters():
            sha.update(param.full_tensor().detach().numpy().tobytes())
    return sha.hexdigest()


def batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(8, DIM, generator=torch.Generator().manual_seed(1000 * step + rank))


def dcgan(impl: str, mesh, rank: int, args) -> dict:
    torch.manual_seed(0)
    generator = shard(impl, mlp(DIM), mesh)
    discriminator = shard(impl, mlp(1), mesh)
    optim = torch.optim.Adam(
        [{"params": generator.parameters()}, {"params": discriminator.parameters(), "lr": 2e-3}],
        lr=1e-3,
    )
    losses = []
    for step in range(3):
        real, noise = batch(step, rank), batch(step + 100, rank)
        fake = generator(noise)
        optim.zero_grad()
        loss_d = discriminator(fake.detach()).mean() - discriminator(real).mean()
        loss_d.backward()
        optim.step()  # the generator's forward awaits its backward; its grads are None
        optim.zero_grad()
        loss_g = -discriminator(fake).mean()
        loss_g.backward()
        optim.step()
        losses += [loss_d.item(), loss_g.item()]
    return {"losses": losses, "digest": digest(generator, discriminator)}


def hold_gil(seconds: float) -> float:
    """Hold the GIL in one C call (``re`` does not release it) for at least about
    ``seconds``: ``(a+)+$`` against ``"a" * n + "b"`` backtracks through 2**n ways to
    split the a's, so each a doubles the time. Returns the seconds it held."""
    n, took = 16, 0.0
    while took < 0.3:  # long enough to extrapolate from
        n += 1
        start = time.perf_counter()
        re.match(r"(a+)+$", "a" * n + "b")
        took = time.perf_counter() - start
    while took < 1.5 * seconds:  # a margin: the machine's load varies (by 1.4x seen)
        n, took = n + 1, 2 * took
    start = time.perf_counter()
    re.match(r"(a+)+$", "a" * n + "b")
    return time.perf_counter() - start


def train(
    impl: str, mesh, rank: int, steps: int, before_step, before_optim,
    deadline_s: float | None = None,
) -> dict:  # fmt: skip
    """``steps`` steps of AdamW, or fewer when ``before_step(model, step)`` says stop;
    ours' watchdog with ``deadline_s``, or its default."""
    torch.manual_seed(0)
    model = shard(impl, mlp(1), mesh, deadline_s)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        if before_step(model, step):
            break
        loss = model(batch(step, rank)).square().mean()
        loss.backward()
        before_optim(step)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses, "digest": digest(model)}
    if impl == "ours":
        result["stalls"] = model._get_fsdp_state().watchdog.stalls
    return result


def gil_hold(impl: str, mesh, rank: int, args) -> dict:
    held = []

    def before_optim(step: int) -> None:
        if step == 1 and rank == 0:
            held.append(hold_gil(args.hold_s))

    result = train(
        impl, mesh, rank, 3, lambda model, step: False, before_optim, args.deadline
    )
    return {**result, "held_s": held[0] if held else None}


def late_waits(impl: str, mesh, rank: int, args) -> dict:
    """Ours runs until both ranks together counted ``--until-stalls`` waits that
    outlasted the 1 ms slice (checked every 50 steps), or ``--steps``, and gives the
    digest after `COMPARED_STEPS` steps too (``digest_compared``); torch's runs
    ``--steps`` (`COMPARED_STEPS`)."""
    late = random.Random(rank)
    store = dist.distributed_c10d._get_default_store()
    # (threads, store keys) at step 200, once every rank published (its first stalled
    # wait added its key), and at the end.
    resources = []
    compared = []

    def late_block(module: nn.Module, args: tuple) -> None:
        time.sleep(late.uniform(0.0, 0.003))

    def before_step(model: nn.Module, step: int) -> bool:
        if step == 0 and rank == 0:  # the model is built: rank 0 late at each block too
            for layer in model:
                if isinstance(layer, nn.Linear):
                    layer.register_forward_pre_hook(late_block)
        if impl == "ours" and step == 1:  # the root's recorder exists after step 0
            model._get_fsdp_state().watchdog.slice = LATE_SLICE
        if step == 200:
            resources.append((threading.active_count(), store.num_keys()))
        if step == COMPARED_STEPS:
            compared.append(digest(model))
        if impl == "ours" and step > 0 and step % 50 == 0:
            stalls = torch.tensor(model._get_fsdp_state().watchdog.stalls)
            dist.all_reduce(stalls)  # not FSDP's: the loop's own stopping rule
            if stalls.item() >= args.until_stalls:
                return True
        if rank == 0:
            time.sleep(late.uniform(0.0, 0.003))
        return False

    result = train(impl, mesh, rank, args.steps, before_step, lambda step: None)
    resources.append((threading.active_count(), store.num_keys()))
    return {**result, "resources": resources, "digest_compared": compared[0] if compared else None}


SCENARIOS = {"dcgan": dcgan, "gil_hold": gil_hold, "late_waits": late_waits}


def run(scenario: str, impl: str, mesh, rank: int, args) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = {"error": None, **SCENARIOS[scenario](impl, mesh, rank, args)}
        except Exception as error:  # noqa: BLE001 (the verdict is what each rank raised)
            result = {"error": type(error).__name__, "message": str(error)}
    result["warnings"] = [str(w.message) for w in caught if "FSDP" in str(w.message)]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("ours", "torch"), required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated, run in order")
    parser.add_argument("--deadline", type=float, default=60.0, help="ours' in gil_hold")
    parser.add_argument("--hold-s", type=float, default=6.0)
    parser.add_argument("--steps", type=int, default=100, help="late_waits' (at most)")
    parser.add_argument("--until-stalls", type=int, default=10_000, help="late_waits, ours")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for scenario in args.scenarios.split(","):
        dist.barrier()
        start = time.monotonic()
        results[scenario] = run(scenario, args.impl, mesh, rank, args)
        results[scenario]["seconds"] = time.monotonic() - start
        with open(f"{args.out}.rank{rank}.json", "w") as f:
            json.dump(results, f)
        summary = {k: v for k, v in results[scenario].items() if k != "losses"}
        print(f"rank {rank} {args.impl} {scenario}: {summary}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
