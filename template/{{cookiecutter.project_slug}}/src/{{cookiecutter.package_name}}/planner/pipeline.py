"""What a pipeline costs, as `plan` weighs it: its bubble, the activations its schedule holds, what crosses
between stages. Torch-free formulas; plan.py applies them to the pipeline candidates.

With p stages, m pieces per micro-batch and v stages per rank (interleaved), and a piece's forward, the input half
and the weight half of its backward taking equal time (their matmul FLOPs are equal; Qi et al. 2024, section 3):
    bubble       (p - 1) / (m + p - 1) of a step idles under GPipe and 1F1B; the zero-bubble ZB-H1 (torch's
                 InterleavedZeroBubble) runs the weight halves in the bubble, leaving a third of it:
                 (p - 1) / (3m + p - 1); interleaving divides either by v; ZB-V (ZBVZeroBubble, two stages per
                 rank) leaves none once its V is full, and torch plans it for at least 2p - 1 pieces: with fewer,
                 (2p - 1 - m) / (2p - 1) of it idles
    pieces held  on the first stage, whose pieces wait longest for their backward: GPipe all m, 1F1B, ZB-H1 and ZB-V
                 min(m, p), the interleaved schedules min(m, p) x (1 + (p - 1) / (p v)) (Narayanan et al. 2021,
                 section 2.2)
    p2p          per micro-batch a middle rank sends each of its stages' outputs forward and their input
                 gradients back: 2 v s b h elements

Each pipeline rank is sized on its own (`rank_loads`), as torch's pipeline builds it: the blocks split as
strategies/pipeline_checks.py's `balanced_split` splits them (the embedding weighs on the first stage, the head on
the last), the stages a rank holds as its schedule places them (ZB-V puts the first and the last on rank 0), and the
pieces it holds: GPipe all m on every rank, 1F1B min(m, p - r) on rank r, the interleaved 1F1B the first rank's
count on each (an upper bound for the later ranks). The loss's logits are held on the rank of the last stage, for
one piece at a time (GPipe: all m). The zero-bubble schedules take a piece's input gradients with autograd.grad
keeping the graph for its weight half: measured by `rehearse`, a rank then holds more than its pieces in flight, and
checkpointing saves nothing (the recomputed activations stay with the graph; on an 8-block Llama-70B shape a rank of
ZB-V holds 37.9 GiB checkpointed, 33.6 GiB not); plan bounds them by every piece of the micro-batch, uncheckpointed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from ..strategies.pipeline_checks import LOOPED_MINIMUM, ZERO_BUBBLE_SCHEDULES, balanced_split, stage_indices
from ..tasks.base import Activations, ModelCost


@dataclass(frozen=True)
class RankLoad:
    """What one pipeline rank's stages hold: blocks, the parameters outside them, the activations of its pieces."""

    rank: int
    blocks: int
    ends: float  # parameters outside the blocks on one tensor-parallel rank: embedding (first stage), head (last)
    block_pieces: float  # pieces x blocks whose activations the rank holds at its peak
    loss_pieces: int  # pieces whose loss (logits) the rank holds: its last stage's, 0 without it


@dataclass(frozen=True)
class PipelineTerms:
    """One pipeline layout's costs on one of its ranks (plan shows its worst), for one micro-batch of `micro_batch`
    samples in `pieces` pieces."""

    stages: int  # p x v
    layers: int  # blocks on this rank
    bubble: float  # idle share of a step
    pieces_held: float  # pieces whose activations the first stage holds at its peak
    activations: Activations  # what this rank holds
    p2p_elements: float  # sent per micro-batch by a middle rank
    rank: int = 0  # the pipeline rank these terms are of
    ends: float = 0.0  # its parameters outside the blocks (one tensor-parallel rank)
    loads: tuple[RankLoad, ...] = ()  # every pipeline rank's


def bubble_fraction(schedule: str, size: int, pieces: int, stages_per_rank: int = 1) -> float:
    """The idle share of a step (module docstring: forward, input and weight gradients taking equal time)."""
    if schedule == "ZBVZeroBubble":
        filled = 2 * size - 1
        return max(0, filled - pieces) / filled
    weight_halves_in_the_bubble = schedule == "InterleavedZeroBubble"
    fraction = (size - 1) / ((3 if weight_halves_in_the_bubble else 1) * pieces + size - 1)
    return fraction / stages_per_rank if schedule in LOOPED_MINIMUM else fraction


def pieces_held(schedule: str, size: int, pieces: int, stages_per_rank: int = 1) -> float:
    """Pieces whose activations the first stage holds at once."""
    if schedule == "GPipe":
        return float(pieces)
    held = float(min(pieces, size))
    if schedule in LOOPED_MINIMUM and stages_per_rank > 1:
        held *= 1 + (size - 1) / (size * stages_per_rank)
    return held


def rank_pieces(schedule: str, size: int, pieces: int, stages_per_rank: int, rank: int) -> float:
    """Pieces (each through all of the rank's blocks) whose activations pipeline rank `rank` holds at its peak; the
    zero-bubble schedules: every piece (module docstring)."""
    if schedule == "GPipe" or schedule in ZERO_BUBBLE_SCHEDULES:
        return float(pieces)
    if schedule == "1F1B":
        return float(min(pieces, size - rank))
    return pieces_held(schedule, size, pieces, stages_per_rank)


@lru_cache(maxsize=256)
def stage_blocks(n_layer: int, layer: int, first: int, last: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as the pipeline splits them by parameter count (`layer` each, `first` and `last` outside);
    with more stages than blocks (a layout plan marks n/a) one block each."""
    if stages > n_layer:
        return (1,) * stages
    return tuple(balanced_split([layer] * n_layer, first, last, stages))


def end_parameters(cost: ModelCost, tensor_parallel: int) -> tuple[float, float]:
    """(parameters before the blocks, after them) on one tensor-parallel rank: the task's `pipeline_end_parameters`
    where it has one, else the parameters outside the blocks halved."""
    split = getattr(cost, "pipeline_end_parameters", None)
    if callable(split):
        first, last = split(tensor_parallel)
        return float(first), float(last)
    outside = cost.parameters(tensor_parallel) - cost.n_layer * cost.layer_parameters(tensor_parallel)
    return outside / 2, outside / 2


def rank_loads(
    cost: ModelCost, size: int, schedule: str, stages_per_rank: int, pieces: int, tensor_parallel: int = 1
) -> tuple[RankLoad, ...]:
    """Each pipeline rank's blocks, ends and held pieces (module docstring)."""
    stages = size * stages_per_rank
    first, last = end_parameters(cost, 1)
    split = stage_blocks(cost.n_layer, cost.layer_parameters(), round(first), round(last), stages)
    local_first, local_last = end_parameters(cost, tensor_parallel)
    loss_pieces = pieces if schedule == "GPipe" or schedule in ZERO_BUBBLE_SCHEDULES else 1
    loads = []
    for rank in range(size):
        held = stage_indices(rank, size, stages_per_rank, schedule)
        blocks = sum(split[stage] for stage in held)
        ends = (local_first if 0 in held else 0.0) + (local_last if stages - 1 in held else 0.0)
        per_rank = rank_pieces(schedule, size, pieces, stages_per_rank, rank)
        loads.append(RankLoad(rank, blocks, ends, per_rank * blocks, loss_pieces if stages - 1 in held else 0))
    return tuple(loads)


def rank_activations(whole: Activations, n_layer: int, pieces: int, load: RankLoad, zero_bubble: bool) -> Activations:
    """What one rank holds, from one micro-batch through the whole model (`whole`): each block's share per piece
    held, and beside the blocks (the loss's logits, mostly) on the rank of the last stage only, with the stage's
    output, which the schedule keeps for the stage's backward (where without a pipeline the logits are freed once
    the loss has its log-softmax)."""
    layer = whole.recompute_peak  # one block of the whole micro-batch, not checkpointed
    outside = whole.held - n_layer * layer
    checkpointed_layer = layer if zero_bubble else (whole.held_checkpointed - outside) / n_layer
    blocks, loss = load.block_pieces / pieces, load.loss_pieces / pieces  # in micro-batches
    return Activations(
        paper=whole.paper * blocks / n_layer,
        paper_checkpointed=(whole.paper if zero_bubble else whole.paper_checkpointed) * blocks / n_layer,
        held=blocks * layer + loss * (outside + whole.output),
        held_checkpointed=blocks * checkpointed_layer + loss * (outside + whole.output),
        recompute_peak=layer / pieces,  # one block of one piece rebuilt
        backward_transient=whole.backward_transient / pieces if load.loss_pieces else 0.0,
    )


def pipeline_terms(
    cost: ModelCost,
    size: int,
    schedule: str,
    stages_per_rank: int,
    micro_batch: int,
    pieces: int,
    precision: str,
    tensor_parallel: int = 1,
    sixteen_bit_module: bool = False,
    rank: int | None = None,
    split: SplitSequence | None = None,
) -> PipelineTerms:
    """The bubble, held activations and p2p volume of `size` pipeline ranks on one micro-batch of `pieces` pieces,
    on pipeline rank `rank` (None: the first); under context parallel (`split`) each on its part of the sequence."""
    whole = split.own if split else cost.activations(micro_batch, precision, tensor_parallel, sixteen_bit_module)
    loads = rank_loads(cost, size, schedule, stages_per_rank, pieces, tensor_parallel)
    load = loads[rank or 0]
    zero_bubble = schedule in ZERO_BUBBLE_SCHEDULES
    held = rank_activations(whole, cost.n_layer, pieces, load, zero_bubble)
    return PipelineTerms(
        stages=size * stages_per_rank,
        layers=load.blocks,
        bubble=bubble_fraction(schedule, size, pieces, stages_per_rank),
        pieces_held=pieces_held(schedule, size, pieces, stages_per_rank),
        activations=split.added_to(held, load.block_pieces / max(load.blocks, 1)) if split else held,
        p2p_elements=2 * stages_per_rank * cost.hidden_elements(micro_batch) / (split.degree if split else 1),
        rank=load.rank,
        ends=load.ends,
        loads=loads,
    )


@dataclass(frozen=True)
class SplitSequence:
    """What context parallel (planner/context.py) adds to a rank's activations: each piece of one micro-batch on 1 /
    `degree` of its positions, attending over the keys and values gathered from the group."""

    degree: int
    own: Activations  # one micro-batch through every layer at a rank's positions (the task's formulas)
    mask: float  # the boolean mask a piece holds while in flight (its size does not depend on the piece's samples)
    transient: float  # one layer's gathered keys and values and SDPA's float mask, made again when backward reaches it

    def added_to(self, held: Activations, in_flight: float) -> Activations:
        """`held` (a rank's, from `own`) with the masks of its `in_flight` pieces and one layer's recomputation."""
        return replace(
            held,
            held=held.held + in_flight * self.mask,
            held_checkpointed=held.held_checkpointed + in_flight * self.mask,
            recompute_peak=held.recompute_peak + self.transient,
            backward_transient=max(held.backward_transient, self.transient),
        )


def layout_problem(option: Any, inputs: Any, micro_batch: int) -> str | None:
    """Why a pipeline option cannot run on `inputs`' ranks (the recipe checks would refuse it), or None; each piece
    one sample of the micro batch."""
    pp, t = option.pipeline_parallel, option.tensor_parallel
    stages = pp * option.pipeline_stages_per_rank
    if inputs.world_size % (pp * t) or inputs.cost.n_layer < stages:
        return f"{pp} pipeline stages x tensor parallel {t} must divide {inputs.world_size} ranks, {stages} <= n_layer"
    if option.pipeline_schedule == "1F1B" and pp > micro_batch:  # torch's Schedule1F1B: at least a piece a stage
        return f"1F1B feeds at least {pp} pieces (one sample each): micro batch {micro_batch} gives {micro_batch}"
    return None


def worst_rank(estimate_on: Callable[[int, bool], Any], size: int) -> Any:
    """The estimate of the pipeline rank that holds the most, `estimate_on(rank, checkpointed)` giving each: every
    rank checkpointed if one must be, as the recipe's one `activation_checkpointing` flag has them all."""
    ranks = [estimate_on(rank, False) for rank in range(size)]
    if any(estimate.checkpointing for estimate in ranks):
        ranks = [estimate_on(rank, True) for rank in range(size)]
    return max(ranks, key=lambda estimate: estimate.total)
