"""Context parallelism in `plan`: the degrees it offers a long sequence, what a degree saves and what it moves.

A degree c splits every sequence of a micro-batch over c ranks that share its samples (strategies/context_parallel.py):
each holds 2 of 2c load-balanced chunks, s/c of the s positions, and attends from them to the keys and values
all-gathered from the group. Per rank, against the same option without it:

    model states  the same: fully_shard shards them over the data x context ranks, as many as before
    activations   those of a sequence of s/c positions (the task's formulas at that length), plus the boolean mask from
                  its s/c queries to the s keys (s/c x s bytes), held once for every layer (a pipeline: once per
                  piece in flight); the attention recomputes itself in backward (families/context.py `attend`), so
                  what it makes of the whole sequence, the gathered keys and values, b x s x 2 x kv_width / t, and the
                  float mask SDPA converts the boolean one to, s/c x s in the compute dtype, exists for one layer at
                  a time (in forward, and while backward recomputes it)
    all-gather    per layer and micro-batch the keys and the values, each b x s x kv_width / t elements gathered (a rank
                  receives the (c - 1) / c it does not hold) in forward and again when backward recomputes the
                  attention (or its checkpointed block); each gather's autograd reduce-scatters the gradients of the
                  same size back onto their ranks: 6 collectives per layer
    micro-batches c ranks share each sample: like a tensor-parallel group, a context-parallel group runs c times the
                  micro-batches per data-parallel rank for the same global batch (each on 1/c of the positions)

The attention waits for its keys: the gathers and reduce-scatters sit on the step's critical path, added to its bound
as tensor parallel's all-reduces are, over the node's links when the group (c x t neighbouring ranks, the mesh's
context dimension outside the tensor one) fits in a node, else over the rank's share of the network link.

Offered: each degree c > 1 that divides the data-parallel ranks and leaves 2 x c equal chunks of the sequence, for an
option of a strategy with a context-parallel dimension (fsdp2's sharding, with or without tensor parallel; not yet
with a pipeline, hsdp's replicas or expert parallel, which run it: a recipe that sets them is sized, a pipeline's
ranks each on its part of the sequence), when the sequence is LONG or longer; only for a task whose sizes have a
sequence (the language model's `Shape`; not the image task).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from ..precision import MIXED, activation_bytes
from ..recipe.schema import Fsdp2Options, field_path
from ..tasks.base import Activations, ModelCost
from .inputs import Candidate, Inputs
from .options import PlanOption
from .pipeline import SplitSequence
from .units import GB

LONG = 16384  # tokens from which plan offers context-parallel degrees (shorter sequences fit without)
LENGTHS = tuple(2**n for n in range(10, 23))  # what plan tries for the longest context that fits: 1K to 4M tokens
GATHERS_PER_LAYER = 4  # the keys' and the values' all-gathers, in forward and again when backward recomputes them
REDUCE_SCATTERS_PER_LAYER = 2  # their gradients', in backward (each gather's autograd)
COLLECTIVES_PER_LAYER = GATHERS_PER_LAYER + REDUCE_SCATTERS_PER_LAYER
WHY = (
    "each of {context_parallel} {device_plural} holds 1/{context_parallel} of every sequence and its activations;"
    " the keys and values are all-gathered per layer, which moves less than splitting the layers"
)


@runtime_checkable
class SequenceCost(Protocol):
    """A model's sizes with a sequence dimension (the language model's `Shape`): what context parallel splits."""

    sequence_length: int
    n_layer: int
    document_ids: bool  # each sample carries its positions' example ids (packed examples, document masks)

    @property
    def kv_width(self) -> int: ...


def sequence_length(cost: ModelCost) -> int | None:
    """The tokens of one sample, or None for a model without a sequence to split (an image, a measured cost)."""
    return cost.sequence_length if isinstance(cost, SequenceCost) else None


def splits_sequences(candidate: Candidate) -> bool:
    """Whether the candidate's strategy can split sequences at this option (strategies/context_parallel.py's rules)."""
    option = candidate.option
    plain = option.pipeline_parallel == 1 and not option.hybrid and option.expert_parallel == 1
    return plain and option.stage == 3 and hasattr(candidate.strategy, "context_parallel_size")


def degrees(length: int, data_parallel: int) -> list[int]:
    """Context-parallel degrees > 1 that divide the data-parallel ranks and cut `length` into 2 x c equal chunks."""
    return [c for c in range(2, data_parallel + 1) if data_parallel % c == 0 and length % (2 * c) == 0]


def with_degrees(candidates: list[Candidate], inputs: Inputs) -> list[Candidate]:
    """`candidates`, each that can split sequences followed by itself at every degree its layout allows, for a
    sequence of LONG tokens or more (none for a model without a sequence)."""
    length = sequence_length(inputs.cost)
    offered = []
    for candidate in candidates:
        offered.append(candidate)
        if length is None or length < LONG or not splits_sequences(candidate):
            continue
        for degree in degrees(length, inputs.world_size // candidate.tensor_parallel):
            name = f"{candidate.name}_cp{degree}"
            option = dataclasses.replace(candidate.option, name=name, context_parallel=degree, why=WHY)
            offered.append(Candidate(candidate.strategy, option))
    return offered


def quickest_degree(cheapest: Any, fitting: list[Any]) -> Any:
    """Plan's pick where the cheapest estimate that fits (`cheapest`, among those that recompute the least) splits
    sequences: of the `fitting` estimates of its option at a context-parallel degree > 1, checkpointed or not, the
    quickest by the step bound (`cheapest` where it has none). A degree whose group crosses nodes gathers keys and
    values over the network at every layer, which can cost more than recomputing a smaller degree's activations."""
    option = cheapest.candidate.option
    if option.context_parallel == 1 or cheapest.step_seconds is None:
        return cheapest

    def plain(option: PlanOption) -> PlanOption:
        return dataclasses.replace(option, name="", why="", context_parallel=1)

    same = [
        e
        for e in fitting
        if e.candidate.option.context_parallel > 1
        and e.step_seconds is not None
        and plain(e.candidate.option) == plain(option)
    ]
    return min(same, key=lambda e: e.step_seconds)


def base_name(option: PlanOption) -> str:
    """The option's name without its context-parallel suffix: what a recipe's refusal names."""
    return option.name.removesuffix(f"_cp{option.context_parallel}")


def gathered_layer_bytes(
    cost: SequenceCost, micro_batch: int, precision: str, tensor_parallel: int, degree: int
) -> float:
    """Bytes one layer's attention saves of the whole sequence under context parallel, beyond the part's own: the
    gathered keys and values of the other ranks' positions and the mask from this rank's s/c queries to all s keys,
    both in the compute dtype `precision` gives."""
    element, _ = activation_bytes(precision)
    s, b, t = cost.sequence_length, micro_batch, tensor_parallel
    keys_values = element * b * (s - s // degree) * 2 * cost.kv_width / t
    return keys_values + element * (s // degree) * s


def split_sequence(
    cost: ModelCost,
    option: PlanOption,
    micro_batch: int,
    pieces: int,
    precision: str,
    tensor_parallel: int,
    sixteen_bit: bool,
) -> SplitSequence | None:
    """What one rank of the option holds under context parallel for a micro-batch run in `pieces` pieces (a
    pipeline's; 1 otherwise): the task's activations at s/c positions, each piece's boolean mask (s/c x s, an input
    of every block), and what a layer's attention makes again in backward (its gathered keys and values and SDPA's
    float mask, `gathered_layer_bytes`); None without context parallel or a sequence."""
    degree = option.context_parallel
    if degree == 1 or not isinstance(cost, SequenceCost):
        return None
    part = dataclasses.replace(cost, sequence_length=cost.sequence_length // degree)  # type: ignore[type-var]
    own = part.activations(micro_batch, precision, tensor_parallel, sixteen_bit)
    blocks = "bf16-true" if sixteen_bit and precision in MIXED else precision
    transient = gathered_layer_bytes(cost, micro_batch // pieces, blocks, tensor_parallel, degree)
    return SplitSequence(degree, own, cost.sequence_length // degree * cost.sequence_length, transient)


def activations(
    cost: ModelCost, option: PlanOption, micro_batch: int, precision: str, tensor_parallel: int, sixteen_bit: bool
) -> Activations:
    """The task's activations for one rank of the option; under context parallel at s/c positions, with the mask held
    once and one layer's gathered keys, values and float mask while backward recomputes it (`split_sequence`)."""
    split = split_sequence(cost, option, micro_batch, 1, precision, tensor_parallel, sixteen_bit)
    if split is None:
        return cost.activations(micro_batch, precision, tensor_parallel, sixteen_bit)
    return split.added_to(split.own, 1)


def gathered_elements(cost: ModelCost, option: PlanOption, micro_batch: int) -> float:
    """Elements a rank sends per micro-batch of its group: each layer's gathers of keys and values, in forward and again
    when backward recomputes the attention (its own checkpoint, or its block's), and the reduce-scatters of their
    gradients, each of b x s x kv_width / t elements of which (c - 1) / c cross; 0 without context parallel."""
    degree = option.context_parallel
    if degree == 1 or not isinstance(cost, SequenceCost):
        return 0.0
    per_collective = micro_batch * cost.sequence_length * cost.kv_width / option.tensor_parallel
    collectives = COLLECTIVES_PER_LAYER * cost.n_layer
    return collectives * per_collective * (degree - 1) / degree


def gather_seconds(inputs: Inputs, option: PlanOption, micro_batch: int) -> float:
    """Seconds one optimizer step spends in the gathers and reduce-scatters (on its critical path): the group runs c x t
    micro-batches per data-parallel rank for each of the recipe's accumulated ones (plan.py's `communication`), in
    the compute dtype, over the node's links when its c x t neighbouring ranks fit in a node, else over the rank's share
    of the network link."""
    sent = gathered_elements(inputs.cost, option, micro_batch)
    if sent == 0:
        return 0.0
    micro_batches = inputs.grad_accum * option.context_parallel * option.tensor_parallel
    element = 4 if inputs.precision == "32-true" else 2
    intra = inputs.gpu.intra_node_gb_s * GB
    across = min(intra, inputs.inter_node_gb_s * GB / inputs.devices) if inputs.num_nodes > 1 else intra
    link = intra if inputs.devices % (option.context_parallel * option.tensor_parallel) == 0 else across
    return sent * micro_batches * element / link


def describe(inputs: Inputs, option: PlanOption, micro_batch: int) -> str | None:
    """Plan's line on an option's context parallel: the part of each sequence a rank holds, the elements gathered per
    layer and micro-batch, and their seconds per step; None without it."""
    cost, degree = inputs.cost, option.context_parallel
    if degree == 1 or not isinstance(cost, SequenceCost):
        return None
    gathered = micro_batch * cost.sequence_length * cost.kv_width / option.tensor_parallel
    return (
        f"{option.name}: each rank holds {cost.sequence_length // degree:,} of every {cost.sequence_length:,} tokens;"
        f" per layer and micro-batch it gathers keys and values of {gathered:.3g} elements each and reduce-scatters"
        f" their gradients ({COLLECTIVES_PER_LAYER} collectives, {(degree - 1) / degree:.0%} of each crossing):"
        f" {gather_seconds(inputs, option, micro_batch):.3g} s per step on the critical path"
    )


def context_collectives(
    cost: ModelCost, option: PlanOption, micro_batches: int, layers: int | None = None
) -> dict[str, int]:
    """The gathers of one optimizer step by the names `rehearse` counts: per layer and micro-batch an `allgather` of
    the keys and one of the values, both again when backward recomputes the attention (or its checkpointed block),
    and in backward a `reduce_scatter` of each one's gradient; with example ids, one `allgather` of them per
    micro-batch (for the mask; a few bytes a token, left out of the communication time). Under a pipeline: per
    piece, over `layers`, its stages' blocks."""
    if option.context_parallel == 1:
        return {}
    documents, layers = int(isinstance(cost, SequenceCost) and cost.document_ids), layers or cost.n_layer
    return {
        "allgather": (GATHERS_PER_LAYER * layers + documents) * micro_batches,
        "reduce_scatter": REDUCE_SCATTERS_PER_LAYER * layers * micro_batches,
    }


def recipe_option(option: PlanOption, strategy: Any) -> PlanOption:
    """A recipe's own plan option with its strategy's context-parallel degree (1 where it has none)."""
    return dataclasses.replace(option, context_parallel=getattr(strategy, "context_parallel_size", 1))


def write_degree(recipe: dict[str, Any], option: PlanOption) -> None:
    """Set the option's context-parallel degree in the written recipe `recipe` (a plain dict), where it splits."""
    if option.context_parallel == 1:
        return
    *sections, name = field_path(Fsdp2Options, "context_parallel_size").split(".")
    for section in sections:
        recipe = recipe.setdefault(section, {})
    recipe[name] = option.context_parallel


def longest_context(inputs: Inputs, fitting: Callable[[Inputs], str | None]) -> tuple[int, str] | None:
    """(the longest sequence of LENGTHS, the candidate) that fits one sample per micro-batch on the layout, asked of
    `fitting` (the plan's first fitting candidate's name, or None); None without a sequence or when none fits."""
    if not isinstance(inputs.cost, SequenceCost):
        return None
    found = None
    for length in LENGTHS:
        cost = dataclasses.replace(inputs.cost, sequence_length=length)  # type: ignore[type-var]
        parameters = inputs.parameters + cost.parameters() - inputs.cost.parameters()  # learned positions grow
        name = fitting(dataclasses.replace(inputs, cost=cost, parameters=parameters, micro_batch=1))
        if name is None:
            break
        found = (length, name)
    return found
