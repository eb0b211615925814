"""A GPT-2-style decoder: token and learned position embeddings, pre-norm blocks, a language-model head.

Sizes come from `ModelConfig`; the same code builds a tiny model for a laptop and a model of
billions of parameters. Its parallel facts live here too: `GPT.blocks` (the unit that is sharded,
checkpointed and compiled) and `GPT.tensor_parallel_plan` (how one block is split).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ....base import init_parameters
from ...config import ModelConfig
from ..context import attend, split_attention
from ..documents import example_attention
from ..kv_cache import KVCache, cached_attention


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (fused scaled-dot-product attention)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        # Separate q/k/v projections so tensor parallel can split them by heads column-wise.
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, time, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q, k, v = (layer(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        if cache is None:
            dropout = self.dropout if self.training else 0.0
            # `mask`: packed examples (documents.py), a block-diagonal causal mask; else the plain causal one. Under
            # context parallel over the whole sequences' keys and values (context.py).
            y = attend(q, k, v, mask, dropout_p=dropout)
        else:
            y = cached_attention(q, k, v, cache)
        return self.proj(y.transpose(1, 2).reshape(batch, time, -1))


class MLP(nn.Module):
    """Two linear layers with a GELU between."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.n_embd
        self.fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """One pre-norm transformer block: the unit that FSDP shards and checkpointing recomputes."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.norm_mlp = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x), cache, mask)
        return x + self.mlp(self.norm_mlp(x))


class GPT(nn.Module):
    """Decoder-only transformer language model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.position_embedding = nn.Embedding(config.block_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        init_parameters(self)

    @staticmethod
    def tensor_parallel_plan() -> dict[str, ParallelStyle]:
        """The tensor-parallel plan of one block: q/k/v and fc split by columns (heads, hidden units),
        both output projections by rows, so each block needs one all-reduce in attention and one in the MLP."""
        return {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.proj": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(),
            "mlp.proj": RowwiseParallel(),
        }

    @staticmethod
    def pipeline_ends() -> tuple[list[str], list[str]]:
        """The modules before the blocks (a pipeline's first stage holds them) and after them (its last stage)."""
        return ["token_embedding", "position_embedding", "dropout"], ["norm", "lm_head"]

    def init_parameter(self, name: str, param: torch.Tensor) -> None:
        """GPT-2 initialisation of one parameter (`init_parameters` applies it to all, in order)."""
        if param.dim() < 2:
            nn.init.zeros_(param) if name.endswith("bias") else nn.init.ones_(param)
        elif name.endswith("proj.weight"):
            nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        else:
            nn.init.normal_(param, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, documents: torch.Tensor | None = None, caches: list[KVCache] | None = None
    ) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for token ids of shape (batch, time).

        `caches` (generation): one per block (kv_cache.new_caches); `idx` are then the tokens after those cached.
        `documents` (packed examples): each position's example id, (batch, time); attention stays inside an example.
        """
        start = caches[0].length if caches else 0
        time = idx.shape[1]
        if start + time > self.config.block_size:
            raise ValueError(f"sequence of {start + time} tokens exceeds block_size={self.config.block_size}")
        x, mask = idx, None  # a later pipeline stage (no embeddings) is handed the previous stage's hidden states
        if caches is None and (split := split_attention(time, documents, idx.device)) is not None:
            mask, positions = split  # this rank's part of every sequence (context parallel), at its global positions
        elif documents is None:
            positions = torch.arange(start, start + time, device=idx.device)
        else:
            mask, positions = example_attention(documents)
        if self.token_embedding is not None:
            x = self.dropout(self.token_embedding(idx) + self.position_embedding(positions))
        for index, block in enumerate(self.blocks):
            x = block(x, None, mask) if caches is None else block(x, caches[index])
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x
