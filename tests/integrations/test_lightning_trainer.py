"""Lightning's ``Trainer`` with ``ModelParallelStrategy`` (FSDP2): ``fully_shard``
called in ``LightningModule.configure_model``, gradient accumulation
(``accumulate_grad_batches``), a validation loop (a no-grad forward, after which the
root stays unsharded), ``trainer.save_checkpoint`` and a resume
(``fit(ckpt_path=...)``), with torch's ``fully_shard`` and with ours.

The Trainer itself never asks whether a module is torch's ``FSDPModule``
(lightning/pytorch/strategies/model_parallel.py): it reads the parameters (DTensors)
and torch's ``torch.distributed.checkpoint.state_dict`` helpers, which call
``state_dict()``/``load_state_dict()``. Under accumulation it does not silence the
reductions of FSDP2 modules (``block_backward_sync`` handles DDP only), so torch's and
ours reduce on every micro-batch. What the switch decides is whose ``fully_shard`` a
``configure_model`` written for torch (``torch.distributed.fsdp.fully_shard``) calls;
one that calls ``dtensor_fsdp.fully_shard`` works without the switch (a control below).
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from tests._c10d import C10dRecorder, count_of
from tests._harness import run_distributed
from tests._mlp import mlp
from tests.integrations._lightning import checkpoint_structure, lightning_environment

lightning = pytest.importorskip(
    "lightning", reason="Lightning is not installed (pip install lightning)"
)

EPOCHS, BATCHES_PER_EPOCH = 2, 4  # per rank; the checkpoint is taken after epoch 1


def _shard_with(shard: Callable[..., Any], model: nn.Sequential, mesh: Any) -> None:
    for block in (model[0], model[2]):
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)


def _torch_names(model: nn.Sequential, mesh: Any) -> None:
    """configure_model as written for torch: fully_shard looked up at call time, so
    the switch decides whose it is."""
    _shard_with(lambda module, **kw: torch_fsdp.fully_shard(module, **kw), model, mesh)


def _ours_directly(model: nn.Sequential, mesh: Any) -> None:
    import dtensor_fsdp

    _shard_with(dtensor_fsdp.fully_shard, model, mesh)


class _Module(lightning.LightningModule):
    def __init__(self, parallelize: Callable[[nn.Sequential, Any], None]) -> None:
        super().__init__()
        self.model = mlp()
        self.parallelize = parallelize
        self.losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []

    def configure_model(self) -> None:
        if isinstance(self.model[0].weight, torch.distributed.tensor.DTensor):
            return  # sharded already (Lightning may call this hook again)
        self.parallelize(self.model, self.device_mesh["data_parallel"])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.model(batch).sum()
        self.losses.append(loss.detach().clone())
        return loss  # the Trainer divides it by accumulate_grad_batches

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        # A forward without gradients: the root keeps its parameters unsharded after
        # it (both FSDPs), and the checkpoint is then taken.
        self.val_losses.append(self.model(batch).sum())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        # Adam: the checkpoint holds optimizer state (exp_avg, exp_avg_sq, step).
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _data() -> torch.utils.data.DataLoader:
    # The Trainer puts in a DistributedSampler (no shuffle: sequential sampler): each
    # rank gets its own BATCHES_PER_EPOCH batches, the same in each epoch.
    generator = torch.Generator().manual_seed(1)
    samples = list(torch.randn(2 * BATCHES_PER_EPOCH * 4, 8, generator=generator))
    return torch.utils.data.DataLoader(samples, batch_size=4)


def _fit(module: _Module, epochs: int, accumulate: int, root: Path, **fit: Any) -> Any:
    from lightning.pytorch.strategies import ModelParallelStrategy

    lightning_environment(torch.distributed.get_rank(), torch.distributed.get_world_size())
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        max_epochs=epochs,
        accumulate_grad_batches=accumulate,
        default_root_dir=str(root),
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=1,
    )
    trainer.fit(module, _data(), _data(), **fit)
    return trainer


def _params(module: _Module) -> dict[str, torch.Tensor]:
    module.model.reshard()  # the root stays unsharded after the no-grad validation forward
    return {n: p.to_local().clone() for n, p in module.model.named_parameters()}


def _train(parallelize: Callable[..., None], accumulate: int, root: Path) -> dict[str, Any]:
    import dtensor_fsdp

    uninterrupted, recorder = _Module(parallelize), C10dRecorder()
    with recorder:
        _fit(uninterrupted, EPOCHS, accumulate, root)
    # The same run in two: epoch 1, a checkpoint, then a new Trainer resuming from it.
    first = _Module(parallelize)
    trainer = _fit(first, 1, accumulate, root)
    path = root / "checkpoint"
    trainer.save_checkpoint(path)
    resumed = _Module(parallelize)
    _fit(resumed, EPOCHS, accumulate, root, ckpt_path=path)
    return {
        "ours": isinstance(uninterrupted.model, dtensor_fsdp.FSDPModule),
        "torch_class": isinstance(uninterrupted.model, torch_fsdp.FSDPModule),
        "reductions": count_of(recorder.records, "reduce_scatter")
        + count_of(recorder.records, "all_to_all"),
        "losses": uninterrupted.losses,
        "val_losses": uninterrupted.val_losses,
        "params": _params(uninterrupted),
        "split_losses": first.losses + resumed.losses,
        "resumed_params": _params(resumed),
        "checkpoint": checkpoint_structure(path),
    }


def _run(rank: int, world_size: int, accumulate: int, root: str) -> dict[str, Any]:
    from dtensor_fsdp.integrations import use_dtensor_fsdp

    runs = Path(root)
    results = {
        "torch": _train(_torch_names, accumulate, runs / "torch"),
        "ours_unswitched": _train(_ours_directly, accumulate, runs / "ours_unswitched"),
    }
    with use_dtensor_fsdp():
        results["ours"] = _train(_torch_names, accumulate, runs / "ours")
    return results


def _assert_bitwise(mine: Any, theirs: Any, what: str) -> None:
    # Two ranks: one sum per element, the same bits whichever order (a+b == b+a).
    if isinstance(mine, dict):
        assert mine.keys() == theirs.keys(), what
        for name in mine:
            torch.testing.assert_close(
                mine[name], theirs[name], rtol=0, atol=0, msg=f"{what} {name}"
            )
        return
    assert len(mine) == len(theirs), what
    for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"{what} [{i}]")


@pytest.mark.parametrize("accumulate", [1, 2])
def test_trainer_fits_saves_and_resumes_as_torch(accumulate: int, tmp_path: Path) -> None:
    for rank in run_distributed(_run, 2, accumulate, str(tmp_path), timeout=600):
        torch_run, ours = rank["torch"], rank["ours"]
        assert not torch_run["ours"] and torch_run["torch_class"]
        assert ours["ours"] and ours["torch_class"]
        # 3 groups (two blocks and the root) reduce on every micro-batch, as torch's:
        # the Trainer leaves FSDP2's gradient sync on under accumulation.
        assert torch_run["reductions"] == 3 * EPOCHS * BATCHES_PER_EPOCH
        assert len(torch_run["losses"]) == EPOCHS * BATCHES_PER_EPOCH
        for name in ("ours", "ours_unswitched"):
            run = rank[name]
            assert run["reductions"] == torch_run["reductions"], name
            _assert_bitwise(run["losses"], torch_run["losses"], f"{name} losses")
            _assert_bitwise(run["val_losses"], torch_run["val_losses"], f"{name} val losses")
            _assert_bitwise(run["params"], torch_run["params"], f"{name} params")
            # Resumed from the checkpoint, it continues as the uninterrupted run.
            _assert_bitwise(run["split_losses"], run["losses"], f"{name} resumed losses")
            _assert_bitwise(run["resumed_params"], run["params"], f"{name} resumed params")
            assert run["checkpoint"] == torch_run["checkpoint"], name
        # The control: ours called directly needs no switch, but is not torch's class.
        assert rank["ours_unswitched"]["ours"] and not rank["ours_unswitched"]["torch_class"]
