"""What a task's data is to the machinery: samples the exact-resume sampler (sampler.py) draws from.

Importing this module imports neither torch nor numpy (recipes are checked before either loads).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Samples(Protocol):
    """An indexable set of samples: what the exact-resume sampler (data/sampler.py) draws from."""

    def __len__(self) -> int: ...

    def batch(self, indices: Sequence[int]) -> Any:
        """The micro-batch of these samples: a tensor or a tuple/dict of tensors, on the host."""
        ...


class AugmentedSamples(Samples, Protocol):
    """Training samples that are augmented: the sampler calls `augmented_batch` instead of `batch`."""

    def augmented_batch(self, indices: Sequence[int], draws: Sequence[int]) -> Any:
        """`batch(indices)` with sample i augmented by randomness drawn from (seed, draws[i]); draws[i] is the
        sample's position in the run's stream of samples, so a resumed run augments it identically."""
        ...
