"""Resumable micro-batches: the training order is a pure function of (seed, samples seen).

Global sample g is sample perm_e[g mod N] of epoch e = g div N, for N samples. A checkpoint stores
one integer, and a resumed run continues the exact same sequence, across epoch boundaries and also
with a different number of processes, as long as the global batch stays the same. The samples are
any `Samples` of a task (samples.py): `len()` and `batch(indices)`. Samples that augment (random
crops, flips) also define `augmented_batch(indices, draws)`: the sampler passes each sample's global
position g as its draw, so the augmentation is seeded by it and is as exactly resumable as the order.

Samples that live in shards read from a bounded cache (prepared token shards) define `block_shuffle`
(a `BlockShuffle`) and the order is a shard-block shuffle instead, so that a stretch of training reads a
few shards rather than all of them. Their samples are cut into blocks of consecutive samples (about one
shard each); every epoch permutes the blocks, then permutes the samples of each group of G consecutive
blocks of that order among themselves. Epoch e, group k is drawn from (seed, e) and (seed, e, k) alone,
so the order is still a pure function of (seed, samples seen), the same for any number of processes.
Such samples may also define `will_read(blocks)`: the sampler calls it with the blocks of the current
group and the next one, in the order they will be read (a cache fetches ahead and keeps them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import RecipeError
from .samples import Samples

Batch = Any  # what a task's `Samples.batch` returns: a tensor, or a tuple/dict of tensors


@dataclass(frozen=True)
class BlockShuffle:
    """The shard-block shuffle of some samples: where each block starts, and how many blocks are shuffled together."""

    block_starts: np.ndarray  # first sample of each block, ascending, block_starts[0] == 0
    blocks_per_group: int  # G: the samples of G consecutive blocks (in an epoch's block order) are permuted together


class _BlockOrder:
    """The order of one epoch under a `BlockShuffle`: O(blocks) memory, one group's permutation at a time."""

    def __init__(self, shuffle: BlockShuffle, num_samples: int, seed: int, epoch: int) -> None:
        starts = np.asarray(shuffle.block_starts, dtype=np.int64)
        self.starts, self.ends = starts, np.append(starts[1:], num_samples)
        self.seed, self.epoch, self.group_size = seed, epoch, shuffle.blocks_per_group
        self.blocks = np.random.default_rng([seed, epoch]).permutation(len(starts))
        sizes = (self.ends - self.starts)[self.blocks]
        group_sizes = np.add.reduceat(sizes, np.arange(0, len(sizes), self.group_size))
        self.group_ends = np.cumsum(group_sizes)  # the epoch's position just after each group
        self._group: tuple[int, np.ndarray] | None = None

    def group_of(self, position: int) -> int:
        """The group that holds the epoch's `position`."""
        return int(np.searchsorted(self.group_ends, position, side="right"))

    def group_blocks(self, group: int) -> list[int]:
        """The blocks of `group`, in the epoch's block order."""
        return [int(block) for block in self.blocks[group * self.group_size : (group + 1) * self.group_size]]

    def sample(self, position: int) -> int:
        """The sample at the epoch's `position`."""
        group = self.group_of(position)
        if self._group is None or self._group[0] != group:
            members = np.concatenate([np.arange(self.starts[b], self.ends[b]) for b in self.group_blocks(group)])
            self._group = (group, np.random.default_rng([self.seed, self.epoch, group]).permutation(members))
        first = int(self.group_ends[group - 1]) if group else 0
        return int(self._group[1][position - first])


class TrainBatches:
    """Resumable stream of training micro-batches for one data-parallel rank.

    Its state is the number of samples the whole job has consumed; save it with the checkpoint.
    """

    def __init__(
        self,
        samples: Samples,
        micro_batch_size: int,
        grad_accum_steps: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
    ) -> None:
        self.samples = samples
        self.micro_batch_size = micro_batch_size
        self.grad_accum_steps = grad_accum_steps
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.seed = seed
        self.num_samples = len(samples)
        self.samples_seen = 0
        self._order: tuple[int, np.ndarray] | None = None
        self.shuffle: BlockShuffle | None = getattr(samples, "block_shuffle", None)
        self._blocks: dict[int, _BlockOrder] = {}  # epoch -> its block order (this epoch's and the next)
        self._told: tuple[int, int] | None = None  # (epoch, group) the samples last heard about in will_read

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.dp_size

    @property
    def epoch(self) -> int:
        """Passes over the training data completed so far."""
        return self.samples_seen // self.num_samples

    def _block_order(self, epoch: int) -> _BlockOrder:
        if epoch not in self._blocks:
            assert self.shuffle is not None
            self._blocks = {e: order for e, order in self._blocks.items() if e >= epoch - 1}
            self._blocks[epoch] = _BlockOrder(self.shuffle, self.num_samples, self.seed, epoch)
        return self._blocks[epoch]

    def _sample_of(self, position_in_stream: int) -> int:
        epoch, position = divmod(position_in_stream, self.num_samples)
        if self.shuffle is not None:
            return self._block_order(epoch).sample(position)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return int(self._order[1][position])

    def next_step(self) -> list[Batch]:
        """This rank's micro-batches for the next optimizer step; advances the stream by one global batch."""
        return list(self.iter_step())

    def iter_step(self) -> Iterator[Batch]:
        """`next_step`, one micro-batch at a time, read when asked for (so a data-wait timer around it sees the reads)."""
        step_start = self.samples_seen
        self._tell_what_comes(step_start)
        self.samples_seen += self.global_batch_size  # the position a checkpoint after this step resumes from
        for micro_step in range(self.grad_accum_steps):
            first = step_start + (micro_step * self.dp_size + self.dp_rank) * self.micro_batch_size
            draws = range(first, first + self.micro_batch_size)
            indices = [self._sample_of(g) for g in draws]
            augmented = getattr(self.samples, "augmented_batch", None)
            yield self.samples.batch(indices) if augmented is None else augmented(indices, list(draws))

    def upcoming_blocks(self, position_in_stream: int) -> list[int]:
        """The blocks of the group holding `position_in_stream` and of the group after it (maybe the next epoch's)."""
        epoch, position = divmod(position_in_stream, self.num_samples)
        order = self._block_order(epoch)
        group = order.group_of(position)
        blocks = order.group_blocks(group)
        if group + 1 < len(order.group_ends):
            return blocks + order.group_blocks(group + 1)
        return blocks + self._block_order(epoch + 1).group_blocks(0)

    def _tell_what_comes(self, step_start: int) -> None:
        """Tell samples that read through a cache which blocks this step's group and the next one read.

        The stream is global, so every rank tells the same blocks at the same steps (ranks of a node share a cache).
        """
        will_read = getattr(self.samples, "will_read", None)
        if self.shuffle is None or will_read is None:
            return
        last = step_start + self.global_batch_size - 1  # a step may cross into the next group: tell from its end
        epoch, position = divmod(last, self.num_samples)
        where = (epoch, self._block_order(epoch).group_of(position))
        if where != self._told:
            self._told = where
            first_epoch, first_position = divmod(step_start, self.num_samples)
            first = self._block_order(first_epoch).group_blocks(self._block_order(first_epoch).group_of(first_position))
            will_read(list(dict.fromkeys(first + self.upcoming_blocks(last))))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the exact sequence."""
        state = {"samples_seen": self.samples_seen, "seed": self.seed, "num_samples": self.num_samples}
        if self.shuffle is not None:
            state["blocks_per_group"] = self.shuffle.blocks_per_group
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a checkpoint made on different data."""
        if int(state["num_samples"]) != self.num_samples:
            raise RecipeError(
                f"checkpoint was made on data with {state['num_samples']} training samples, this recipe's data"
                f" has {self.num_samples}: resume with the same data and the same model and data settings"
            )
        saved_group = state.get("blocks_per_group")
        if self.shuffle is not None and saved_group is not None and saved_group != self.shuffle.blocks_per_group:
            raise RecipeError(
                f"checkpoint was made with {saved_group} blocks of samples shuffled together, this recipe's data"
                f" shuffles {self.shuffle.blocks_per_group}: the order would differ (resume with the same data settings)"
            )
        self.samples_seen = int(state["samples_seen"])
        self.seed = int(state["seed"])


def validation_batches(
    samples: Samples, micro_batch_size: int, num_batches: int, dp_rank: int, dp_size: int
) -> list[Batch]:
    """A fixed set of validation micro-batches for this rank (the ranks' sets are disjoint when the data allows)."""
    batches = []
    for batch in range(num_batches):
        first = (batch * dp_size + dp_rank) * micro_batch_size
        batches.append(samples.batch([g % len(samples) for g in range(first, first + micro_batch_size)]))
    return batches
