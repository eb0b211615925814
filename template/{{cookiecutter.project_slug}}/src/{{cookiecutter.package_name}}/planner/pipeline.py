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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..strategies.pipeline_checks import LOOPED_MINIMUM
from ..tasks.base import Activations, ModelCost


@dataclass(frozen=True)
class PipelineTerms:
    """One pipeline layout's costs per device, for one micro-batch of `micro_batch` samples in `pieces` pieces."""

    stages: int  # p x v
    layers: int  # blocks on the rank that holds the most
    bubble: float  # idle share of a step
    pieces_held: float  # pieces whose activations the first stage holds at its peak
    activations: Activations  # what that rank holds
    p2p_elements: float  # sent per micro-batch by a middle rank


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
) -> PipelineTerms:
    """The bubble, held activations and p2p volume of `size` pipeline ranks on one micro-batch of `pieces` pieces."""
    layers = math.ceil(cost.n_layer / size)
    # Activations grow with the samples: a piece holds 1 / pieces of the micro-batch's, on layers / n_layer blocks.
    whole = cost.activations(micro_batch, precision, tensor_parallel, sixteen_bit_module)
    held = pieces_held(schedule, size, pieces, stages_per_rank) / pieces * layers / cost.n_layer
    activations = Activations(
        paper=whole.paper * held,
        paper_checkpointed=whole.paper_checkpointed * held,
        held=whole.held * held,
        held_checkpointed=whole.held_checkpointed * held,
        recompute_peak=whole.recompute_peak / pieces,  # one block of one piece rebuilt
        backward_transient=whole.backward_transient / pieces,  # the last stage's loss of one piece
    )
    return PipelineTerms(
        stages=size * stages_per_rank,
        layers=layers,
        bubble=bubble_fraction(schedule, size, pieces, stages_per_rank),
        pieces_held=pieces_held(schedule, size, pieces, stages_per_rank),
        activations=activations,
        p2p_elements=2 * stages_per_rank * cost.hidden_elements(micro_batch),
    )
