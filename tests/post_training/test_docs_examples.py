"""The examples of docs/post_training.md, run as written: the code block after each
``<!-- name.py -->`` marker, under torchrun.

- ``rl_loop.py`` (2 ranks): the colocated RL loop runs its 12 steps (weight sync into
  the engine, rollouts, offload and reload, a policy-gradient step) and learns: the
  reward of the last 4 steps above that of the first 4 (0.03 and 0.13 here); under 60
  lines.
- ``engine_sync.py`` (3 ranks): the engine that never trains generates the trainers'
  tokens from the weights it received.
"""

import importlib.util
import re
from pathlib import Path

import pytest

from tests._torchrun import REPO, torchrun

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers (the [test] extra)",
)

DOC = REPO / "docs" / "post_training.md"
STEPS = 12


def _example(name: str) -> str:
    match = re.search(rf"<!-- {name} -->\n```python\n(.*?)\n```", DOC.read_text(), re.DOTALL)
    assert match is not None, f"docs/post_training.md lost its {name} block"
    return match.group(1)


def _run(name: str, tmp_path: Path, nproc: int) -> str:
    script = tmp_path / name
    script.write_text(_example(name))
    return torchrun(script, log=tmp_path / "log.txt", nproc=nproc, deadline_s=300.0).output


def test_rl_loop_is_short() -> None:
    assert len(_example("rl_loop.py").splitlines()) < 60


def test_rl_loop_runs_and_learns(tmp_path: Path) -> None:
    output = _run("rl_loop.py", tmp_path, nproc=2)
    rewards = [float(r) for r in re.findall(r"^step \d+ reward ([\d.]+)$", output, re.MULTILINE)]
    assert len(rewards) == STEPS, output[-3000:]
    assert sum(rewards[-4:]) > sum(rewards[:4]), rewards


def test_engine_sync_generates_the_trainers_tokens(tmp_path: Path) -> None:
    output = _run("engine_sync.py", tmp_path, nproc=3)
    tokens = dict(re.findall(r"rank (\d) tokens (\[[\d, ]+\])", output))
    assert sorted(tokens) == ["0", "1", "2"], output[-3000:]
    assert tokens["0"] == tokens["1"] == tokens["2"]
