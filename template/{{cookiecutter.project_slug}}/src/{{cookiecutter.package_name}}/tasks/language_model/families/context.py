"""The models' side of context parallel (strategies/context_parallel.py): when each rank holds only part of every
sequence, the positions of its own tokens and the mask from them to the keys and values gathered from the group.

The mask is causal over global positions (and block-diagonal over packed examples, whose ids are gathered too), so
each token attends to exactly the keys it would attend to in the whole sequence: the logits, and the per-token
losses, are those of the unsplit sequence.

On CPU the mask is additive (0 where a query may attend, -inf elsewhere), made once in the dtype the blocks compute
in: SDPA turns a boolean mask into a float one in every layer and keeps each copy for backward, (time x time x cp)
per layer, which would undo much of the activation memory context parallel saves; and fully_shard's mixed-precision
policy casts a block's floating inputs to its compute dtype, so a float32 mask under bf16-mixed would be copied at
every block, each copy kept as a checkpointed block's input (a 128K-token Llama-8B at cp=4: 8 GiB a layer). On
CUDA the mask stays boolean, as the fused kernels take it.
"""

from __future__ import annotations

import torch

from ....strategies.context_parallel import active
from .documents import example_attention


def split_attention(
    time: int, documents: torch.Tensor | None, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(mask, positions) of this rank's `time` tokens when the sequences are split over context-parallel ranks, else
    None. The mask lets a query (a token here) attend to a key (a gathered token, in `gathered_keys`' order) where it
    is True, or 0 where it is additive in `dtype` (`additive_on_cpu`): (time, time x cp), or (batch, 1, time, time x cp) with
    packed examples; positions are the tokens' global positions (time,), or with packed examples their positions
    within their example (batch, time)."""
    shard = active()
    if shard is None:
        return None
    own, keys = shard.positions(time, device), shard.gathered_positions(time, device)
    if documents is None:
        return additive_on_cpu(own[:, None] >= keys[None, :], dtype), own
    whole = shard.gather(documents, dim=1)[:, torch.argsort(keys)]  # every example id, in sequence order
    mask, positions = example_attention(whole)
    return additive_on_cpu(mask[:, :, own][:, :, :, keys], dtype), positions[:, own]


def additive_on_cpu(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask as SDPA would convert it (0 where True, -inf where False) on CPU, in `dtype`, made
    once for every layer; the boolean mask elsewhere."""
    if mask.device.type != "cpu":
        return mask
    return torch.zeros(mask.shape, device=mask.device, dtype=dtype).masked_fill_(~mask, float("-inf"))


def gathered_keys(key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values, (batch, heads, time, head_dim), of the whole sequences under context parallel (every rank's
    part, in rank order: the columns of `split_attention`'s mask); as they are otherwise."""
    shard = active()
    if shard is None:
        return key, value
    return shard.gather(key, dim=2), shard.gather(value, dim=2)
