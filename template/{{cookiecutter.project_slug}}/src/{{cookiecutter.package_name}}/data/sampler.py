"""Resumable micro-batches: the training order is a pure function of (seed, samples seen).

Global sample g is window perm_e[g mod N] of epoch e = g div N. A checkpoint stores one integer, and
a resumed run continues the exact same sequence, across epoch boundaries and also with a different
number of processes, as long as the global batch stays the same. `tokens` is any 1-D array that
supports len() and contiguous slices: a numpy array, a memory map, or prepared shards seen as one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from {{ cookiecutter.package_name }}.errors import RecipeError

Batch = tuple[torch.Tensor, torch.Tensor]


def _window(tokens: np.ndarray, index: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    start = index * block_size
    chunk = np.asarray(tokens[start : start + block_size + 1], dtype=np.int64)
    return chunk[:-1], chunk[1:]


def _stack(tokens: np.ndarray, indices: list[int], block_size: int) -> Batch:
    pairs = [_window(tokens, index, block_size) for index in indices]
    inputs = torch.from_numpy(np.stack([pair[0] for pair in pairs]))
    targets = torch.from_numpy(np.stack([pair[1] for pair in pairs]))
    return inputs, targets


class TrainBatches:
    """Resumable stream of training micro-batches for one data-parallel rank.

    Its state is the number of samples the whole job has consumed; save it with the checkpoint.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        block_size: int,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        self.tokens = tokens
        self.block_size = block_size
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.num_windows = (len(tokens) - 1) // block_size
        self.samples_seen = 0
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.dp_size

    @property
    def epoch(self) -> int:
        """Passes over the training data completed so far."""
        return self.samples_seen // self.num_windows

    def _window_of(self, sample: int) -> int:
        epoch, position = divmod(sample, self.num_windows)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_windows))
        return int(self._order[1][position])

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step; advances the stream by one global batch."""
        return list(self.iter_step())

    def iter_step(self) -> Iterator[Batch]:
        """`next_step`, one micro-batch at a time, read when asked for (so a data-wait timer around it sees the reads)."""
        step_start = self.samples_seen
        self.samples_seen += self.global_batch_size  # the position a checkpoint after this step resumes from
        for micro_step in range(self.grad_accum_steps):
            first = step_start + (micro_step * self.dp_size + self.dp_rank) * self.micro_batch_size
            indices = [self._window_of(sample) for sample in range(first, first + self.micro_batch_size)]
            yield _stack(self.tokens, indices, self.block_size)

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the exact sequence."""
        return {"samples_seen": self.samples_seen, "seed": self.seed, "num_windows": self.num_windows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a checkpoint made on different data."""
        if int(state["num_windows"]) != self.num_windows:
            raise RecipeError(
                f"checkpoint was made on data with {state['num_windows']} training sequences, this"
                f" recipe's data has {self.num_windows}: resume with the same data and model.block_size"
            )
        self.samples_seen = int(state["samples_seen"])
        self.seed = int(state["seed"])


def validation_batches(
    tokens: np.ndarray, block_size: int, micro_batch_size: int, num_batches: int, dp_rank: int, dp_size: int
) -> list[Batch]:
    """A fixed set of validation micro-batches for this rank (the ranks' sets are disjoint when the data allows)."""
    num_windows = (len(tokens) - 1) // block_size
    batches = []
    for batch in range(num_batches):
        first = (batch * dp_size + dp_rank) * micro_batch_size
        indices = [sample % num_windows for sample in range(first, first + micro_batch_size)]
        batches.append(_stack(tokens, indices, block_size))
    return batches
