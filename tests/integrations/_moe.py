"""A small torchtitan-style mixture-of-experts decoder, with torchtitan's expert parallelism.

The shapes and names follow torchtitan's (``torchtitan/models/common/moe.py``,
``token_dispatcher.py``, and the ``ExpertParallel`` style of
``torchtitan/distributed/expert_parallel.py`` before its spmd_types rewrite), so that
``_titan_fsdp.apply_fsdp_to_decoder`` finds what torchtitan's finds:
``model.tok_embeddings``, ``model.layers`` (a ``ModuleDict``; MoE blocks have
``moe_enabled`` and ``moe.routed_experts.inner_experts`` with ``num_experts``),
``model.norm``, ``model.lm_head``.

- Router: a gate ``Linear(dim, E)``, softmax in fp32, top-k experts per token
  (torchtitan's ``TokenChoiceTopKRouter`` with ``score_func="softmax"``).
- Grouped experts: one parameter per weight for all experts, ``w1``/``w3`` of shape
  (E, dim, hidden) and ``w2`` (E, hidden, dim); each local expert runs on its
  contiguous run of tokens (a loop over local experts where torchtitan calls
  ``torch._grouped_mm``, which is CUDA-only).
- Token dispatch: tokens sorted by expert (``argsort``, stable); with EP > 1 the
  per-expert counts go through ``all_to_all_single`` and the tokens through the
  autograd-aware ``all_to_all_single_autograd``, so the backward sends the gradients
  back; the received tokens are permuted from rank-major to expert-major order and
  back (torchtitan's ``_permute``/``_unpermute``). Combine: the reverse all-to-all,
  the routing scores, then a scatter-add into the tokens (torchtitan's
  ``deterministic_scatter_add`` is ``index_add`` here: one thread, a fixed order).
- A shared expert (a SwiGLU feed-forward) on every token.
- ``apply_expert_parallel``: torchtitan's ``ExpertParallel._partition_fn``: each
  expert weight becomes ``nn.Parameter(distribute_tensor(w, ep_mesh, [Shard(0)]))`` and
  the dispatcher gets the EP mesh; ``GroupedExperts.forward`` computes on
  ``to_local()``, as torchtitan's does.

Simplified from torchtitan (none of it reaches FSDP): no load-balancing bias or token
counters, no node-limited routing, no TP/SP, plain causal attention (SDPA) without
RoPE, fp32 routing without autocast (CPU autocast has no fp32 mode).
"""

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from dtensor_fsdp.models.llama import FeedForward  # SwiGLU: the shared and dense MLPs


@dataclass(frozen=True)
class MoEConfig:
    vocab_size: int = 64
    dim: int = 16
    hidden_dim: int = 32  # experts' and feed-forwards' hidden size
    n_heads: int = 2
    n_layers: int = 3
    dense_layers: int = 1  # the first blocks are dense (DeepSeek-V3's layout)
    num_experts: int = 4
    top_k: int = 2


class GroupedExperts(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.num_experts = config.num_experts
        e, d, h = config.num_experts, config.dim, config.hidden_dim
        self.w1 = nn.Parameter(torch.randn(e, d, h) * d**-0.5)
        self.w2 = nn.Parameter(torch.randn(e, h, d) * h**-0.5)
        self.w3 = nn.Parameter(torch.randn(e, d, h) * d**-0.5)

    def forward(self, x: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """``x``: (R, dim), the tokens of the local experts in expert order;
        ``tokens_per_expert``: R split over the local experts."""
        # Under EP the weights are DTensors sharded over the experts: compute on this
        # rank's experts, as torchtitan does (token counts vary, DTensor cannot say so).
        w1, w2, w3 = (
            w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3)
        )
        outs = [
            (F.silu(x_e @ w1[e]) * (x_e @ w3[e])) @ w2[e]  # (R_e, dim)
            for e, x_e in enumerate(x.split(tokens_per_expert))
        ]
        return torch.cat(outs)  # (R, dim)


class TokenDispatcher:
    """Sorts tokens by expert and, under EP, sends them to the ranks of their experts.
    Not a module: no parameters (as torchtitan's)."""

    def __init__(self, num_experts: int, top_k: int) -> None:
        self.num_experts = num_experts
        self.top_k = top_k
        self.ep_mesh: DeviceMesh | None = None  # set by apply_expert_parallel

    def dispatch(
        self, x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor
    ) -> tuple[torch.Tensor, list[int], dict]:
        """``x`` (T, dim), ``scores``/``expert_ids`` (T, K) -> the local experts' tokens
        (R, dim) in expert order, their split per local expert, and what combine needs."""
        order = torch.argsort(expert_ids.view(-1), stable=True)  # (N = T * K,)
        meta = {"token_ids": order // self.top_k, "scores": scores.view(-1)[order]}
        routed = x[meta["token_ids"]]  # (N, dim), expert-major
        counts = torch.bincount(expert_ids.view(-1), minlength=self.num_experts)  # (E,)
        if self.ep_mesh is None:
            return routed, counts.tolist(), meta
        ep = self.ep_mesh.size()
        with torch.no_grad():
            # (ep * E_local,): from each EP rank, its tokens for each of my experts.
            received = funcol.all_to_all_single(counts, None, None, group=self.ep_mesh)
            received = funcol.wait_tensor(received)
        meta["input_splits"] = counts.view(ep, -1).sum(1).tolist()
        meta["output_splits"] = received.view(ep, -1).sum(1).tolist()
        routed = funcol.all_to_all_single_autograd(
            routed, meta["output_splits"], meta["input_splits"], self.ep_mesh
        )  # (R, dim), rank-major: (rank 0: e0, e1, ...), (rank 1: e0, e1, ...)
        # Rank-major to expert-major: torchtitan's _permute.
        per_rank = received.view(ep, -1)  # (ep, E_local)
        starts = (received.cumsum(0) - received).view(ep, -1)
        perm = torch.cat(
            [
                torch.arange(int(starts[r, e]), int(starts[r, e] + per_rank[r, e]))
                for e in range(per_rank.shape[1])
                for r in range(ep)
            ]
        ).long()
        meta["perm"] = perm
        # Indexing an AsyncCollectiveTensor waits for it.
        return routed[perm], per_rank.sum(0).tolist(), meta

    def combine(self, out: torch.Tensor, meta: dict, x: torch.Tensor) -> torch.Tensor:
        """Expert outputs (R, dim) back to the tokens: (T, dim)."""
        if self.ep_mesh is not None:
            out = out[torch.argsort(meta["perm"])]  # back to rank-major: _unpermute
            out = funcol.all_to_all_single_autograd(
                out, meta["input_splits"], meta["output_splits"], self.ep_mesh
            )  # (N, dim), expert-major as dispatched; the first use below waits for it
        out = (out.float() * meta["scores"].unsqueeze(1)).to(out.dtype)
        return torch.zeros_like(x).index_add(0, meta["token_ids"], out)


class RoutedExperts(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.inner_experts = GroupedExperts(config)
        self.token_dispatcher = TokenDispatcher(config.num_experts, config.top_k)

    def forward(
        self, x: torch.Tensor, scores: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        routed, tokens_per_expert, meta = self.token_dispatcher.dispatch(x, scores, expert_ids)
        return self.token_dispatcher.combine(self.inner_experts(routed, tokens_per_expert), meta, x)


class Router(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.dim, config.num_experts, bias=False)
        self.top_k = config.top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(x).float(), dim=-1)  # (T, E), fp32 as torchtitan's
        top_scores, expert_ids = scores.topk(self.top_k, dim=-1)  # (T, K)
        return top_scores, expert_ids


class MoE(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.router = Router(config)
        self.routed_experts = RoutedExperts(config)
        self.shared_experts = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # (T = B * S, dim)
        scores, expert_ids = self.router(tokens)
        out = self.routed_experts(tokens, scores, expert_ids) + self.shared_experts(tokens)
        return out.view_as(x)


class Attention(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (
            self.wqkv(x).view(b, s, 3, self.n_heads, -1).transpose(1, 3).unbind(2)
        )  # (B, H, S, d/H)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, S, d/H)
        return self.wo(out.transpose(1, 2).reshape(b, s, d))


class Block(nn.Module):
    def __init__(self, config: MoEConfig, moe_enabled: bool) -> None:
        super().__init__()
        self.moe_enabled = moe_enabled
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim)
        if moe_enabled:
            self.moe = MoE(config)
        else:
            self.feed_forward = FeedForward(config.dim, config.hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        mlp = self.moe if self.moe_enabled else self.feed_forward
        return h + mlp(self.ffn_norm(h))


class Decoder(nn.Module):
    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.enable_weight_tying = False
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleDict(
            {
                str(i): Block(config, moe_enabled=i >= config.dense_layers)
                for i in range(config.n_layers)
            }
        )
        self.norm = nn.RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, S, dim)
        for block in self.layers.values():
            h = block(h)
        return self.lm_head(self.norm(h))  # (B, S, vocab)


def build(config: MoEConfig, seed: int) -> Decoder:
    torch.manual_seed(seed)
    return Decoder(config)


def apply_expert_parallel(model: Decoder, ep_mesh: DeviceMesh) -> None:
    """torchtitan's ``ExpertParallel``: expert weights ``Shard(0)`` over ``ep_mesh``
    (every rank holds the same full values, so the scatter changes nothing), and the
    dispatcher sends tokens over it."""
    for block in model.layers.values():
        if not block.moe_enabled:
            continue
        routed = block.moe.routed_experts
        experts = routed.inner_experts
        for name, param in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(
                name, nn.Parameter(distribute_tensor(param.detach(), ep_mesh, [Shard(0)]))
            )
        routed.token_dispatcher.ep_mesh = ep_mesh


def loss_sum(model: nn.Module, tokens: torch.Tensor, global_tokens: int) -> torch.Tensor:
    """This rank's share of the global mean cross-entropy: its sum over its tokens
    divided by the global token count. FSDP sums the gradients over ranks
    (torchtitan's ``disable_fsdp_gradient_division``), so they come out as the global
    mean's, experts included (whose gradients meet over fewer ranks)."""
    logits = model(tokens[:, :-1])  # (B, S, vocab)
    targets = tokens[:, 1:]
    return (
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
        / global_tokens
    )
