"""`plan`: the memory, communication and step time of every strategy for a model on a cluster, and the one to pick.

Torch-free: the numbers come from `sizing` (the ZeRO paper's model states, Korthikanti et al.'s
activations, this project's own model and runtimes) and `hardware` (GPU memory, peak FLOP/s, links).

Per device, each candidate holds:

    model states  the ZeRO paper's figure for its stage over its data-parallel ranks (offload: none on the GPU)
    runtime extra what the runtime adds to the paper (each term below), so the paper column can be checked
                  against the paper and paper + extra against a measured run:
      ddp            DDP's gradient buckets, a second copy of the gradients (Fabric's DDP keeps
                     gradient_as_bucket_view off)
      fsdp2, hsdp,   the gathered layer (current and prefetched) in the parameters' dtype, fp32 under
      fsdp2_tpN      bf16-mixed (autocast, no MixedPrecisionPolicy), its unsharded gradient before the
                     reduce-scatter, and the root (embeddings, head), kept gathered for the whole step
      zero1          DeepSpeed's bf16 optimizer accumulates gradients in fp32 for the whole model
      zero2, zero3,  an fp32 copy of the rank's gradient partition (bf16 runs)
      offload
      zero1, zero2   overlap_comm's buckets: 4.5 x (reduce + all-gather bucket, 5e8 elements each)
      zero3, offload two gathered layers in bf16 (current and prefetched) and the reduce bucket
    activations   with and without checkpointing; the total uses checkpointing only where it is needed

Communication per micro-batch step relative to ddp's gradient all-reduce (2 x parameters): 1x for ddp
and ZeRO 1-2, 1.5x for ZeRO-3 / FSDP2 (ZeRO paper, section 7), hsdp 1.5x inside a node plus 1/devices
across nodes, tensor parallel four all-reduces of s*b*h per layer per micro-batch. The step time is a
lower bound: max(FLOPs / peak, data-parallel bytes / bandwidth, host or NVMe traffic) + tensor-parallel
all-reduces (they sit on the critical path), for one optimizer step of the recipe's global batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from {{ cookiecutter.package_name }}.hardware import NVME_GB_S, PCIE_GB_S, Gpu
from {{ cookiecutter.package_name }}.sizing import (
    MIXED,
    Activations,
    Shape,
    States,
    activations,
    count_parameters,
    gpt_shape,
    layer_activations,
    layer_parameters,
    torch_model_states,
    training_flops_per_token,
    zero_model_states,
)

GIB, GB = 2**30, 1e9
DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce / all-gather bucket, in elements


@dataclass(frozen=True)
class Candidate:
    """One strategy the plan weighs."""

    name: str
    family: str  # ddp | deepspeed | fsdp2 | hsdp
    stage: int  # the ZeRO stage its model states follow (ddp 0, fully_shard 3)
    tensor_parallel: int = 1
    offload: str = "none"  # none | cpu | nvme


# In order of cost: communication volume (1x, 1.5x, then tensor parallel's per-layer all-reduces), then
# host or NVMe traffic; hsdp before fsdp2 since only a shard of the gradients crosses the nodes.
CANDIDATES = (
    Candidate("ddp", "ddp", 0),
    Candidate("zero1", "deepspeed", 1),
    Candidate("zero2", "deepspeed", 2),
    Candidate("hsdp", "hsdp", 3),
    Candidate("fsdp2", "fsdp2", 3),
    Candidate("zero3", "deepspeed", 3),
    Candidate("fsdp2_tp2", "fsdp2", 3, 2),
    Candidate("fsdp2_tp4", "fsdp2", 3, 4),
    Candidate("fsdp2_tp8", "fsdp2", 3, 8),
    Candidate("zero3_offload", "deepspeed", 3, offload="cpu"),
    Candidate("zero3_nvme", "deepspeed", 3, offload="nvme"),
)


@dataclass(frozen=True)
class Inputs:
    """What the plan is asked about: a model, a layout, a device and its links."""

    shape: Shape
    parameters: int
    precision: str
    devices: int
    num_nodes: int
    micro_batch: int
    grad_accum: int
    gpu: Gpu
    inter_node_gb_s: float
    margin: float = 0.1
    cpu: bool = False
    host_memory_bytes: float | None = None

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def budget(self) -> float:
        return self.gpu.memory_bytes * (1 - self.margin)


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
    notes: list[str] = field(default_factory=list)


def plan_inputs(
    recipe: Any,
    parameters: int,
    gpu: Gpu,
    inter_node_gb_s: float,
    margin: float,
    host_memory_bytes: float | None = None,
) -> Inputs:
    """The plan's inputs from a resolved `Recipe` (model, layout, precision, batch) and the hardware."""
    return Inputs(
        shape=gpt_shape(recipe.model),
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
    )


def unavailable(candidate: Candidate, inputs: Inputs) -> str | None:
    """Why a candidate cannot run the layout (the recipe checks would refuse it), or None."""
    t, shape = candidate.tensor_parallel, inputs.shape
    if candidate.family == "deepspeed" and inputs.cpu:
        return "DeepSpeed runs on GPUs only"
    if candidate.family == "hsdp" and inputs.num_nodes < 2:
        return "hsdp needs num_nodes >= 2"
    if t > 1 and (inputs.devices % t or shape.n_head % t or shape.n_kv_head % t):
        return f"tensor parallel {t} must divide devices={inputs.devices} and the heads"
    return None


def estimate(candidate: Candidate, inputs: Inputs, micro_batch: int) -> Estimate:
    """Bytes, communication and step time of one candidate at one micro-batch size."""
    shape, precision, t = inputs.shape, inputs.precision, candidate.tensor_parallel
    scale = inputs.parameters / count_parameters(shape)  # a bare --parameters count on a reference shape
    local = count_parameters(shape, t) * scale  # parameters on one tensor-parallel rank
    layer = layer_parameters(shape, t) * scale
    data_parallel = max(1, (inputs.devices if candidate.family == "hsdp" else inputs.world_size) // t)
    deepspeed = candidate.family == "deepspeed"
    paper = zero_model_states(local, precision, candidate.stage, data_parallel)
    mixed = precision in MIXED
    terms: list[tuple[str, float]] = []
    if candidate.family == "ddp":
        terms.append(("DDP gradient buckets", torch_model_states(local, precision, 0, 1).gradients))
    elif not deepspeed:
        weight = torch_model_states(1, precision, 0, 1).parameters
        root = local - shape.n_layer * layer
        terms += [
            ("gathered layer, current and prefetched", 2 * weight * layer),
            ("its unsharded gradient", weight * layer),
            ("root (embeddings, head) gathered for the step", weight * root * (1 - 1 / data_parallel)),
        ]
    else:
        grad = 4 if precision == "32-true" else 2  # DeepSpeed keeps 16-bit parameters and gradients
        if mixed and candidate.stage == 1:
            terms.append(("fp32 gradient accumulation (bf16 optimizer)", 4 * local))
        elif mixed and candidate.offload == "none":  # offloaded: the partition lives with the optimizer
            terms.append(("fp32 gradient partition", 4 * local / data_parallel))
        if candidate.stage < 3:
            terms.append(("overlap_comm buckets", 4.5 * 2 * min(DEEPSPEED_BUCKET, local) * grad))
        else:
            terms += [("gathered layers, current and prefetched", 2 * grad * layer)]
            terms += [("reduce bucket", min(DEEPSPEED_BUCKET, local) * grad)]
    offloaded = 0.0
    if candidate.offload != "none":
        offloaded = (paper.total + (4 * local / data_parallel if mixed else 0)) * inputs.devices
        paper = States(0.0, 0.0, 0.0)
    act_precision = "bf16-true" if deepspeed and mixed else precision  # DeepSpeed runs the module in bf16
    acts = activations(shape, micro_batch, act_precision, t)
    base = paper.total + sum(value for _, value in terms)
    checkpointing = base + acts.held > inputs.budget
    total = base + (acts.checkpointed_peak if checkpointing else acts.held)
    why_not = unavailable(candidate, inputs)
    fits = why_not is None and total <= inputs.budget
    if candidate.offload == "cpu" and inputs.host_memory_bytes is not None:
        fits = fits and offloaded <= inputs.host_memory_bytes
    comm, seconds = communication(candidate, inputs, micro_batch, local, data_parallel, checkpointing)
    return Estimate(candidate, why_not, paper, offloaded, tuple(terms), acts, checkpointing, total, fits, comm, seconds)


def communication(
    candidate: Candidate, inputs: Inputs, micro_batch: int, local: float, data_parallel: int, checkpointing: bool
) -> tuple[float, float | None]:
    """(volume per device relative to ddp, lower bound on the seconds of one optimizer step).

    Every candidate processes the same global batch: micro_batch x grad_accum sequences per device,
    so a tensor-parallel group of t devices runs t times as many micro-batches per data-parallel rank.
    Sharded parameters are gathered again for every micro-batch; the gradients of ddp and ZeRO 1-2
    are reduced once per step.
    """
    shape, t, p = inputs.shape, candidate.tensor_parallel, inputs.parameters

    def elements(micro_batches: int) -> tuple[float, float]:
        tokens = shape.sequence_length * micro_batch * micro_batches
        tensor = 8 * shape.n_layer * tokens * shape.n_embd * (t - 1) / t  # 4 all-reduces per layer
        data = 2 * local if candidate.stage < 3 else 3 * local * micro_batches
        return data, tensor

    data, tensor = elements(t)
    across_nodes = 2 * local / inputs.devices if candidate.family == "hsdp" else 0.0  # the replicas' all-reduce
    ratio = (data + across_nodes + tensor) / (2 * p)  # one micro-batch per device, as in the ZeRO paper
    if inputs.cpu:
        return ratio, None
    data, tensor = elements(inputs.grad_accum * t)
    collective_bytes = 4 if inputs.precision == "32-true" or candidate.family != "deepspeed" else 2
    if inputs.precision in ("bf16-true", "16-true"):
        collective_bytes = 2
    tokens = shape.sequence_length * micro_batch * inputs.grad_accum
    flops = training_flops_per_token(shape) * (p / count_parameters(shape)) * tokens
    compute = flops * (4 / 3 if checkpointing else 1) / (inputs.gpu.peak_tflops(inputs.precision) * 1e12)
    intra = inputs.gpu.intra_node_gb_s * GB
    across = min(intra, inputs.inter_node_gb_s * GB / inputs.devices) if inputs.num_nodes > 1 else intra
    if candidate.family == "hsdp":  # the replicas all-reduce their shard across nodes once per step
        network = data * collective_bytes / intra + across_nodes * collective_bytes / across
    else:
        network = data * collective_bytes / across if data_parallel > 1 else 0.0
    host = 0.0
    micro_batches = inputs.grad_accum * t
    if candidate.offload == "cpu":  # parameters in twice per micro-batch (forward, backward), gradients out
        host = (2 * micro_batches + 1) * 2 * local / data_parallel / (PCIE_GB_S * GB)
    elif candidate.offload == "nvme":  # the node's drive reads and writes every rank's 16 bytes per parameter
        host = 2 * 16 * local / data_parallel * inputs.devices / (NVME_GB_S * GB)
    activation_bytes = 4 if inputs.precision == "32-true" else 2
    return ratio, max(compute, network, host) + tensor * activation_bytes / intra


def plan(inputs: Inputs) -> Plan:
    """Every candidate at the recipe's micro batch, and the cheapest that fits (in CANDIDATES order, without
    activation checkpointing if any fits so); when none fits, the micro batch is halved until one does."""
    micro_batch = inputs.micro_batch
    first = [estimate(candidate, inputs, micro_batch) for candidate in CANDIDATES]
    estimates = first
    while True:
        fitting = [e for e in estimates if e.fits]
        if fitting or micro_batch == 1:
            break
        micro_batch = max(1, micro_batch // 2)
        estimates = [estimate(candidate, inputs, micro_batch) for candidate in CANDIDATES]
    if not fitting:
        return Plan(inputs, first, reason=nothing_fits(first, inputs))
    # Recomputing activations costs a third more compute: the cheapest without it, else the cheapest with it.
    order = {candidate.name: index for index, candidate in enumerate(CANDIDATES)}
    best = min(fitting, key=lambda e: (e.checkpointing, order[e.candidate.name]))
    if micro_batch != inputs.micro_batch:
        first = [e if e.candidate != best.candidate else best for e in first]
    return Plan(inputs, first, best, micro_batch, reason(best, estimates, inputs, micro_batch))


REASONS = {
    "ddp": "every {device} holds the whole model, its optimizer state and activations, so nothing needs sharding",
    "zero1": "sharding the optimizer state alone makes it fit, at ddp's communication volume",
    "zero2": "sharding the optimizer state and gradients makes it fit, at ddp's communication volume",
    "fsdp2": "the parameters must be sharded too (1.5x ddp's communication); fsdp2 is the default for that",
    "zero3": "the parameters must be sharded too (1.5x ddp's communication)",
    "hsdp": "sharding inside a node is enough, so only 1/{devices} of the gradients crosses the links between nodes",
    "zero3_offload": "only with parameters and optimizer state in host RAM ({offloaded} per node) does it fit",
    "zero3_nvme": "only with parameters and optimizer state on NVMe ({offloaded} per node) does it fit",
}


def reason(best: Estimate, estimates: list[Estimate], inputs: Inputs, micro_batch: int) -> str:
    """One sentence: why this candidate."""
    name = best.candidate.name
    if best.candidate.tensor_parallel > 1:
        why = (
            f"one layer's activations ({size(layer_activations(inputs.shape, micro_batch, inputs.precision))})"
            f" do not fit beside the sharded states; splitting each layer over {best.candidate.tensor_parallel}"
            f" {device_word(inputs, plural=True)} does"
        )
    else:
        why = REASONS[name].format(device=device_word(inputs), devices=inputs.devices, offloaded=size(best.offloaded))
    how = "with activation checkpointing" if best.checkpointing else "without activation checkpointing"
    batch = f"micro batch {micro_batch}" + (
        f" (halved from {inputs.micro_batch})" if micro_batch != inputs.micro_batch else ""
    )
    return (
        f"{name} is the cheapest that fits ({size(best.total)} of {size(inputs.budget)} per {device_word(inputs)},"
        f" {how}, {batch}): {why}."
    )


def nothing_fits(estimates: list[Estimate], inputs: Inputs) -> str:
    """What to change when no candidate fits even at micro batch 1."""
    smallest = min((e for e in estimates if e.unavailable is None), key=lambda e: e.total)
    return (
        f"nothing fits: the smallest is {smallest.candidate.name} at {size(smallest.total)} per"
        f" {device_word(inputs)} ({size(inputs.budget)} usable); add {device_word(inputs, plural=True)} or nodes, shorten the"
        " sequence, or use GPUs with more memory"
    )


def device_word(inputs: Inputs, plural: bool = False) -> str:
    """What one device is called: GPU, or CPU process for CPU recipes."""
    word = "CPU process" if inputs.cpu else "GPU"
    return word + ("es" if inputs.cpu else "s") if plural else word


def size(value: float) -> str:
    """Bytes in the unit that keeps them readable: GiB, MiB or KiB (binary units, labelled)."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.1f} {unit}"
    return f"{value:.0f} B"


def count(value: float) -> str:
    """A parameter count: 1.42 B, 124.4 M, 812.5 K."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"
