"""The GPU check's rows that drive dtensor_fsdp through a framework, on spawned ranks:

- ``accelerate``: accelerate's FSDP2 plugin path end to end (``Accelerator(fsdp_plugin=
  FullyShardedDataParallelPlugin(fsdp_version=2, ...))``, ``accelerator.prepare(model,
  optimizer)``, gradient accumulation, ``clip_grad_norm_``) with torch's
  ``fully_shard`` and with ours switched in by ``use_dtensor_fsdp()``. accelerate turns
  FSDP on only for accelerator devices (never for CPU processes), hence on CUDA only;
  the CPU tests drive its ``fsdp2_prepare_model`` directly
  (tests/integrations/test_accelerate.py).

Importable without accelerate: the row is then a SKIP (``Outcome.skip``).
"""

import importlib.util
import os
from typing import Any

import torch
import torch.distributed.fsdp as torch_fsdp
from torch.distributed.tensor import DTensor

import dtensor_fsdp
from dtensor_fsdp.integrations import use_dtensor_fsdp
from dtensor_fsdp.models.llama import Llama, cross_entropy_loss
from gpu_check.launch import RankSpec, join_group
from gpu_check.report import Outcome
from gpu_check.rows import shape_for
from gpu_check.training import SEED, Shape, attention, local_copies, optimizer_for

ACCELERATE_STEPS, ACCELERATE_MICRO_BATCHES = 3, 2
MAX_GRAD_NORM = 1.0


def accelerate_fsdp2(spec: RankSpec) -> Outcome:
    outcome = Outcome()
    if importlib.util.find_spec("accelerate") is None:
        outcome.skip("accelerate is not installed (pip install accelerate)")
        return outcome
    device = join_group(spec)
    # accelerate reads its process layout from the launcher's variables; the group is
    # joined already (join_group), which it keeps.
    os.environ.update(
        RANK=str(spec.rank), LOCAL_RANK=str(spec.rank), WORLD_SIZE=str(spec.world_size),
        LOCAL_WORLD_SIZE=str(spec.world_size),
    )  # fmt: skip
    shape = shape_for(spec, "small")
    theirs = _accelerate_run(shape, device)
    with use_dtensor_fsdp():
        ours = _accelerate_run(shape, device)
    outcome.check(
        "ours shards", ours["ours"] and not theirs["ours"],
        f"the prepared root is dtensor_fsdp's: ours {ours['ours']}, torch's {theirs['ours']}",
    )  # fmt: skip
    outcome.check(
        "same groups", ours["groups"] == theirs["groups"], f"{len(ours['groups'])} groups"
    )
    outcome.check(
        "params DTensors", ours["dtensors"] and theirs["dtensors"],
        f"every parameter a DTensor: ours {ours['dtensors']}, torch's {theirs['dtensors']}",
    )  # fmt: skip
    # W=1: no sum across ranks, the same kernels (math SDPA) on the same values.
    for key in ("losses", "grad_norms"):
        same = ours[key] == theirs[key]
        outcome.check(f"{key} bitwise", same, f"ours {ours[key]} vs torch's {theirs[key]}")
    differing = [n for n, p in ours["params"].items() if not torch.equal(p, theirs["params"][n])]
    outcome.check(
        "params bitwise", ours["params"].keys() == theirs["params"].keys() and not differing,
        f"after {ACCELERATE_STEPS} steps; differing: {differing[:3]}",
    )  # fmt: skip
    return outcome


def _accelerate_run(shape: Shape, device: torch.device) -> dict[str, Any]:
    """``ACCELERATE_STEPS`` steps of ``ACCELERATE_MICRO_BATCHES`` micro-batches of the
    repo's Llama, prepared by accelerate's FSDP2 plugin (each block wrapped, then
    accelerate's own tail group and the root)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin

    # One Accelerator per run: accelerate's state is process-wide.
    AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["TransformerBlock"],
        cpu_ram_efficient_loading=False,
    )
    accelerator = Accelerator(
        fsdp_plugin=plugin, gradient_accumulation_steps=ACCELERATE_MICRO_BATCHES
    )
    torch.manual_seed(SEED)
    with device:
        model = Llama(shape.config())
    model, optimizer = accelerator.prepare(model, optimizer_for(model))
    losses, grad_norms = [], []
    for step in range(ACCELERATE_STEPS):
        generator = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(
            shape.vocab_size, (ACCELERATE_MICRO_BATCHES * shape.batch_size, shape.seq_len + 1),
            generator=generator,
        ).to(device)  # fmt: skip
        for micro in tokens.chunk(ACCELERATE_MICRO_BATCHES):
            with accelerator.accumulate(model), attention(deterministic=True):
                loss = cross_entropy_loss(model(micro[:, :-1]), micro[:, 1:])
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                    grad_norms.append(norm.item())
                optimizer.step()
                optimizer.zero_grad()
            losses.append(loss.item())
    return {
        "ours": isinstance(model, dtensor_fsdp.FSDPModule),
        # Ours pass torch's isinstance while the switch is on.
        "groups": [n for n, m in model.named_modules() if isinstance(m, torch_fsdp.FSDPModule)],
        "dtensors": all(isinstance(p, DTensor) for p in model.parameters()),
        "losses": losses,
        "grad_norms": grad_norms,
        "params": local_copies(dict(model.named_parameters())),
    }  # fmt: skip
