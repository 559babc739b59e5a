"""plan()'s peak_module does not depend on string hashing: at the tiny Llama's peak
on gloo, layers.0 (its backward just begun) and layers.1 (its backward not yet
finished) are both active at one depth, and the tie used to follow the iteration
order of ModTracker's set of names, i.e. PYTHONHASHSEED."""

import os
import subprocess
import sys
from pathlib import Path

# Two blocks, gloo (reduce-scatter as all-to-all): the case whose peak falls at the
# hand-off between layers.1's backward and layers.0's.
_PLAN = """
import dataclasses, torch
from dtensor_fsdp import plan
from dtensor_fsdp.models.llama import Llama, LlamaConfig, cross_entropy_loss
config = dataclasses.replace(LlamaConfig.tiny(), n_layers=2)
p = plan(
    lambda: Llama(config),
    world_size=4,
    batch=lambda: torch.randint(0, config.vocab_size, (2, 33)),
    loss_fn=lambda m, t: cross_entropy_loss(m(t[:, :-1]), t[:, 1:]),
    backend="gloo",
)
print(p.peak_module, p.peak_phase, sep="|")
"""


def _peak_where(hash_seed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(hash_seed)}
    out = subprocess.run(
        [sys.executable, "-c", _PLAN],
        cwd=Path(__file__).parents[2],  # this checkout's dtensor_fsdp
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()[-1]


def test_peak_module_is_the_same_for_every_hash_seed() -> None:
    # Before the fix seeds 0 and 11 gave layers.1, 5 and 8 layers.0 (checked on torch
    # 2.13; of seeds 0-11, 0-4, 6, 7 and 11 gave layers.1). One seed of each answer is
    # what it takes to see the dependence: each costs an interpreter, torch's import and
    # a plan, about 5 s of CPU. Now: the last entered of the tied blocks, layers.0, whose
    # backward began.
    seeds = (0, 5)
    assert {seed: _peak_where(seed) for seed in seeds} == dict.fromkeys(seeds, "layers.0|backward")
