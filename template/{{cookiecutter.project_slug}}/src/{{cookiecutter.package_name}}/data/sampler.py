"""Resumable micro-batches: the training order is a pure function of (seed, samples seen).

Global sample g is sample perm_e[g mod N] of epoch e = g div N, for N samples. A checkpoint stores
one integer, and a resumed run continues the exact same sequence, across epoch boundaries and also
with a different number of processes, as long as the global batch stays the same. The samples are
any `Samples` of a task (tasks/base.py): `len()` and `batch(indices)`. Samples that augment (random
crops, flips) also define `augmented_batch(indices, draws)`: the sampler passes each sample's global
position g as its draw, so the augmentation is seeded by it and is as exactly resumable as the order.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.base import Samples

Batch = Any  # what a task's `Samples.batch` returns: a tensor, or a tuple/dict of tensors


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

    @property
    def global_batch_size(self) -> int:
        """Samples per optimizer step over all ranks."""
        return self.micro_batch_size * self.grad_accum_steps * self.dp_size

    @property
    def epoch(self) -> int:
        """Passes over the training data completed so far."""
        return self.samples_seen // self.num_samples

    def _sample_of(self, position_in_stream: int) -> int:
        epoch, position = divmod(position_in_stream, self.num_samples)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
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
            draws = range(first, first + self.micro_batch_size)
            indices = [self._sample_of(g) for g in draws]
            augmented = getattr(self.samples, "augmented_batch", None)
            yield self.samples.batch(indices) if augmented is None else augmented(indices, list(draws))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint needs to continue the exact sequence."""
        return {"samples_seen": self.samples_seen, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; refuses a checkpoint made on different data."""
        if int(state["num_samples"]) != self.num_samples:
            raise RecipeError(
                f"checkpoint was made on data with {state['num_samples']} training samples, this recipe's data"
                f" has {self.num_samples}: resume with the same data and the same model and data settings"
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
