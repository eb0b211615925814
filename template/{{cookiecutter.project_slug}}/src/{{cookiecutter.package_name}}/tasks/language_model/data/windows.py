"""The language model's samples: windows of block_size tokens and their next-token targets, cut from a token stream.

Window i is tokens [i * block_size, (i + 1) * block_size] of the stream: a numpy array, a memory map,
or prepared shards seen as one array (anything with len() and contiguous slices).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch


class TokenWindows:
    """Consecutive, non-overlapping windows of a token stream; a batch is (inputs, targets), each (batch, block_size)."""

    def __init__(self, tokens: Any, block_size: int) -> None:
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def window(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        """The inputs and targets of window `index`."""
        start = index * self.block_size
        chunk = np.asarray(self.tokens[start : start + self.block_size + 1], dtype=np.int64)
        return chunk[:-1], chunk[1:]

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.window(index) for index in indices]
        inputs = torch.from_numpy(np.stack([pair[0] for pair in pairs]))
        targets = torch.from_numpy(np.stack([pair[1] for pair in pairs]))
        return inputs, targets
