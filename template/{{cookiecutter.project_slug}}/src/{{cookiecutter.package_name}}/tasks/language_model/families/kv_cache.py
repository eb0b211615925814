"""The keys and values of the tokens a model has seen, kept per block for generation (`sample`).

Training never passes a cache: each block's attention then runs exactly as it always has. With a cache,
a forward pass takes only the new tokens, appends their keys and values, and attends over everything kept.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


class KVCache:
    """One block's keys and values, (batch, heads, time, head_dim), in a buffer of `capacity` positions."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.length = 0  # positions filled: where the next tokens go
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values; return all kept so far."""
        if self.keys is None or self.values is None:
            shape = (*keys.shape[:2], self.capacity, keys.shape[3])
            self.keys, self.values = keys.new_empty(shape), values.new_empty(shape)
        end = self.length + keys.shape[2]
        if end > self.capacity:
            raise ValueError(f"{end} positions exceed the cache's {self.capacity}")
        self.keys[:, :, self.length : end] = keys
        self.values[:, :, self.length : end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def new_caches(model: Any) -> list[KVCache]:
    """An empty cache for each block of a language model (GPT, Llama), as long as its context."""
    return [KVCache(model.config.block_size) for _ in model.blocks]


def cached_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, enable_gqa: bool = False
) -> torch.Tensor:
    """Causal attention of the new tokens' queries over the cached and the new keys and values."""
    start = cache.length
    keys, values = cache.extend(k, v)
    if start == 0:  # the first tokens: the ordinary causal mask
        return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=enable_gqa)
    # The new token at position start + i sees positions 0 .. start + i (is_causal would align the mask top-left).
    visible = torch.ones(q.shape[2], keys.shape[2], dtype=torch.bool, device=q.device).tril(diagonal=start)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=enable_gqa)
