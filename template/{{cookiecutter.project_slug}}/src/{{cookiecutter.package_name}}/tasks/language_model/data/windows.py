"""The language model's samples: windows of block_size tokens and their next-token targets, cut from a token stream.

Window i is tokens [i * block_size, (i + 1) * block_size] of the stream: a numpy array, a memory map,
or prepared shards seen as one array (anything with len() and contiguous slices).

With a document end (data.document_mask), a window also carries each position's document id: 0 up to and
including the first end-of-document token, 1 after it, and so on, so the model attends within a document
(families/documents.py), the same path as packed sft examples.

Over prepared shards the windows are read in the sampler's shard-block shuffle (data/sampler.py): a
block is the windows that start in one shard, and `blocks_per_group` blocks are shuffled together.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ....data.sampler import BlockShuffle


class TokenWindows:
    """Consecutive, non-overlapping windows of a token stream; a batch is (inputs, targets), each (batch, block_size),
    and each position's document id after them when `document_end` (the end-of-document token id) is given."""

    def __init__(
        self, tokens: Any, block_size: int, blocks_per_group: int | None = None, document_end: int | None = None
    ) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.document_end = document_end
        self.block_shuffle: BlockShuffle | None = None  # None: the sampler permutes every window of an epoch
        if blocks_per_group is not None and hasattr(tokens, "shard_starts"):
            starts = -(-tokens.shard_starts() // block_size)  # the first window that starts in each shard
            starts = np.unique(starts[starts < len(self)])
            self.block_shuffle = BlockShuffle(starts, blocks_per_group)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The inputs and targets of window `index`."""
        start = index * self.block_size
        chunk = np.asarray(self.tokens[start : start + self.block_size + 1], dtype=np.int64)
        return chunk[:-1], chunk[1:]

    def will_read(self, blocks: Sequence[int]) -> None:
        """The sampler's blocks read next: the token ranges they span go to the shards (a cache fetches them)."""
        if self.block_shuffle is None:
            return
        starts = self.block_shuffle.block_starts
        ends = [*starts[1:], len(self)]
        size = self.block_size
        self.tokens.will_read([(int(starts[b]) * size, int(ends[b]) * size + 1) for b in blocks])

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, ...]:
        pairs = [self.window(index) for index in indices]
        inputs = np.stack([pair[0] for pair in pairs])
        targets = torch.from_numpy(np.stack([pair[1] for pair in pairs]))
        if self.document_end is None:
            return torch.from_numpy(inputs), targets
        return torch.from_numpy(inputs), targets, torch.from_numpy(document_ids(inputs, self.document_end))


def document_ids(inputs: np.ndarray, end: int) -> np.ndarray:
    """Each position's document within its row of `inputs` (batch, time): the count of end tokens before it, so an
    end token belongs to the document it ends."""
    ids = np.zeros_like(inputs, dtype=np.int64)
    np.cumsum(inputs[:, :-1] == end, axis=1, out=ids[:, 1:])
    return ids
