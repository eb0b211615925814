"""The models' side of context parallel (strategies/context_parallel.py): when each rank holds only part of every
sequence, the positions of its own tokens and the mask from them to the keys and values gathered from the group.

The mask is causal over global positions (and block-diagonal over packed examples, whose ids are gathered too), so
each token attends to exactly the keys it would attend to in the whole sequence: the logits, and the per-token
losses, are those of the unsplit sequence.
"""

from __future__ import annotations

import torch

from ....strategies.context_parallel import active
from .documents import example_attention


def split_attention(
    time: int, documents: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mask, positions) of this rank's `time` tokens when the sequences are split over context-parallel ranks, else
    None. The mask is True where a query (a token here) may attend to a key (a gathered token, in `gathered_keys`'
    order): (time, time x cp), or (batch, 1, time, time x cp) with packed examples; positions are the tokens' global
    positions (time,), or with packed examples their positions within their example (batch, time)."""
    shard = active()
    if shard is None:
        return None
    own, keys = shard.positions(time, device), shard.gathered_positions(time, device)
    if documents is None:
        return own[:, None] >= keys[None, :], own
    whole = shard.gather(documents, dim=1)[:, torch.argsort(keys)]  # every example id, in sequence order
    mask, positions = example_attention(whole)
    return mask[:, :, own][:, :, :, keys], positions[:, own]


def gathered_keys(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values, (batch, heads, time, head_dim), of the whole sequences under context parallel (every rank's
    part, in rank order: the columns of `split_attention`'s mask); as they are otherwise."""
    shard = active()
    if shard is None:
        return key, value
    return shard.gather(key, dim=2), shard.gather(value, dim=2)
