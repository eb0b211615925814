"""The models' side of context parallel (strategies/context_parallel.py): when each rank holds only part of every
sequence, the positions of its own tokens, the mask from them to the keys and values gathered from the group, and
the attention over those.

The mask is causal over global positions (and block-diagonal over packed examples, whose ids are gathered too), so
each token attends to exactly the keys it would attend to in the whole sequence: the logits, and the per-token
losses, are those of the unsplit sequence. It is boolean, made once for every layer.

`attend` gathers the keys and values and runs SDPA under activation checkpointing of its own: backward gathers them
again and recomputes the attention. A layer then holds for backward only its own part's queries, keys and values
and the one boolean mask, not the whole sequence's keys and values nor the float mask SDPA makes of a boolean one
in every layer (on CPU and CUDA alike), which would undo much of the activation memory context parallel saves. A
block that is checkpointed already (its saved tensors handled by hooks) attends plainly: its recomputation holds the
gathered keys one layer at a time anyway.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ....strategies.context_parallel import active
from .documents import example_mask, example_positions


def split_attention(
    time: int, documents: torch.Tensor | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mask, positions) of this rank's `time` tokens when the sequences are split over context-parallel ranks, else
    None. The mask lets a query (a token here) attend to a key (a gathered token, in `gathered_keys`' order) where it
    is True: (time, time x cp), or (batch, 1, time, time x cp) with packed examples; positions are the tokens' global
    positions (time,), or with packed examples their positions within their example (batch, time)."""
    shard = active()
    if shard is None:
        return None
    own, keys = shard.positions(time, device), shard.gathered_positions(time, device)
    if documents is None:
        return own[:, None] >= keys[None, :], own
    gathered = shard.gather(documents, dim=1)  # every example id, in `keys`' order
    whole = gathered[:, torch.argsort(keys)]  # and in sequence order
    return example_mask(whole[:, own], gathered, own, keys), example_positions(whole)[:, own]


def gathered_keys(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values, (batch, heads, time, head_dim), of the whole sequences under context parallel (every rank's
    part, in rank order: the columns of `split_attention`'s mask); as they are otherwise."""
    shard = active()
    if shard is None:
        return key, value
    return shard.gather(key, dim=2), shard.gather(value, dim=2)


def attend(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, **options: Any
) -> torch.Tensor:
    """SDPA of `query` over `key` and `value` (`mask`: where a query may attend; None: causal), with SDPA's other
    `options`; under context parallel over the keys and values of the whole sequences, recomputed in backward."""
    if active() is None:
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=mask is None, **options)

    def over_gathered(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any) -> torch.Tensor:
        key, value = gathered_keys(key, value)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, **options)

    # Saved-tensor hooks are set while a checkpointed block runs (and while it is recomputed): nothing to add there.
    if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
        return over_gathered(query, key, value, mask)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(over_gathered, query, key, value, mask, use_reentrant=False)
