"""Packed sequences: several examples in one row, each attending only to itself, its positions counted from 0.

A packed row comes with each position's example id (data/sft.py): consecutive runs of one id, the
padding a run of its own. The attention mask is block-diagonal and causal, so the logits of an
example are those it would have alone in a row.
"""

from __future__ import annotations

import torch


def example_attention(documents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, positions) for example ids of shape (batch, time): the boolean mask, (batch, 1, time, time), is True
    where a query may attend to a key (an earlier or the same position of its own example); positions restart at
    0 where each example starts."""
    index = torch.arange(documents.shape[1], device=documents.device)
    return example_mask(documents, documents, index, index), example_positions(documents)


def example_mask(
    queries: torch.Tensor, keys: torch.Tensor, query_positions: torch.Tensor, key_positions: torch.Tensor
) -> torch.Tensor:
    """The boolean mask, (batch, 1, queries, keys), from queries to keys with example ids `queries` (batch, q) and
    `keys` (batch, k) at sequence positions `query_positions` (q,) and `key_positions` (k,): True where the key is
    of the query's example and not after it. Only these rows are made (a context-parallel rank's part of a long
    sequence never forms the whole sequence's)."""
    mask = queries[:, :, None] == keys[:, None, :]
    mask &= query_positions[:, None] >= key_positions[None, :]
    return mask[:, None]


def example_positions(documents: torch.Tensor) -> torch.Tensor:
    """Each position's offset from the start of its example, (batch, time)."""
    index = torch.arange(documents.shape[1], device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # where each position's example starts
    return index - first
