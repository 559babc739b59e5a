"""The colocated RL loop of docs/post_training.md, run as written: the code block after
its ``<!-- rl_loop.py -->`` marker, under torchrun on 2 gloo ranks. It must run its 12
steps (weight sync into the engine, rollouts, offload and reload, a policy-gradient
step) and learn: the reward of the last 4 steps above that of the first 4 (0.03 and
0.13 here), and the docs must keep it under 60 lines."""

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


def _loop_source() -> str:
    text = DOC.read_text()
    match = re.search(r"<!-- rl_loop.py -->\n```python\n(.*?)\n```", text, re.DOTALL)
    assert match is not None, "docs/post_training.md lost its rl_loop.py block"
    return match.group(1)


def test_loop_is_short() -> None:
    assert len(_loop_source().splitlines()) < 60


def test_loop_runs_and_learns(tmp_path: Path) -> None:
    script = tmp_path / "rl_loop.py"
    script.write_text(_loop_source())
    launch = torchrun(script, log=tmp_path / "log.txt", nproc=2, deadline_s=300.0)
    rewards = [
        float(r) for r in re.findall(r"^step \d+ reward ([\d.]+)$", launch.output, re.MULTILINE)
    ]
    assert len(rewards) == STEPS, launch.output[-3000:]
    assert sum(rewards[-4:]) > sum(rewards[:4]), rewards
