"""The rules a recipe's pipeline options (strategy.fsdp2.pipeline_*) must follow; no torch.

Which schedules hold how many stages per rank, what the micro-batch must divide, how a split must add up:
checked before any process starts, each refusal one line naming the field and what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..errors import RecipeError
from ..recipe.schema import StrategyConfig, field_path
from .base import divisors

# Stages per pipeline rank each schedule runs: exactly these (ZBV: two, in a V), or for the looped schedules (rank r
# holds stages r, r + pp, ...) at least these.
EXACT_STAGES_PER_RANK = {"GPipe": 1, "1F1B": 1, "ZBVZeroBubble": 2}
LOOPED_MINIMUM = {"Interleaved1F1B": 2, "InterleavedZeroBubble": 1}
# Schedules that place a rank's two stages in a V: rank r holds stage r and stage 2p - 1 - r, so the first and
# the last stage share a rank and the turn from forward to backward happens there without a send.
V_SCHEDULES = ("ZBVZeroBubble",)
# Schedules that split each backward into its input half (sent back at once) and its weight half (run later, in
# what would be the bubble). The weight half reads the stage's gathered weights, so under fully_shard a stage's
# blocks stay gathered from forward to backward (fully_shard.py).
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
# Block passes (pieces x blocks) a rank's micro-batch takes at most for `rehearse` to run it: each is a forward and a
# backward on fake tensors, 10 to 100 ms (llama-70b-pp-fsdp2-tp-multinode: 8 pieces x 20 blocks a rank, 20 s).
REHEARSED_BLOCK_PASSES = 4096


def check_pipeline(strategy: Any) -> None:
    """Refuse pipeline options this recipe cannot run (RecipeError naming the field)."""
    recipe, options = strategy.recipe, strategy.options
    size, tensor_parallel = options.pipeline_parallel_size, options.tensor_parallel_size
    field = field_path(StrategyConfig, "fsdp2")
    if recipe.world_size % (size * tensor_parallel):
        raise RecipeError(
            f"{field}.pipeline_parallel_size={size} x tensor_parallel_size={tensor_parallel} does not divide"
            f" devices x num_nodes = {recipe.world_size} (choose a pipeline size from {divisors(recipe.world_size)})"
        )
    nodes = recipe.num_nodes
    if strategy.hybrid and (nodes % size or nodes // size < 2):
        raise RecipeError(
            f"strategy.name=hsdp replicates each of the {size} pipeline stages across the nodes it spans: num_nodes={nodes}"
            f" must be a multiple of 2 x {field}.pipeline_parallel_size={size} (or choose fsdp2)"
        )
    schedule, per_rank = options.pipeline_schedule, options.pipeline_stages_per_rank
    exact = EXACT_STAGES_PER_RANK.get(schedule)
    if exact is not None and per_rank != exact:
        raise RecipeError(
            f"{field}.pipeline_stages_per_rank={per_rank}: pipeline_schedule={schedule} holds {exact} per rank"
        )
    minimum = LOOPED_MINIMUM.get(schedule, 1)
    if per_rank < minimum:
        raise RecipeError(
            f"{field}.pipeline_stages_per_rank={per_rank}: pipeline_schedule={schedule} holds >= {minimum} per rank"
            " (or choose 1F1B)"
        )
    microbatches, micro_batch_size = options.pipeline_microbatches, recipe.train.micro_batch_size
    if microbatches < 1 or micro_batch_size % microbatches:
        raise RecipeError(
            f"{field}.pipeline_microbatches={microbatches} must divide train.micro_batch_size={micro_batch_size}"
            f" (choose {divisors(micro_batch_size)})"
        )
    if schedule == "1F1B" and microbatches < size:  # torch's Schedule1F1B refuses fewer pieces than stages
        allowed = [m for m in range(size, micro_batch_size + 1) if micro_batch_size % m == 0]
        raise RecipeError(
            f"{field}.pipeline_microbatches={microbatches}: pipeline_schedule=1F1B feeds at least"
            f" pipeline_parallel_size={size} pieces (choose from {allowed} with train.micro_batch_size="
            f"{micro_batch_size}, a larger micro batch, or GPipe)"
        )
    # The looped schedules feed the pieces in rounds of max(1, m // pp) (torch's rule): the rounds must divide m.
    rounds = max(1, microbatches // size)
    if schedule in LOOPED_MINIMUM and microbatches % rounds:
        allowed = [m for m in range(1, micro_batch_size + 1) if micro_batch_size % m == 0 == m % max(1, m // size)]
        raise RecipeError(
            f"{field}.pipeline_microbatches={microbatches}: pipeline_schedule={schedule} feeds the pieces in"
            f" {rounds} rounds of pipeline_parallel_size={size}, which must divide them (choose from {allowed})"
        )
    stages = size * per_rank
    blocks = strategy.task.pipeline_blocks()
    if blocks < stages:
        raise RecipeError(
            f"{field}: {stages} pipeline stages need at least {stages} blocks (the model has {blocks}); lower"
            " pipeline_parallel_size or pipeline_stages_per_rank"
        )
    split = options.pipeline_split
    if split and (len(split) != stages or sum(split) != blocks or min(split) < 1):
        raise RecipeError(
            f"{field}.pipeline_split={split} must give each of the {stages} stages >= 1 block, {blocks} in all"
            " (or [] to balance by parameter count)"
        )


def pipeline_rehearsal_problem(strategy: Any) -> str | None:
    """Why `rehearse` does not run this pipeline (one line naming the field), or None: every piece of a micro-batch
    runs through every block of a rank, and past REHEARSED_BLOCK_PASSES that takes too long to wait for."""
    options = strategy.options
    pieces, size = options.pipeline_microbatches, options.pipeline_parallel_size
    blocks = -(-strategy.task.pipeline_blocks() // size)  # on the rank that holds the most
    if pieces * blocks <= REHEARSED_BLOCK_PASSES:
        return None
    return (
        f"{field_path(StrategyConfig, 'fsdp2')}.pipeline_microbatches={pieces}: not rehearsed: {pieces} pieces through"
        f" {blocks} blocks a rank are {pieces * blocks} block passes a micro-batch, more than a rehearsal runs in"
        f" minutes ({REHEARSED_BLOCK_PASSES}); rehearse the layout with fewer pieces"
    )


def stage_indices(rank: int, size: int, per_rank: int, schedule: str = "1F1B") -> list[int]:
    """The stages pipeline rank `rank` of `size` holds: rank, rank + size, ... (the interleaved schedules' loop),
    or under a V schedule (two per rank) rank and 2 x size - 1 - rank."""
    if schedule in V_SCHEDULES:
        return [rank, 2 * size - 1 - rank]
    return [rank + round_ * size for round_ in range(per_rank)]


def balanced_split(block_parameters: Sequence[int], first: int, last: int, stages: int) -> list[int]:
    """Blocks per stage (each >= 1, in order) that minimise the largest stage's parameters.

    `first` and `last`: parameters outside the blocks that the first and the last stage hold (embeddings, head).
    """
    count = len(block_parameters)
    prefix = [0]
    for size in block_parameters:
        prefix.append(prefix[-1] + size)
    # best[s][i]: (largest stage, split) of the first i blocks over the first s stages.
    best: dict[tuple[int, int], tuple[float, list[int]]] = {(0, 0): (0, [])}
    for stage in range(1, stages + 1):
        extra = (first if stage == 1 else 0) + (last if stage == stages else 0)
        for end in range(stage, count - (stages - stage) + 1):
            options = []
            for start in range(stage - 1, end):
                if (stage - 1, start) in best:
                    largest, split = best[(stage - 1, start)]
                    options.append((max(largest, prefix[end] - prefix[start] + extra), [*split, end - start]))
            best[(stage, end)] = min(options, key=lambda option: option[0])
    return best[(stages, count)][1]
