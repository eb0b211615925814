"""A Vision Transformer (ViT, Dosovitskiy et al. 2020): patches as tokens, a class token, pre-norm blocks, a linear head.

Sizes come from `ViTConfig`. The layers are those of Hugging Face's ViTForImageClassification (biases everywhere,
exact GELU), so an export (hf.py) gives the same logits. Its parallel facts live here, as the GPT's do:
`ViT.blocks` (the unit that is sharded, checkpointed and compiled) and `ViT.tensor_parallel_plan` (how a block is split).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from ..base import init_parameters
from .config import ViTConfig


class SelfAttention(nn.Module):
    """Multi-head self-attention over all tokens (no mask: every patch sees every other)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.head_dim = config.n_embd // config.n_head
        # Separate q/k/v projections so tensor parallel can split them by heads column-wise.
        self.q = nn.Linear(config.n_embd, config.n_embd)
        self.k = nn.Linear(config.n_embd, config.n_embd)
        self.v = nn.Linear(config.n_embd, config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, _ = x.shape
        # -1 heads: under tensor parallel each rank holds only its share of the heads.
        q, k, v = (
            layer(x).view(batch, tokens, -1, self.head_dim).transpose(1, 2) for layer in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, -1))


class MLP(nn.Module):
    """Two linear layers with an exact GELU between (Hugging Face's "gelu", not GPT-2's tanh approximation)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.mlp_hidden_size)
        self.proj = nn.Linear(config.mlp_hidden_size, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One pre-norm transformer block: the unit that FSDP shards and checkpointing recomputes."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.attn = SelfAttention(config)
        self.norm_mlp = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_attn(x))
        return x + self.mlp(self.norm_mlp(x))


class Embedding(nn.Module):
    """Patches -> tokens: a convolution with stride = kernel = patch size (one linear projection of each patch's
    pixels), a learned class token in front, learned positions added.

    Its own module, so that the model has no parameters outside submodules: DeepSpeed's ZeRO-3 `zero.Init`
    partitions a module's parameters when its constructor returns, and a parameter of the model itself would
    still be whole (and drawn from the random stream) when the model's constructor initialises it.
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.projection = nn.Conv2d(
            config.channels, config.n_embd, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.class_token = nn.Parameter(torch.empty(1, 1, config.n_embd))
        self.positions = nn.Parameter(torch.empty(1, config.sequence_length, config.n_embd))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        patches = self.projection(images).flatten(2).transpose(1, 2)  # (batch, patches, n_embd), row by row
        class_token = self.class_token.expand(images.shape[0], -1, -1)
        return torch.cat((class_token, patches), dim=1) + self.positions


class ViT(nn.Module):
    """Vision Transformer image classifier: images (batch, channels, height, width) -> logits (batch, classes)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = Embedding(config)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.norm = nn.LayerNorm(config.n_embd, eps=config.norm_eps)
        self.head = nn.Linear(config.n_embd, config.num_classes)
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

    def init_parameter(self, name: str, param: torch.Tensor) -> None:
        """The initialisation of one parameter (`init_parameters` applies it to all, in order).

        A plain normal rather than Hugging Face's truncated one: truncation at +-2 is 100 standard deviations
        away, so they draw alike, and `normal_` also fills sharded (DTensor) parameters.
        """
        if param.dim() < 2:
            nn.init.zeros_(param) if name.endswith("bias") else nn.init.ones_(param)
        else:
            nn.init.normal_(param, mean=0.0, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, num_classes) for images of shape (batch, channels, image_size, image_size)."""
        c = self.config
        expected = (c.channels, c.image_size, c.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != expected:
            raise ValueError(
                f"images of shape {tuple(images.shape)}; the model takes (batch, {', '.join(map(str, expected))})"
            )
        x = self.dropout(self.embedding(images))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x[:, 0]))
