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
    time = documents.shape[1]
    same_example = documents[:, :, None] == documents[:, None, :]
    causal = torch.ones(time, time, dtype=torch.bool, device=documents.device).tril()
    index = torch.arange(time, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    first = torch.where(starts, index, 0).cummax(dim=1).values  # where each position's example starts
    return (same_example & causal)[:, None], index - first
