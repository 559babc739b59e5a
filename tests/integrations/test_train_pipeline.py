"""``train.py --pp N`` (issue 21): pipeline stages over an outer "pp" axis.

On 4 ranks, ``--pp 2`` (mesh (pp=2, dp=2), 2 rows per microbatch) under each
``--pp-schedule`` trains the same model on the same global batch as a run without
pipeline parallelism (mesh (dp=4)): ``train.py`` draws one global batch of
``batch_size * dp_size`` rows per step, 8 in both. Per-step losses and grad norms must
agree to fp32 rounding, the final full parameters within AdamW's bound ([Note: parity
tolerances] in ``_parity.py``, items 2 and 3): the pipeline sums each rank's gradient
over 4 microbatches before FSDP's reduction, the plain run over one batch, so the same
terms are summed in another order; the grad norm is summed per stage, then over the
pp ranks. Bad flag combinations stop with one message naming the flag.
"""

import json
import os

import pytest
import torch
import torch.distributed as dist

import train
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._parity import ATOL, RTOL, adamw_param_atol
from tests._pool import GlooPools

FLAGS = [
    "--dim", "32", "--n-layers", "4", "--n-heads", "4", "--n-kv-heads", "2",
    "--vocab-size", "64", "--seq-len", "8", "--steps", "3",
]  # fmt: skip
PP_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


def _train(flags: list[str], path: str) -> dict:
    train.train(train.parse_args([*flags, "--metrics-out", path]), torch.device("cpu"))
    dist.barrier()  # rank 0 has written the file
    with open(path) as f:
        return json.load(f)


def _worker(rank: int, world_size: int, directory: str) -> dict:
    scenarios = {"dp": lambda: _train([*FLAGS, "--batch-size", "2"], f"{directory}/dp.json")}
    for schedule in PP_SCHEDULES:
        flags = [*FLAGS, "--batch-size", "4", "--pp", "2", "--pp-schedule", schedule]
        path = os.path.join(directory, f"{schedule}.json")
        scenarios[schedule] = lambda flags=flags, path=path: _train(flags, path)
    return run_scenarios(scenarios)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, gloo_pool: GlooPools) -> list:
    tmp = str(tmp_path_factory.mktemp("pp"))
    return run_distributed(_worker, 4, tmp, timeout=300, pool=gloo_pool)


@pytest.mark.parametrize("schedule", PP_SCHEDULES)
def test_pp_trains_as_the_data_parallel_run(run, schedule: str) -> None:
    ref = scenario_records(run, "dp")[0]
    ours = scenario_records(run, schedule)[0]
    torch.testing.assert_close(ours["losses"], ref["losses"], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours["grad_norms"], ref["grad_norms"], atol=ATOL, rtol=RTOL)
    # The stages' FQNs are the whole model's, all of them gathered on rank 0.
    assert ours["params"].keys() == ref["params"].keys()
    atol = adamw_param_atol(len(ref["losses"]), lr=train.parse_args(FLAGS).lr)
    for name, value in ours["params"].items():
        torch.testing.assert_close(
            torch.tensor(value), torch.tensor(ref["params"][name]), atol=atol, rtol=0, msg=name
        )


@pytest.mark.parametrize(
    ("flags", "phrase"),
    [
        (["--pp", "2", "--tp", "2"], "--tp"),
        (["--pp", "2", "--grad-accum", "2"], "--grad-accum"),
        (["--pp", "2", "--tie-embeddings"], "--tie-embeddings"),
        (["--pp", "2", "--microbatches", "3"], "--microbatches 3 must divide --batch-size 8"),
        (["--pp", "4", "--n-layers", "2"], "more than the 2 layers"),
        (["--pp", "3"], "must divide the world size 8"),
    ],
)
def test_bad_pp_combinations_stop_with_one_message(flags: list[str], phrase: str) -> None:
    args = train.parse_args(flags)
    with pytest.raises(ValueError, match=phrase):
        train.validate_parallelism(args, train.build_config(args), world_size=8)
