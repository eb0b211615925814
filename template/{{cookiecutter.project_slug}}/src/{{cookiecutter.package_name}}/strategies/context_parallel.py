"""Context parallel (strategy.fsdp2.context_parallel_size): every sequence of a micro-batch split over a group of
ranks that share the same samples, each holding a load-balanced part of it.

A sequence of length T is cut into 2 x cp chunks; rank r holds chunks r and 2cp - 1 - r, so under a causal mask
every rank does the same attention work (an early chunk attends to few positions, its partner to many). The model
attends from its own positions to the keys and values all-gathered from the group, with the mask built from global
positions (`SequenceShard.gather` runs the all-gather under autograd: its backward sums the keys' and values'
gradients back onto the ranks that computed them). torch's ring attention refuses CPU tensors; this path runs on
gloo and is the reference.

Each rank's loss is the mean over its own positions; equal parts make the group's mean the mean over the whole
sequence, and fully_shard averaging gradients over the data x context ranks gives the gradient of that mean. Where
the parts count unequal numbers of targets (packed replies), a rank divides its sum by the group's count (`total`)
and multiplies by the group size, so the group's mean is again the whole sequence's.
Checked here without torch (`check_context_parallel`); the rest imports torch when called.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from ..recipe.schema import Fsdp2Options, StrategyConfig, field_path
from .base import divisors

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist
    from lightning.fabric import Fabric


def check_context_parallel(strategy: Any) -> None:
    """Refuse a context-parallel size this recipe cannot run (RecipeError naming the field)."""
    recipe, options = strategy.recipe, strategy.options
    size = options.context_parallel_size
    field = f"{field_path(Fsdp2Options, 'context_parallel_size')}={size}"
    group = size * options.tensor_parallel_size
    if strategy.hybrid and recipe.devices % group:  # hsdp shards inside a node: a group must not span two
        raise RecipeError(
            f"{field}: under {field_path(StrategyConfig, 'name')}={strategy.name} a context-parallel group (with its"
            f" tensor-parallel ranks, {group}) lies inside a node: choose a size that divides devices={recipe.devices}"
            f" / tensor_parallel_size={options.tensor_parallel_size}"
        )
    others = recipe.world_size // (options.tensor_parallel_size * options.pipeline_parallel_size)
    if others % size:
        stages = " x pipeline_parallel_size" if options.pipeline_parallel_size > 1 else ""
        raise RecipeError(
            f"{field} does not divide the {others} data-parallel ranks (devices x num_nodes / tensor_parallel_size"
            f"{stages}): choose {divisors(others)}"
        )
    length = strategy.task.units_per_sample()
    if length == 1:
        raise RecipeError(f"{field}: task={recipe.task} has no sequence to split (set it to 1)")
    if length % (2 * size):
        fitting = [str(n) for n in range(1, others + 1) if others % n == 0 and length % (2 * n) == 0]
        raise RecipeError(
            f"{field}: the sequence length {length} does not divide into 2 x {size} equal chunks"
            f" (choose {', '.join(fitting)})"
        )


def chunk_positions(length: int, rank: int, size: int, device: Any = None) -> torch.Tensor:
    """The positions of a sequence of `length` that rank `rank` of `size` holds: chunks `rank` and 2 x size - 1 - rank
    of 2 x size equal chunks, in that order."""
    import torch

    chunk = length // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return torch.cat(
        [torch.arange(first, first + chunk, device=device), torch.arange(second, second + chunk, device=device)]
    )


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its context-parallel group: which part of every sequence it holds."""

    group: dist.ProcessGroup | None  # None only where a test simulates the ranks in one process
    rank: int
    size: int

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of `x` along its sequence dimension `dim`."""
        return x.index_select(dim, chunk_positions(x.shape[dim], self.rank, self.size, x.device))

    def split_all(self, tensors: tuple[Any, ...]) -> tuple[Any, ...]:
        """This rank's part of each tensor whose second dimension is its sequence (the others as they are)."""
        return tuple(self.split(x) if x.dim() > 1 else x for x in tensors)

    def positions(self, local_length: int, device: Any = None) -> torch.Tensor:
        """The global positions of this rank's `local_length` elements."""
        return chunk_positions(local_length * self.size, self.rank, self.size, device)

    def gathered_positions(self, local_length: int, device: Any = None) -> torch.Tensor:
        """The global positions of what `gather` returns, in its order (rank 0's part, rank 1's, ...)."""
        import torch

        length = local_length * self.size
        return torch.cat([chunk_positions(length, rank, self.size, device) for rank in range(self.size)])

    def gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's part of `x` along `dim`, concatenated in rank order; under autograd, the backward sums each
        part's gradient back onto its rank."""
        from torch.distributed._functional_collectives import all_gather_single_autograd

        assert self.group is not None  # a simulated shard gathers in its test
        return all_gather_single_autograd(x.contiguous(), gather_dim=dim, group=self.group)

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group's ranks (a count, outside autograd): what the whole sequences hold."""
        import torch.distributed as dist

        assert self.group is not None  # a simulated shard sums in its test
        summed = x.detach().clone()
        dist.all_reduce(summed, group=self.group)
        return summed


_active: list[SequenceShard] = []  # the shard of the forward and backward running now (empty: whole sequences)


def active() -> SequenceShard | None:
    """The sequence shard this rank's model runs on now, or None when it sees whole sequences."""
    return _active[-1] if _active else None


@contextmanager
def sharding(shard: SequenceShard) -> Iterator[None]:
    """Run the model on `shard`'s parts of the sequences (forward, and backward with any recomputation)."""
    _active.append(shard)
    try:
        yield
    finally:
        _active.pop()


@contextmanager
def split_sequences(fabric: Fabric, batch: Any, size: int) -> Iterator[Any]:
    """This rank's part of every tensor of a micro-batch (`batch`: a tuple; each tensor's second dimension is its
    sequence), with the model running on that part inside; the batch unchanged when `size` is 1."""
    if size == 1:
        yield batch
        return
    mesh = fabric.strategy.device_mesh  # type: ignore[attr-defined]
    shard = SequenceShard(mesh.get_group("context_parallel"), mesh.get_local_rank("context_parallel"), size)
    with sharding(shard):
        yield shard.split_all(batch)
