"""peft LoRA layers in a weight stream: which weights merge (`LoraMerge`), the merged
names, and the merge itself, on gathered copies: the trainer's parameters are never
touched (verl merges in place, inside FSDP's full-parameter context, then unmerges).

The arithmetic is peft's ``Linear.merge`` (``safe_merge=False``): ``W + (B @ A) * s``
per active adapter in order, in the weights' dtype, then transposed for
``fan_in_fan_out`` layers; bitwise what ``merge_and_unload()`` gives on the same full
weights. Layers are found by peft's attributes (``base_layer``, ``lora_A``,
``lora_B``, ``scaling``, ``active_adapters``): peft stays optional.
"""

from dataclasses import dataclass

import torch
from torch import nn

# peft's key segments: PeftModel wraps the model as base_model.model, a LoRA layer
# keeps the original module as base_layer.
_PEFT_PREFIX = "base_model.model."
_BASE_LAYER = ".base_layer"


@dataclass(frozen=True)
class LoraMerge:
    """One LoRA layer's merge: ``base + sum_i (ups[i] @ downs[i]) * scalings[i]``."""

    base: str  # the base weight's state-dict key
    downs: tuple[str, ...]  # lora_A keys, one per active adapter
    ups: tuple[str, ...]  # lora_B keys
    scalings: tuple[float, ...]
    fan_in_fan_out: bool  # the delta is transposed (GPT-2's Conv1D layers)

    @property
    def keys(self) -> tuple[str, ...]:
        return (self.base, *self.downs, *self.ups)


def is_lora_layer(module: nn.Module) -> bool:
    return all(
        hasattr(module, attr) for attr in ("base_layer", "lora_A", "lora_B", "scaling")
    ) and isinstance(module.lora_A, nn.ModuleDict)


def find_lora_merges(model: nn.Module) -> list[LoraMerge]:
    """The merges of every LoRA layer under ``model`` (one per path to it).

    Raises:
        NotImplementedError: a layer whose merge is not ``W + B @ A * s`` (DoRA or
            another LoRA variant, ``lora_bias``, embedding adapters) or that peft has
            merged already, naming it.
    """
    merges = []
    for name, module in model.named_modules(remove_duplicate=False):
        if not is_lora_layer(module):
            continue
        prefix = f"{name}." if name else ""
        adapters = [a for a in module.active_adapters if a in module.lora_A]
        _check_plain_lora(name, module, adapters)
        merges.append(
            LoraMerge(
                base=f"{prefix}base_layer.weight",
                downs=tuple(f"{prefix}lora_A.{a}.weight" for a in adapters),
                ups=tuple(f"{prefix}lora_B.{a}.weight" for a in adapters),
                scalings=tuple(float(module.scaling[a]) for a in adapters),
                fan_in_fan_out=bool(getattr(module, "fan_in_fan_out", False)),
            )
        )
    return merges


def _check_plain_lora(name: str, module: nn.Module, adapters: list[str]) -> None:
    variants = [a for a in adapters if a in (getattr(module, "lora_variant", None) or {})]
    biased = [a for a in adapters if (getattr(module, "lora_bias", None) or {}).get(a)]
    embedded = [a for a in adapters if a in (getattr(module, "lora_embedding_A", None) or {})]
    problem = None
    if getattr(module, "merged_adapters", None):
        problem = f"peft merged adapters {module.merged_adapters} into it already (unmerge first)"
    elif variants or biased or embedded:
        problem = (
            f"adapters {variants or biased or embedded} are not plain LoRA on a Linear "
            "(DoRA or another variant, lora_bias, or an embedding)"
        )
    if problem is not None:
        raise NotImplementedError(
            f"stream_weights(merge_lora=True): LoRA layer '{name}': {problem}; stream "
            "with merge_lora=False to send the adapters unmerged"
        )


def lora_parameter_keys(model: nn.Module) -> set[str]:
    """Every state-dict key of a LoRA layer's adapters (active or not): left out of a
    merged stream."""
    keys = set()
    for name, module in model.named_modules(remove_duplicate=False):
        if is_lora_layer(module):
            prefix = f"{name}." if name else ""
            for attr in ("lora_A", "lora_B"):
                for key, _ in getattr(module, attr).named_parameters(remove_duplicate=False):
                    keys.add(f"{prefix}{attr}.{key}")
    return keys


def merged_name(key: str) -> str:
    """A key of the peft model as the merged model names it (``merge_and_unload()``):
    without ``base_model.model.`` and ``.base_layer``."""
    key = key.removeprefix(_PEFT_PREFIX)
    return key.replace(_BASE_LAYER + ".", ".")


def merge(merge: LoraMerge, full: dict[str, torch.Tensor]) -> torch.Tensor:
    """The merged weight from the full tensors of ``merge.keys``: a new tensor, in the
    base weight's dtype (peft's arithmetic: see the module docstring)."""
    merged = full[merge.base].clone()
    for down, up, scaling in zip(merge.downs, merge.ups, merge.scalings, strict=True):
        delta = full[up] @ full[down]  # (out, r) @ (r, in)
        if merge.fan_in_fan_out:
            delta = delta.T
        merged += (delta * scaling).to(merged.dtype)
    return merged
