"""`plan`: the memory, communication and step time of every strategy for a model on a cluster, and the one to pick.

Torch-free: the numbers come from `precision` (the ZeRO paper's model states), the task's `ModelCost` (its size
formulas, tasks/base.py, or a rehearsal's measurement, measured.py), `hardware` (GPU memory, peak FLOP/s, links) and the
strategy families (strategies/*.py `plan_options`): each declares its candidates (ZeRO stage, tensor parallel, offload,
communication, why), the bytes its runtime adds and its `strategy:` section. This module knows no strategy by name.

Per device, each candidate holds:

    model states  the ZeRO paper's figure for its stage over its data-parallel ranks (offload: none on the GPU)
    runtime extra what the runtime adds to the paper (each family's `plan_runtime_terms`: gradient buckets,
                  gathered layers, fp32 gradient copies); `rehearse` measures paper + extra on fake tensors
    activations   with and without checkpointing; the total uses checkpointing only where it is needed

Communication per micro-batch step relative to ddp's gradient all-reduce (2 x parameters): 1x for ddp
and ZeRO 1-2, 1.5x for ZeRO-3 / FSDP2 (ZeRO paper, section 7), hsdp 1.5x inside a node plus 1/devices
across nodes, tensor parallel the all-reduces of s*b*h the task counts per layer (`tensor_parallel_all_reduces`). The step time is a
lower bound: max(FLOPs / peak, data-parallel bytes / bandwidth, host or NVMe traffic) + tensor-parallel
all-reduces (they sit on the critical path), for one optimizer step of the recipe's global batch; a pipeline
stage whose ranks fit in a node reduces over the node's links. A mixture of experts is also offered each
expert-parallel degree of an option that splits experts (experts.py: fewer experts gathered, all-to-alls of the
routed rows on the critical path), and a long sequence each context-parallel degree of an option that splits sequences
(context.py: activations of s/c positions, the keys and values all-gathered per layer on the critical path). The pick (`choose`): the first that fits in cost order (its quickest
expert- or context-parallel degree), or a pipeline or an expert-parallel degree whose bound is at most half of that one's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..precision import MIXED, States, zero_model_states
from ..recipe.schema import Recipe
from ..strategies import REGISTRY
from ..tasks.base import Activations, ModelCost
from . import context, experts
from .hardware import NVME_GB_S, PCIE_GB_S
from .inputs import Candidate, Device, Inputs
from .options import PlanSizes
from .pipeline import PipelineTerms, layout_problem, pipeline_terms, worst_rank
from .units import GB, size


def cost(candidate: Candidate) -> tuple[int, int, int, float, int, bool, int]:
    """Cheaper first: no host or NVMe traffic, then no tensor parallel (its all-reduces sit on the critical path),
    then fewer pipeline stages (a pipeline idles in its bubble), then less data-parallel communication (1x before 1.5x), a lower ZeRO stage, and hsdp before full sharding,
    since only a shard of the gradients crosses the nodes, then a lower expert-parallel degree (an option's degrees
    follow it: `choose` weighs them by time). Ties keep the registry's order (fsdp2 before zero3). Context-parallel
    degrees follow their option in `plan`'s list (context.py), the smallest first."""
    option = candidate.option
    return (
        ("none", "cpu", "nvme").index(option.offload),
        option.tensor_parallel,
        option.pipeline_parallel,
        option.comm_vs_ddp,
        option.stage,
        not option.hybrid,
        option.expert_parallel,
    )


STRATEGIES = [family(Recipe()) for family in REGISTRY.values()]  # their plan options need no recipe of their own
CANDIDATES = tuple(sorted((Candidate(s, option) for s in STRATEGIES for option in s.plan_options()), key=cost))


@dataclass(frozen=True)
class Estimate:
    """One candidate's bytes per device, communication and step-time bound."""

    candidate: Candidate
    unavailable: str | None  # why it cannot run this layout, or None
    states: States
    offloaded: float  # bytes per node in host RAM (cpu) or on NVMe (nvme)
    runtime_terms: tuple[tuple[str, float], ...]
    activations: Activations
    checkpointing: bool
    total: float
    fits: bool
    comm_vs_ddp: float
    step_seconds: float | None
    pipeline: PipelineTerms | None = None  # bubble, pieces held, p2p: pipeline candidates only
    sizes: PlanSizes | None = None  # what one rank holds before data-parallel sharding, and over how many ranks

    @property
    def runtime_extra(self) -> float:
        return sum(value for _, value in self.runtime_terms)


@dataclass(frozen=True)
class Plan:
    """Every estimate and the recommendation (None when nothing fits)."""

    inputs: Inputs
    estimates: list[Estimate]
    recommended: Estimate | None = None
    micro_batch: int = 0
    reason: str = ""
    longest_context: tuple[int, str] | None = None  # the longest sequence that fits the layout, and by which candidate


def plan_inputs(
    recipe: Any,
    cost: ModelCost,
    parameters: int,
    gpu: Device,
    inter_node_gb_s: float,
    margin: float,
    host_memory_bytes: float | None = None,
    trained_parameters: int | None = None,
) -> Inputs:
    """The plan's inputs from a resolved `Recipe` (layout, precision, batch), its task's `ModelCost` and the hardware;
    `trained_parameters`: how many of `parameters` train when only some do (`Task.trained_parameters`)."""
    return Inputs(
        cost=cost,
        task=recipe.task,
        parameters=parameters,
        precision=recipe.precision,
        devices=recipe.devices,
        num_nodes=recipe.num_nodes,
        micro_batch=recipe.train.micro_batch_size,
        grad_accum=recipe.train.grad_accum_steps,
        gpu=gpu,
        inter_node_gb_s=inter_node_gb_s,
        margin=margin,
        cpu=recipe.accelerator == "cpu",
        host_memory_bytes=host_memory_bytes,
        trained=trained_parameters / parameters if trained_parameters else 1.0,
    )


def unavailable(candidate: Candidate, inputs: Inputs, micro_batch: int) -> str | None:
    """Why a candidate cannot run the layout (the recipe checks would refuse it), or None."""
    option, t = candidate.option, candidate.tensor_parallel
    if inputs.cpu and not option.runs_on_cpu:
        return f"{option.name} runs on GPUs only"
    if option.hybrid and inputs.num_nodes < 2:
        return f"{option.name} needs num_nodes >= 2"
    problem = inputs.cost.tensor_parallel_problem(t) if t > 1 else None  # what of the model it fails to divide
    if t > 1 and (inputs.devices % t or problem):
        return f"tensor parallel {t} must divide devices={inputs.devices}" + (f" and {problem}" if problem else "")
    if option.pipeline_parallel > 1 and (problem := layout_problem(option, inputs, micro_batch)):
        return problem
    refused = inputs.refused or {}
    name = context.base_name(option)  # a degree is refused where its option is
    return refused.get(name) or refused.get(name.removesuffix(f"_ep{option.expert_parallel}"))


def estimate(
    candidate: Candidate, inputs: Inputs, micro_batch: int, stage_rank: int | None = None, checkpointed: bool = False
) -> Estimate:
    """Bytes, communication and step time of one candidate at one micro-batch size (`checkpointed`: checkpointing
    whether needed or not); a pipeline's on pipeline rank `stage_rank`, else on its worst (pipeline.py's worst_rank)."""
    cost, precision, option, t = inputs.cost, inputs.precision, candidate.option, candidate.tensor_parallel
    scale = inputs.parameters / cost.parameters()  # a bare --parameters count on a reference shape
    local = cost.parameters(t) * scale  # parameters on one tensor-parallel rank
    layer = cost.layer_parameters(t) * scale
    root = local - cost.n_layer * layer
    pp = option.pipeline_parallel
    data_parallel = max(1, (inputs.devices if option.hybrid else inputs.world_size) // (t * pp))
    sixteen_bit = option.sixteen_bit_module and precision in MIXED
    pipeline = None
    whole = context.activations(cost, option, micro_batch, precision, t, sixteen_bit)  # a micro-batch, every layer
    if pp > 1:  # each piece one sample: the smallest bubble the micro-batch allows
        schedule, per_rank = option.pipeline_schedule, option.pipeline_stages_per_rank
        if stage_rank is None:
            return worst_rank(lambda rank, ckpt: estimate(candidate, inputs, micro_batch, rank, ckpt), pp)
        split = context.split_sequence(cost, option, micro_batch, micro_batch, precision, t, sixteen_bit)
        pipeline = pipeline_terms(cost, pp, schedule, per_rank, micro_batch, micro_batch, precision, t, sixteen_bit,
                                  stage_rank, split)  # fmt: skip
        local = pipeline.layers * layer + (root := pipeline.ends * scale)  # its blocks and its end, if any
    paper = zero_model_states(local, precision, option.stage, data_parallel, inputs.trained)
    apart = experts.not_gathered(cost, option, data_parallel) * scale  # expert parallel: experts a rank never gathers
    sizes = PlanSizes(local, layer - apart, root, precision, data_parallel, inputs.trained, apart, inputs.grad_accum)
    extra = candidate.strategy.plan_runtime_terms(option, sizes)
    offloaded = 0.0
    if option.offload != "none":  # the states (and what lives with the optimizer) leave the GPU, per node
        offloaded = (paper.total + sum(term.bytes for term in extra if term.with_optimizer)) * inputs.devices
        paper = States(0.0, 0.0, 0.0)
        extra = [term for term in extra if not term.with_optimizer]
    terms = tuple((term.label, term.bytes) for term in extra)
    acts = pipeline.activations if pipeline else whole
    base = paper.total + sum(value for _, value in terms)
    checkpointing = checkpointed or base + acts.peak > inputs.budget
    total = base + (acts.checkpointed_peak if checkpointing else acts.peak)
    why_not = unavailable(candidate, inputs, micro_batch)
    fits = why_not is None and total <= inputs.budget
    if option.offload == "cpu" and inputs.host_memory_bytes is not None:
        fits = fits and offloaded <= inputs.host_memory_bytes
    gathered = local - experts.expert_layers(cost) * apart
    comm, seconds = communication(candidate, inputs, micro_batch, gathered, data_parallel, checkpointing, pipeline)
    return Estimate(
        candidate, why_not, paper, offloaded, terms, acts, checkpointing, total, fits, comm, seconds, pipeline, sizes
    )


def communication(
    candidate: Candidate,
    inputs: Inputs,
    micro_batch: int,
    local: float,
    data_parallel: int,
    checkpointing: bool,
    pipeline: PipelineTerms | None = None,
) -> tuple[float, float | None]:
    """(volume per device relative to ddp, lower bound on the seconds of one optimizer step).

    Every candidate processes the same global batch: micro_batch x grad_accum samples per device,
    so a tensor-parallel group of t devices runs t times as many micro-batches per data-parallel rank.
    Sharded parameters are gathered again for every micro-batch; the gradients of ddp and ZeRO 1-2
    are reduced once per step. A pipeline of p stages likewise runs p times as many micro-batches per
    data-parallel rank, idles in its bubble, and sends activations between stages across nodes. Expert parallel
    exchanges each micro-batch's routed rows by all-to-all on the critical path (experts.py); context parallel, like
    tensor parallel, runs c times the micro-batches, each gathering keys and values on the critical path (context.py).
    """
    cost, option, t, p = inputs.cost, candidate.option, candidate.tensor_parallel, inputs.parameters

    def elements(micro_batches: int) -> tuple[float, float]:
        # A pipeline stage runs p times the micro-batches on 1/p of the layers: the same tensor-parallel volume.
        tensor = cost.tensor_parallel_elements(micro_batch) * micro_batches * (t - 1) / t / option.pipeline_parallel
        tensor /= option.context_parallel  # each micro-batch on 1/c of the positions
        # Unsharded parameters: the gradients are reduced once per step; sharded: gathered for every micro-batch
        # (two gathers of every weight, one reduction of the trained ones' gradients).
        reduced = inputs.trained if option.stage < 3 else (2 + inputs.trained) / 3
        data = option.comm_vs_ddp * 2 * local * reduced * (micro_batches if option.stage == 3 else 1)
        return data, tensor

    group = t * option.pipeline_parallel * option.context_parallel  # devices that share one rank's micro-batches
    p2p = pipeline.p2p_elements if pipeline else 0.0
    data, tensor = elements(group)
    across_nodes = 2 * local / inputs.devices if option.hybrid else 0.0  # the replicas' all-reduce
    rows = experts.exchanged_elements(cost, option, micro_batch, checkpointing)  # every routed row, kept ones too
    sent = rows * experts.sent_share(option)
    keys = context.gathered_elements(cost, option, micro_batch) * group  # the group's, as tensor's
    # one micro-batch per device, as in the ZeRO paper
    ratio = (data + across_nodes + tensor + p2p + sent + keys) / (2 * p)
    if inputs.cpu:
        return ratio, None
    data, tensor = elements(inputs.grad_accum * group)
    sixteen_bit = option.sixteen_bit_module and inputs.precision in MIXED
    collective_bytes = 2 if sixteen_bit or inputs.precision in ("bf16-true", "16-true") else 4
    if inputs.gpu.peak_tflops is None:
        return ratio, None
    samples = micro_batch * inputs.grad_accum
    flops = cost.training_flops_per_sample() * (p / cost.parameters()) * samples
    compute = flops * (4 / 3 if checkpointing else 1) / (inputs.gpu.peak_tflops * 1e12)
    if pipeline:  # the bubble idles; stages exchange activations over the links between nodes
        compute /= 1 - pipeline.bubble
    intra = inputs.gpu.intra_node_gb_s * GB
    across = min(intra, inputs.inter_node_gb_s * GB / inputs.devices) if inputs.num_nodes > 1 else intra
    # The pipeline is the mesh's outer dimension: when one stage's data x tensor parallel ranks fit in a node,
    # its gathers and reductions stay on the node's links and only the stages' activations cross nodes.
    stage_ranks = max(1, inputs.world_size // option.pipeline_parallel)  # 0 where the layout has too few ranks
    stage_in_a_node = pipeline is not None and inputs.devices % stage_ranks == 0
    data_link = intra if stage_in_a_node else across
    gradient_bytes = 4 if sixteen_bit and option.fp32_gradient_reduce else collective_bytes
    data_bytes: float = collective_bytes
    if option.stage == 3:  # per micro-batch two all-gathers of the parameters and one reduce-scatter of gradients
        data_bytes = (2 * collective_bytes + gradient_bytes) / 3
    if option.hybrid:  # the replicas all-reduce their gradient shard across nodes once per step
        network = data * data_bytes / intra + across_nodes * gradient_bytes / across
    else:
        network = data * data_bytes / data_link if data_parallel > 1 else 0.0
    host = 0.0
    micro_batches = inputs.grad_accum * group
    if option.offload == "cpu":  # parameters in twice per micro-batch (forward, backward), gradients out
        host = (2 * micro_batches + 1) * 2 * local / data_parallel / (PCIE_GB_S * GB)
    elif option.offload == "nvme":  # the node's drive reads and writes every rank's 16 bytes per parameter
        host = 2 * 16 * local / data_parallel * inputs.devices / (NVME_GB_S * GB)
    activation_bytes = 4 if inputs.precision == "32-true" else 2
    network += p2p * inputs.grad_accum * activation_bytes / across
    exchange = experts.exchange_seconds(
        rows * inputs.grad_accum * activation_bytes, option, inputs.devices, intra, across
    )
    keys_seconds = context.gather_seconds(inputs, option, micro_batch)
    return ratio, max(compute, network, host) + tensor * activation_bytes / intra + exchange + keys_seconds


def plan(inputs: Inputs) -> Plan:
    """Every candidate (with a mixture of experts' expert-parallel degrees, a long sequence's context-parallel ones) at
    the recipe's micro batch, and the cheapest that fits (in CANDIDATES order, without activation checkpointing if any
    fits so); when none fits, the micro batch is halved until one does. With a sequence, the longest that fits."""
    result = plan_at(inputs)
    return dataclasses.replace(result, longest_context=context.longest_context(inputs, fitting_name))


def fitting_name(inputs: Inputs) -> str | None:
    """The name of the candidate `plan_at` recommends at the inputs' micro batch, or None when none fits at it."""
    result = plan_at(inputs)
    fits = result.recommended is not None and result.micro_batch == inputs.micro_batch
    return result.recommended.candidate.name if fits and result.recommended else None


def plan_at(inputs: Inputs) -> Plan:
    """`plan` without the search for the longest context."""
    candidates = context.with_degrees(experts.with_degrees(CANDIDATES, inputs), inputs)
    micro_batch = inputs.micro_batch
    estimates = first = [estimate(candidate, inputs, micro_batch) for candidate in candidates]
    while True:
        fitting = [e for e in estimates if e.fits]
        if fitting or micro_batch == 1:
            break
        micro_batch = max(1, micro_batch // 2)
        estimates = [estimate(candidate, inputs, micro_batch) for candidate in candidates]
    if not fitting:
        return Plan(inputs, first, reason=nothing_fits(first, inputs))
    best, cheapest = choose(fitting, inputs.devices)
    if micro_batch != inputs.micro_batch:
        first = [e if e.candidate != best.candidate else best for e in first]
    return Plan(inputs, first, best, micro_batch, reason(best, inputs, micro_batch, cheapest))


QUICKER = 2.0  # how much quicker a pipeline's or an expert-parallel degree's bound must be to pass over the cheapest


def choose(fitting: list[Estimate], devices: int) -> tuple[Estimate, Estimate]:
    """(the recommendation, the cheapest that fits), from `fitting` in candidate order. Recomputing activations costs
    a third more compute: only candidates without it if any fits so, the first in cost order (a pipeline: its layout's
    quickest schedule; sequences split: the quickest degree, checkpointed or not; experts split: the quickest degree, 1
    included, by the step bound or else the volume, ties to groups inside a node of `devices`, then the smaller). A pipeline or an
    expert-parallel degree that fits is taken instead when its step-time bound is QUICKER times the cheapest's or
    better: a pipeline's stages keep their gathers inside a node, so over slow links between nodes it can beat
    sharding across them; expert parallel gathers a layer's local experts only. The bound ignores how well
    communication overlaps and what a schedule costs beyond its bubble."""
    order = {e.candidate.name: index for index, e in enumerate(fitting)}
    tier = sorted((e for e in fitting if e.checkpointing == min(e.checkpointing for e in fitting)),
                  key=lambda e: order[e.candidate.name])  # fmt: skip

    def quickest(estimates: list[Estimate]) -> Estimate:
        return min(estimates, key=lambda e: (
            e.comm_vs_ddp if e.step_seconds is None else e.step_seconds,
            experts.spans_nodes(e.candidate.option, devices), order[e.candidate.name]))  # fmt: skip

    cheapest = tier[0]
    best = context.quickest_degree(cheapest, fitting)  # a context-parallel degree: the quickest, checkpointed or not
    if best is cheapest and (option := cheapest.candidate.option).splits_experts:
        best = quickest([e for e in tier if experts.same_but_degree(e.candidate.option, option)])
    if best is not cheapest:
        return best, cheapest
    if cheapest.step_seconds is None:
        return cheapest, cheapest
    if cheapest.pipeline is not None:  # the same layout under its quickest schedule that fits
        same = [e for e in tier if e.pipeline and e.candidate.option.layout() == cheapest.candidate.option.layout()]
        return quickest(same), cheapest
    rivals = [e for e in tier if (e.pipeline or e.candidate.option.expert_parallel > 1) and e.step_seconds is not None]
    best = quickest(rivals) if rivals else cheapest
    if best.step_seconds is not None and best.step_seconds * QUICKER <= cheapest.step_seconds:
        return best, cheapest
    return cheapest, cheapest


def reason(best: Estimate, inputs: Inputs, micro_batch: int, cheapest: Estimate | None = None) -> str:
    """One sentence: why this candidate (its family's `why`, filled in, and what it is quicker than)."""
    option = best.candidate.option
    why = option.why.format(
        device=device_word(inputs),
        devices=inputs.devices,
        device_plural=device_word(inputs, plural=True),
        offloaded=size(best.offloaded),
        tensor_parallel=option.tensor_parallel,
        layer_activations=size(inputs.cost.layer_activations(micro_batch, inputs.precision)),
        pipeline_parallel=option.pipeline_parallel,
        bubble=f"{best.pipeline.bubble:.0%}" if best.pipeline else "none",
        schedule=option.pipeline_schedule,
        expert_parallel=option.expert_parallel,
        context_parallel=option.context_parallel,
    )
    how = "with activation checkpointing" if best.checkpointing else "without activation checkpointing"
    batch = f"micro batch {micro_batch}" + (
        f" (halved from {inputs.micro_batch})" if micro_batch != inputs.micro_batch else ""
    )
    fits = f"({size(best.total)} of {size(inputs.budget)} per {device_word(inputs)}, {how}, {batch})"
    if cheapest is None or cheapest is best:
        return f"{option.name} is the cheapest that fits {fits}: {why}."
    if best.step_seconds is None or cheapest.step_seconds is None:  # no step bound: weighed by volume
        return (
            f"{option.name} fits {fits} and moves {best.comm_vs_ddp:.2f}x ddp's volume against"
            f" {cheapest.comm_vs_ddp:.2f}x for {cheapest.candidate.name}, the cheapest that fits: {why}."
        )
    return (
        f"{option.name} fits {fits} and its step is bound at {best.step_seconds:.2f} s against"
        f" {cheapest.step_seconds:.2f} s for {cheapest.candidate.name}, the cheapest that fits: {why}."
    )


def nothing_fits(estimates: list[Estimate], inputs: Inputs) -> str:
    """What to change when no candidate fits even at micro batch 1."""
    smallest = min((e for e in estimates if e.unavailable is None), key=lambda e: e.total)
    return (
        f"nothing fits: the smallest is {smallest.candidate.name} at {size(smallest.total)} per"
        f" {device_word(inputs)} ({size(inputs.budget)} usable); add {device_word(inputs, plural=True)} or nodes, make the"
        " samples smaller (a shorter sequence, a smaller image), or use GPUs with more memory"
    )


def device_word(inputs: Inputs, plural: bool = False) -> str:
    """What one device is called: GPU, or CPU process for CPU recipes."""
    word = "CPU process" if inputs.cpu else "GPU"
    return word + ("es" if inputs.cpu else "s") if plural else word
