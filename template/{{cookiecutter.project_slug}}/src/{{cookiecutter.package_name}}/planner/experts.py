"""Expert parallelism in `plan`: the degrees it offers a mixture of experts, what a degree saves and what it moves.

A degree e splits every mixture-of-experts layer's routed experts over groups of e neighbouring data-parallel ranks
(each group holds every expert once, each rank E/e of them), and the data-parallel ranks holding the same experts
shard them further, over data_parallel / e ranks. The task gives the sizes (`ExpertSizes`: the routed experts per
layer, the rows a sample routes to them). Against sharding alone, per rank:

    model states  the same: every parameter is still split over all the data-parallel ranks
    gathered      a layer's gather brings its E/e local experts only, and none when e is every data-parallel rank (they
                  are held whole): the runtime's gathered layer and the data-parallel volume lose the routed experts'
                  share (1 - 1/e), or all of it
    all-to-all    per mixture-of-experts layer and micro-batch, the rows a rank routes (its micro-batch's units x top_k,
                  each of the model's width) go to the ranks holding their experts and come back, in forward and again
                  in backward: 4 exchanges of rows x width elements in the compute dtype, after one small exchange of
                  the rows per expert (the counts). Activation checkpointing recomputes the forward: one more exchange
                  of counts and two more of rows per checkpointed layer.

The time of the exchanges assumes balanced routing (what load balancing aims at; a rehearsal assumes it too): a rank
keeps 1/e of its rows and sends 1/e to each other rank of its group. The experts wait for their rows, so the
exchanges sit on the step's critical path, added to its bound as tensor parallel's all-reduces are. Peers inside the
node are reached over the node's links, those on other nodes over the rank's share of the node's network link; the two
run at once, so the slower bounds the exchange. The degrees offered: each divisor > 1 of the experts that divides the
data x tensor-parallel ranks, for an option that splits experts (fsdp2's sharding, with tensor parallel or without:
the tensor-parallel ranks share out the routed rows and hold the experts as data-parallel ranks do; not under a
pipeline); plan recommends the quickest by its step bound (by communication volume where it has no bound), ties to
a group inside a node, then to the smaller degree.
"""

from __future__ import annotations

import dataclasses

from ..tasks.base import ExpertCost, ExpertSizes, ModelCost
from .inputs import Candidate, Inputs
from .options import PlanOption

WHY = (
    "each of {expert_parallel} {device_plural} holds 1/{expert_parallel} of every layer's experts and gathers only"
    " those; the rows routed to them cross by all-to-all, which costs less than gathering every expert"
)


def expert_sizes(cost: ModelCost) -> ExpertSizes | None:
    """The model's routed experts (the task's `ExpertCost`), or None for a dense model or a cost without them."""
    return cost.expert_sizes() if isinstance(cost, ExpertCost) else None


def degrees(experts: int, data_parallel: int) -> list[int]:
    """Expert-parallel degrees > 1 that divide both the experts and the data-parallel ranks."""
    return [d for d in range(2, min(experts, data_parallel) + 1) if experts % d == 0 and data_parallel % d == 0]


def with_degrees(candidates: tuple[Candidate, ...], inputs: Inputs) -> list[Candidate]:
    """`candidates`, each that splits experts followed by itself at every degree this model and layout allow (a
    dense model: none)."""
    sizes = expert_sizes(inputs.cost)
    offered = []
    for candidate in candidates:
        offered.append(candidate)
        if sizes is None or not candidate.option.splits_experts or (candidate.option.hybrid and inputs.num_nodes == 1):
            continue
        # hsdp: split inside a node; tensor parallel's ranks count as data-parallel ones for the experts
        ranks = inputs.devices if candidate.option.hybrid else inputs.world_size
        for degree in degrees(sizes.experts, ranks):
            name = f"{candidate.name}_ep{degree}"
            option = dataclasses.replace(candidate.option, name=name, expert_parallel=degree, why=WHY)
            offered.append(Candidate(candidate.strategy, option))
    return offered


def same_but_degree(one: PlanOption, other: PlanOption) -> bool:
    """Whether two options differ in their expert-parallel degree only."""

    def plain(option: PlanOption) -> PlanOption:
        return dataclasses.replace(option, name="", why="", expert_parallel=1)

    return plain(one) == plain(other)


def not_gathered(cost: ModelCost, option: PlanOption, data_parallel: int) -> float:
    """Parameters of one mixture-of-experts layer that a rank of this option never gathers: the other groups'
    experts, and its own too when they are held whole (the degree is every data-parallel rank)."""
    sizes = expert_sizes(cost)
    degree, tensor = option.expert_parallel, option.tensor_parallel
    if sizes is None or not sharded_apart(option):
        return 0.0
    gathered = 0.0 if data_parallel * tensor == degree else sizes.layer_parameters / degree
    return sizes.layer_parameters / tensor - gathered  # a layer on a tensor-parallel rank counts 1/t of them


def sharded_apart(option: PlanOption) -> bool:
    """Whether the runtime shards the experts apart from their blocks (fully_shard.py's shard_experts): under expert
    parallel, and under tensor parallel, whose ranks share out the routed rows and count as data-parallel ones for
    the experts (a rank gathers its group's experts whole, not 1/t of them)."""
    return option.expert_parallel > 1 or option.tensor_parallel > 1


def expert_layers(cost: ModelCost) -> int:
    """Layers holding a mixture of experts (0 for a dense model)."""
    sizes = expert_sizes(cost)
    return sizes.layers if sizes else 0


def exchanged_elements(cost: ModelCost, option: PlanOption, micro_batch: int, checkpointing: bool) -> float:
    """Elements a rank's row exchanges carry per micro-batch, its own share of the rows included (4 exchanges per
    layer, 6 when checkpointing recomputes the forward); 0 without expert parallel."""
    sizes = expert_sizes(cost)
    if sizes is None or option.expert_parallel == 1:
        return 0.0
    rows = sizes.row_elements_per_sample * micro_batch / option.tensor_parallel  # a tensor rank routes its share
    return (6 if checkpointing else 4) * sizes.layers * rows


def sent_share(option: PlanOption) -> float:
    """The share of a rank's rows that leave it under balanced routing: (e - 1) / e."""
    return (option.expert_parallel - 1) / option.expert_parallel


def exchange_seconds(total_bytes: float, option: PlanOption, devices: int, intra: float, across: float) -> float:
    """Seconds of row exchanges of `total_bytes` (every row, its own share included) over a group of e neighbouring
    ranks: the peers in the node over its links (bytes/s `intra`), the others over the network (`across`), at once."""
    degree = option.expert_parallel
    if degree == 1:
        return 0.0
    inside = min(degree, devices) if devices % degree == 0 or degree % devices == 0 else 1
    return max(total_bytes * (inside - 1) / degree / intra, total_bytes * (degree - inside) / degree / across)


def spans_nodes(option: PlanOption, devices: int) -> bool:
    """Whether the option's expert-parallel groups reach beyond a node."""
    return devices % option.expert_parallel != 0


def expert_collectives(
    cost: ModelCost, option: PlanOption, micro_batches: int, checkpointed_layers: int, layers: int | None = None
) -> dict[str, int]:
    """The exchanges of one optimizer step by the names `rehearse` counts: `alltoall` the counts, `all_to_all_single`
    the rows (with autograd), per layer and micro-batch (under a pipeline: per piece, `layers` its stages' of them);
    `checkpointed_layers` recompute their forward."""
    sizes = expert_sizes(cost)
    if sizes is None or option.expert_parallel == 1:
        return {}
    layers = sizes.layers if layers is None else layers
    forwards = (layers + checkpointed_layers) * micro_batches
    return {"alltoall": forwards, "all_to_all_single": 2 * forwards + 2 * layers * micro_batches}


def expert_units(cost: ModelCost, option: PlanOption, data_parallel: int) -> int:
    """Layers whose experts the runtime shards as units of their own: those of an expert-parallel option whose degree
    is fewer than the data-parallel ranks (held whole otherwise)."""
    held_whole = option.expert_parallel == data_parallel * option.tensor_parallel
    return expert_layers(cost) if sharded_apart(option) and not held_whole else 0


def replicated_expert_units(cost: ModelCost, option: PlanOption, data_parallel: int) -> int:
    """Under hsdp, the expert units all-reduced across the replica groups beyond `expert_units`: the experts are a
    unit of their own at any degree (fully_shard.py's shard_experts), so held whole in a node (the degree is all its
    `data_parallel` ranks) they gather and reduce-scatter nothing but are still all-reduced with their replicas."""
    if not option.hybrid or not sharded_apart(option):
        return 0
    return expert_layers(cost) - expert_units(cost, option, data_parallel)
