"""The collectives of one optimizer step on one rank, as plan's communication model counts them, by the names
`rehearse` counts (training/rehearsal.py): a rehearsal holds the model to them, collective by collective.

Per micro-batch of p pieces (one without a pipeline) a rank of fully_shard (fsdp2, hsdp; strategies/fsdp2.py):
    allgather       each block it holds p + 1 times: resharded after each forward, gathered again for a backward
                    that follows a forward, and kept gathered from one backward to the next forward (torch's
                    pipeline leaves a stage's blocks unsharded between its backwards); in any order of forwards and
                    backwards that ends on a backward that is p + 1. Under a zero-bubble schedule once: its blocks
                    stay gathered until the schedule's last backward (their weight halves need the weights). Each
                    end (the root's parameters: embedding, final norm, head; a middle pipeline stage has none)
                    once, kept for the step; experts sharded apart from their block as blocks of their own.
    reduce_scatter  each unit's gradient once (a frozen end has none): the schedule reduces them after its last
                    backward, as one micro-batch's backward does without a pipeline
and once per step hsdp all-reduces each reduced unit across its replicas. A pipeline sends each piece's output to
the next stage and its input gradient back (a `send` and a `recv` per piece and stage boundary that crosses to
another rank), and all-reduces each micro-batch's loss over its ranks; clipping all-reduces the gradients' norm
over the pipeline ranks, and (torch's DTensor, dimension by dimension) over each mesh dimension that shards a group
of gradients: the data-parallel shards, the tensor-parallel ranks and the data-parallel shards again for the layers
they split (their norms, split by neither, stay with the first group), and the experts' groups.
"""

from __future__ import annotations

from ..strategies.pipeline_checks import ZERO_BUBBLE_SCHEDULES, stage_indices
from ..tasks.base import ModelCost
from .options import PlanOption, PlanSizes, RankStep
from .pipeline import end_parameters, stage_blocks


def rank_step(
    cost: ModelCost,
    option: PlanOption,
    micro_batches: int,
    pieces: int,
    pipeline_rank: int,
    clipped: bool,
    checkpoint_every: int,
) -> RankStep:
    """The step of a rank of pipeline rank `pipeline_rank` (0 without a pipeline), `checkpoint_every`: every k-th
    block of each stage is checkpointed (0: none)."""
    size, per_rank, schedule = option.pipeline_parallel, option.pipeline_stages_per_rank, option.pipeline_schedule
    stages = size * per_rank
    held: list[int] = [0]
    split: tuple[int, ...] = (cost.n_layer,)
    if size > 1:
        first, last = end_parameters(cost, 1)
        split = stage_blocks(cost.n_layer, cost.layer_parameters(), round(first), round(last), stages)
        held = stage_indices(pipeline_rank, size, per_rank, schedule)
    neighbours = [neighbour for stage in held for neighbour in (stage - 1, stage + 1) if 0 <= neighbour < stages]
    return RankStep(
        blocks=sum(split[stage] for stage in held),
        micro_batches=micro_batches,
        ends=1 if size == 1 else int(0 in held) + int(stages - 1 in held),
        pieces=pieces if size > 1 else 1,
        boundaries=sum(neighbour not in held for neighbour in neighbours),
        zero_bubble=size > 1 and schedule in ZERO_BUBBLE_SCHEDULES,
        clipped=clipped,
        checkpointed=sum(-(-split[stage] // checkpoint_every) for stage in held) if checkpoint_every else 0,
    )


def sharded_collectives(option: PlanOption, sizes: PlanSizes, step: RankStep) -> dict[str, int]:
    """fully_shard's collectives of the step (module docstring), with the pipeline's and the clip's all-reduces."""
    sharded = sizes.data_parallel > 1  # over one rank (tensor parallel on every device) only experts apart move
    units = (step.blocks if sharded else 0) + step.expert_units
    ends = step.ends if sharded else 0
    reduced = units + (ends if sizes.trained == 1.0 else 0)
    gathers = 1 if step.zero_bubble else step.pieces + 1
    counts = {
        "allgather": (gathers * units + ends) * step.micro_batches,
        "reduce_scatter": reduced * step.micro_batches,
        "allreduce": (reduced if option.hybrid else 0)
        + (norm_reductions(option, sizes, step.expert_mesh) if step.clipped else 0),
    }
    if option.pipeline_parallel > 1:
        counts["allreduce"] += step.micro_batches + int(step.clipped)  # each micro-batch's loss; the norm
        counts |= {"send": step.boundaries * step.passes, "recv": step.boundaries * step.passes}
    return counts


def norm_reductions(option: PlanOption, sizes: PlanSizes, experts: bool) -> int:
    """All-reduces of the clip's gradient norm over the mesh dimensions that shard the gradients (module
    docstring)."""
    shard = int(sizes.data_parallel > 1)
    reductions = shard + (1 + shard if option.tensor_parallel > 1 else 0)
    if experts:  # their mesh: (replicate, expert_shard, expert) over the data x tensor-parallel ranks of a replica
        expert_shard = sizes.data_parallel * option.tensor_parallel // option.expert_parallel
        reductions += int(option.expert_parallel > 1) + int(expert_shard > 1)
    return reductions
