"""Evaluation and generation under ``fully_shard``: ours side by side with torch's, on the
tiny Hugging Face ``LlamaForCausalLM`` of ``test_hf_models.py`` (every decoder layer
sharded, then the root), 2 gloo ranks.

- ``generate()`` whose ranks end at different steps (different prompts, rank 0's first
  greedy token as EOS, so rank 0 stops after 1 token and rank 1 runs all 8): Hugging
  Face keeps the ranks stepping together (``synced_gpus``, one all-reduce per step) when
  the model carries torch's ``_is_fsdp_managed_module`` mark, which ours sets too.
  Without it the rank that finished leaves while the other waits in an all-gather
  forever; the harness's deadline (the ranks meet in the store after each scenario)
  then fails the run instead of hanging.
- Collectives of an evaluation loop and of ``generate()``, counted at the c10d level:
  the root (embedding and output head: the largest group) is all-gathered once, not at
  every batch or token, as in torch.
- What a user meets after a ``no_grad`` forward, where the root stays unsharded as in
  torch: the registered parameters (torch's), ``state_dict()`` (DTensors),
  a full-state-dict load (ours loads; torch's fails), and an optimizer step between an
  evaluation and the next forward, or after a backward that kept the unsharded params
  (``set_reshard_after_backward(False)``): ours all-gathers the new values, torch's
  computes with the old ones.
"""

import copy
import importlib.util
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

from dtensor_fsdp import fully_shard, register_fsdp_forward_method
from dtensor_fsdp.optim import step_on_local_shards
from tests._c10d import C10dRecorder, count_of
from tests._harness import run_distributed, run_scenarios, scenario_records
from tests._pool import GlooPools
from tests.integrations.test_hf_models import _build, _shard

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None,
    reason="needs transformers (the [test] extra)",
)

WORLD_SIZE = 2
NEW_TOKENS = 8
PROMPTS = ([[1, 2, 3, 4]], [[5, 6, 7, 8]])  # by rank
EVAL_BATCHES = 3
# torch's first: run last, ours may hang on one rank without failing the other's run.
IMPLS = {
    "torch": (torch_fully_shard, torch_register),
    "ours": (fully_shard, register_fsdp_forward_method),
}


def _sharded_copy(base: nn.Module, mesh: DeviceMesh, shard: Any) -> nn.Module:
    return _shard(copy.deepcopy(base), mesh, shard)


def _counts(recorder: C10dRecorder) -> dict[str, int]:
    return {kind: count_of(recorder.records, kind) for kind in ("all_gather", "all_reduce")}


def _generate(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    base = _build("untied").eval()
    prompt = torch.tensor(PROMPTS[rank])
    with torch.no_grad():
        # Every rank holds the same model: each computes rank 0's first greedy token.
        eos = base(torch.tensor(PROMPTS[0])).logits[0, -1].argmax().item()
    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=0)
    out: dict[str, Any] = {"reference": base.generate(prompt, **kwargs)[0].tolist()}
    for impl, (shard, register) in IMPLS.items():
        model = _sharded_copy(base, mesh, shard)
        register(model, "generate")
        recorder = C10dRecorder()
        with recorder:
            out[impl] = model.generate(prompt, **kwargs)[0].tolist()
        out[f"{impl}_counts"] = _counts(recorder)
        out[f"{impl}_root_after"] = type(model.lm_head.weight).__name__
    return out


def _tokens(rank: int, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 128, (2, 8), generator=gen)  # (batch, seq) of this rank


def _eval_loop(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    """A training step, an evaluation loop, then the next training step."""
    base = _build("untied")
    out: dict[str, Any] = {}
    for impl, (shard, _) in IMPLS.items():
        model = _sharded_copy(base, mesh, shard)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model(input_ids=_tokens(rank, 0), labels=_tokens(rank, 0)).loss.backward()
        optim.step()
        optim.zero_grad()
        recorder = C10dRecorder()
        with recorder, torch.no_grad():
            logits = [model(input_ids=_tokens(rank, 1 + i)).logits for i in range(EVAL_BATCHES)]
        out[f"{impl}_eval"] = _counts(recorder)
        out[f"{impl}_logits"] = torch.stack(logits)
        recorder = C10dRecorder()
        with recorder:
            loss = model(input_ids=_tokens(rank, 9), labels=_tokens(rank, 9)).loss
            loss.backward()
        out[f"{impl}_train"] = _counts(recorder)
        out[f"{impl}_loss"] = loss.item()
    return out


def _after_eval(rank: int, mesh: DeviceMesh) -> dict[str, Any]:
    base = _build("untied")
    tokens = _tokens(rank, 0)
    full = {k: torch.full_like(v, 0.5) for k, v in base.state_dict().items()}
    out: dict[str, Any] = {}
    for impl, (shard, _) in IMPLS.items():
        model = _sharded_copy(base, mesh, shard)
        optim = torch.optim.SGD(model.parameters(), lr=0.5)
        with torch.no_grad():
            model(input_ids=tokens)
        out[f"{impl}_params"] = {n: type(p).__name__ for n, p in model.named_parameters()}
        out[f"{impl}_state_dict"] = {k: type(v).__name__ for k, v in model.state_dict().items()}
        try:
            get_state_dict(model, optim)
            out[f"{impl}_get_state_dict"] = "ok"
        except Exception as error:  # noqa: BLE001 - compared with torch's outcome
            out[f"{impl}_get_state_dict"] = f"{type(error).__name__}: {error}"
        with torch.no_grad():
            model(input_ids=tokens)
        try:
            # A copy: DCP replaces the values of the dict it loads with DTensors.
            options = StateDictOptions(full_state_dict=True)
            set_model_state_dict(model, dict(full), options=options)
            loaded = model.state_dict()
            out[f"{impl}_full_load"] = all(
                torch.equal(loaded[k].full_tensor(), full[k]) for k in full
            )
        except RuntimeError as error:
            out[f"{impl}_full_load"] = str(error)
        for between in ("eval", "kept"):
            out[f"{impl}_{between}"] = _step_then_forward(
                _sharded_copy(base, mesh, shard), tokens, between
            )
    out["fresh"] = _step_then_forward(_sharded_copy(base, mesh, fully_shard), tokens, "nothing")
    # A step on the local tensors (no DTensor op) is seen too.
    out["ours_eval_local"] = _step_then_forward(
        _sharded_copy(base, mesh, fully_shard), tokens, "eval", local_shards=True
    )
    return out


def _step_then_forward(
    model: nn.Module, tokens: torch.Tensor, between: str, local_shards: bool = False
) -> dict[str, Any]:
    """A backward, then ``between`` it and the optimizer step a ``no_grad`` forward
    ("eval") or nothing ("nothing"; "kept": every group keeps its unsharded params after
    backward), then a forward: its logits and collectives."""
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    if local_shards:
        step_on_local_shards(optim)
    if between == "kept":
        model.set_reshard_after_backward(False)
    model(input_ids=tokens, labels=tokens).loss.backward()
    if between == "eval":
        with torch.no_grad():
            model(input_ids=tokens)
    optim.step()
    recorder = C10dRecorder()
    with recorder, torch.no_grad():
        logits = model(input_ids=tokens).logits
    return {"logits": logits, "counts": _counts(recorder)}


def _generate_worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    # The deadline: a rank that returns from generate() while the other waits in an
    # all-gather raises after run_scenarios' wait for the other ranks (30 s), which
    # fails this run. Its own spawn, so that the other tests still report.
    return run_scenarios({"generate": lambda: _generate(rank, mesh)})


def _worker(rank: int, world_size: int) -> dict:
    mesh = init_device_mesh("cpu", (world_size,))
    return run_scenarios(
        {
            "eval_loop": lambda: _eval_loop(rank, mesh),
            "after_eval": lambda: _after_eval(rank, mesh),
        }
    )


@pytest.fixture(scope="module")
def generate_run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_generate_worker, WORLD_SIZE, timeout=120, pool=gloo_pool)


@pytest.fixture(scope="module")
def run(gloo_pool: GlooPools) -> list[dict]:
    return run_distributed(_worker, WORLD_SIZE, timeout=240, pool=gloo_pool)


def test_generate_returns_on_every_rank_when_ranks_end_apart(generate_run):
    recs = scenario_records(generate_run, "generate")
    new_tokens = [len(rec["reference"]) - len(PROMPTS[rank][0]) for rank, rec in enumerate(recs)]
    assert new_tokens == [1, NEW_TOKENS]  # the ranks do end apart
    for rank, rec in enumerate(recs):
        assert rec["ours"] == rec["torch"] == rec["reference"], f"rank {rank}"


def test_generate_issues_torchs_collectives(generate_run):
    for rank, rec in enumerate(scenario_records(generate_run, "generate")):
        # Per token: one all-gather per decoder layer and the synced_gpus all-reduce;
        # the root once for the whole generate(), which reshards it at its end.
        assert rec["ours_counts"] == rec["torch_counts"] == {
            "all_gather": 1 + 2 * NEW_TOKENS,
            "all_reduce": NEW_TOKENS + 1,
        }, f"rank {rank}"
        assert rec["ours_root_after"] == rec["torch_root_after"] == "DTensor"


def test_eval_loop_all_gathers_the_root_once_as_torch(run):
    for rank, rec in enumerate(scenario_records(run, "eval_loop")):
        assert rec["ours_eval"] == rec["torch_eval"] == {
            "all_gather": 1 + 2 * EVAL_BATCHES,
            "all_reduce": 0,
        }, f"rank {rank}"
        assert torch.equal(rec["ours_logits"], rec["torch_logits"]), f"rank {rank}"
        # The next training forward finds the root still unsharded, on both.
        assert rec["ours_train"] == rec["torch_train"], f"rank {rank}"
        assert rec["ours_loss"] == rec["torch_loss"], f"rank {rank}"


def test_after_a_no_grad_forward_state_dicts_see_dtensors(run):
    for rank, rec in enumerate(scenario_records(run, "after_eval")):
        # The root's parameters stay registered unsharded, as torch's...
        assert rec["ours_params"] == rec["torch_params"], f"rank {rank}"
        assert rec["ours_params"]["lm_head.weight"] == "Parameter"
        assert rec["ours_params"]["model.layers.0.mlp.up_proj.weight"] == "DTensor"
        # ...and state dicts reshard them first, on both.
        assert set(rec["ours_state_dict"].values()) == {"DTensor"}
        assert rec["ours_state_dict"] == rec["torch_state_dict"]
        assert rec["ours_get_state_dict"] == rec["torch_get_state_dict"] == "ok"
        # A full-state-dict load: torch's copies into the unsharded root and fails.
        assert rec["ours_full_load"] is True, f"rank {rank}: {rec['ours_full_load']}"
        assert "mixed torch.Tensor and DTensor" in rec["torch_full_load"]


@pytest.mark.parametrize("between", ["eval", "kept"])
def test_an_optimizer_step_reaches_a_kept_group(run, between):
    for rank, rec in enumerate(scenario_records(run, "after_eval")):
        fresh = rec["fresh"]
        assert torch.equal(rec[f"ours_{between}"]["logits"], fresh["logits"]), f"rank {rank}"
        # torch's computes with the kept groups' values from before the step.
        assert not torch.equal(rec[f"torch_{between}"]["logits"], fresh["logits"]), f"rank {rank}"
        # Ours all-gathers the kept groups again (their sharded params changed).
        assert rec[f"ours_{between}"]["counts"] == fresh["counts"] == {
            "all_gather": 3,
            "all_reduce": 0,
        }
        kept = 1 if between == "eval" else 3  # the root, or every group
        assert rec[f"torch_{between}"]["counts"] == {"all_gather": 3 - kept, "all_reduce": 0}
    for rec in scenario_records(run, "after_eval"):
        assert torch.equal(rec["ours_eval_local"]["logits"], rec["fresh"]["logits"])
        assert rec["ours_eval_local"]["counts"] == rec["fresh"]["counts"]
