"""A Llama-style decoder: rotary positions (RoPE), RMSNorm, a SwiGLU MLP, grouped-query attention, no biases.

The layout and the rotary convention (rotate-half, as in Hugging Face's LlamaForCausalLM) are those of
the released Llama checkpoints, so their weights map one to one (hf.py). Its parallel facts live here
as for the GPT: `Llama.blocks` and `Llama.tensor_parallel_plan`.
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
from .moe import MoE, StepRecords


def rotary_tables(config: ModelConfig, time: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotary angles, (time, head_dim), in float32."""
    head_dim = config.n_embd // config.n_head
    inverse_frequency = 1.0 / (
        config.rope_theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    )
    angles = torch.outer(torch.arange(time, device=device, dtype=torch.float32), inverse_frequency)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, time, head_dim) by the angles; the two halves of head_dim are the pairs."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat((-second, first), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class Attention(nn.Module):
    """Causal self-attention where groups of query heads share one key/value head (grouped-query attention)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        kv_width = config.kv_heads * self.head_dim
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.k = nn.Linear(config.n_embd, kv_width, bias=False)
        self.v = nn.Linear(config.n_embd, kv_width, bias=False)
        self.o = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, time, _ = x.shape
        # -1 heads: under tensor parallel each rank holds its share of the query and of the key/value heads
        # (the same ratio), so the grouping of query heads onto key/value heads stays local.
        q, k, v = (layer(x).view(batch, time, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        grouped = k.shape[1] != q.shape[1]
        if cache is None:
            # `mask`: packed examples (documents.py) or a part of the sequence (context.py); else the plain causal one.
            y = attend(q, k, v, mask, enable_gqa=grouped)  # over the whole sequences' keys under context parallel
        else:
            y = cached_attention(q, k, v, cache, enable_gqa=grouped)
        return self.o(y.transpose(1, 2).reshape(batch, time, -1))


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def mlp(config: ModelConfig) -> nn.Module:
    """The block's MLP: a SwiGLU, or a mixture of experts (model.moe) whose shared experts are one SwiGLU as wide as
    all of them (the sum of several SwiGLUs is one over their concatenated hidden units)."""
    moe = config.moe
    if not moe.num_experts:
        return SwiGLU(config.n_embd, config.mlp_hidden_size)
    shared = SwiGLU(config.n_embd, moe.shared_experts * config.expert_hidden_size) if moe.shared_experts else None
    return MoE(config, shared)


class Block(nn.Module):
    """One pre-norm Llama block: the unit that FSDP shards and checkpointing recomputes."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm_attn = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = Attention(config)
        self.norm_mlp = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = mlp(config)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x), cos, sin, cache, mask)
        return x + self.mlp(self.norm_mlp(x))


class Llama(nn.Module):
    """Decoder-only Llama-style language model."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.RMSNorm(config.n_embd, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        init_parameters(self)
        self.step_records: StepRecords | None = None  # of the MoE layers, found at the first training forward

    def tensor_parallel_plan(self) -> dict[str, ParallelStyle]:
        """The tensor-parallel plan of one block: q, k, v split by heads (each rank keeps n_head / tp query heads
        and n_kv_head / tp key/value heads, so every query head finds its key/value head locally), gate and up by
        hidden units, o and down by rows: one all-reduce in attention and one in the MLP per block. A mixture of
        experts' shared experts split as the MLP; its router and routed experts are not split: the ranks share out
        its tokens instead (token_split.py, arranged by the strategy through each MoE layer's `parallelize_over_tensor`)."""
        plan: dict[str, ParallelStyle] = {
            "attn.q": ColwiseParallel(),
            "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(),
        }
        moe = self.config.moe
        if moe.num_experts and not moe.shared_experts:
            return plan
        mlp = "mlp.shared" if moe.num_experts else "mlp"
        split_mlp = {f"{mlp}.gate": ColwiseParallel(), f"{mlp}.up": ColwiseParallel(), f"{mlp}.down": RowwiseParallel()}
        return plan | split_mlp

    @staticmethod
    def pipeline_ends() -> tuple[list[str], list[str]]:
        """The modules before the blocks (a pipeline's first stage holds them) and after them (its last stage)."""
        return ["token_embedding"], ["norm", "lm_head"]

    def init_parameter(self, name: str, param: torch.Tensor) -> None:
        """Normal(0, 0.02) matrices, residual projections scaled down by the depth, norms at one: one parameter
        (`init_parameters` applies it to all, in order; a tied head is the embedding, named and drawn once)."""
        if param.dim() < 2:
            nn.init.ones_(param)
        elif name.endswith(("attn.o.weight", "mlp.down.weight", "mlp.experts.down", "mlp.shared.down.weight")):
            nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))
        else:
            nn.init.normal_(param, mean=0.0, std=0.02)

    def init_buffers(self) -> None:
        """The routers' biases at zero (buffers that are state: after a meta-device build they hold garbage)."""
        for module in self.modules():
            if isinstance(module, MoE):
                module.reset_expert_bias()

    def auxiliary_loss(self) -> torch.Tensor | None:
        """The auxiliary loss of the training forward just run: moe.aux_loss_weight x the MoE layers' mean balance
        loss under load_balance=aux_loss, else None (a pipeline stage: its layers' share of that mean). It also adds
        that forward's figures to the step's: the machinery calls it once after each training forward
        (tasks/base.py; under a pipeline, after each stage's forward of a piece: strategies/pipeline.py)."""
        if not self.config.moe.num_experts:
            return None
        if self.step_records is None:  # the MoE layers by block index (`blocks.5.mlp`, wrapped or not)
            layers = {int(name.split(".")[1]): m for name, m in self.named_modules() if isinstance(m, MoE)}
            self.step_records = StepRecords(layers, self.config.n_layer)
        balance = self.step_records.add_forward()
        moe = self.config.moe
        return moe.aux_loss_weight * balance if moe.load_balance == "aux_loss" else None

    def step_statistics(self) -> torch.Tensor | None:
        """What the step's training forwards recorded, one float tensor for the machinery to sum over the ranks
        (None for a dense model); cleared for the next step."""
        return self.step_records.take() if self.step_records is not None else None

    def end_step(self, summed: torch.Tensor, updated: bool) -> dict[str, torch.Tensor]:
        """After the optimizer step, from `step_statistics` summed over the ranks: the routers' bias update
        (load_balance=bias; only when the step's update was applied) and the figures logged (moe/...)."""
        assert self.step_records is not None  # summed comes from step_statistics
        return self.step_records.end_step(summed, update_bias=updated)

    def forward(
        self, idx: torch.Tensor, documents: torch.Tensor | None = None, caches: list[KVCache] | None = None
    ) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for token ids of shape (batch, time).

        `caches` (generation): one per block (kv_cache.new_caches); `idx` are then the tokens after those cached.
        `documents` (packed examples): each position's example id, (batch, time); attention stays inside an example
        and the rotary positions restart at each example.
        """
        start = caches[0].length if caches else 0
        time = idx.shape[1]
        if start + time > self.config.block_size:
            raise ValueError(f"sequence of {start + time} tokens exceeds block_size={self.config.block_size}")
        cos, sin = rotary_tables(self.config, start + time, idx.device)
        cos, sin = cos[start:], sin[start:]
        mask, positions = None, None
        split = split_attention(time, documents, idx.device) if caches is None else None
        if split is not None:  # this rank's part of every sequence (context parallel), at its global positions
            (mask, positions), (cos, sin) = split, rotary_tables(self.config, self.config.block_size, idx.device)
        elif documents is not None:
            mask, positions = example_attention(documents)
        if positions is not None:
            cos, sin = cos[positions], sin[positions]
            if positions.dim() == 2:  # per packed example: (batch, 1, time, head_dim)
                cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        # A later pipeline stage (no embedding) is handed the previous stage's hidden states.
        x = self.token_embedding(idx) if self.token_embedding is not None else idx
        for index, block in enumerate(self.blocks):
            x = block(x, cos, sin, None, mask) if caches is None else block(x, cos, sin, caches[index])
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x
