"""Does ``torch.compile(backend="aot_eager")`` train a plain Hugging Face model bitwise
like eager? Per configuration, the largest loss difference over 4 AdamW steps.

    python tools/compile_drift.py

No FSDP and no process group: a tiny ``LlamaForCausalLM`` (2 layers, dim 32), trained
eager and compiled from the same seed on the same tokens, with and without HF's own
gradient checkpointing (``gradient_checkpointing_enable()``), SDPA or eager attention,
fp32 or bf16 parameters. Where it prints a nonzero difference, graph mode (which
compiles the same model the same way) inherits it: docs/graph.md, "Numerics".
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

STEPS = 4


def losses(compiled: bool, checkpointing: bool, attention: str, dtype: torch.dtype) -> list[float]:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        attn_implementation=attention,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    run = torch.compile(model, backend="aot_eager") if compiled else model
    out = []
    for step in range(STEPS):
        tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = run(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        out.append(loss.item())
    return out


def main() -> None:
    for checkpointing in (False, True):
        for attention in ("sdpa", "eager"):
            for dtype in (torch.float32, torch.bfloat16):
                torch._dynamo.reset()
                eager = losses(False, checkpointing, attention, dtype)
                compiled = losses(True, checkpointing, attention, dtype)
                diff = max(abs(a - b) for a, b in zip(eager, compiled, strict=True))
                print(
                    f"checkpointing={checkpointing!s:<5} attention={attention:<5} "
                    f"{str(dtype).removeprefix('torch.'):<8} max |loss diff| = {diff:.3g}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
