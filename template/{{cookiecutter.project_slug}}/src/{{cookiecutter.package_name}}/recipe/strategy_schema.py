"""The `strategy:` section of a recipe (recipe/schema.py holds the rest): how the model and the work are spread over
devices, with one options section per strategy family. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .bounds import bounds

Offload = Literal["none", "cpu", "nvme"]


@dataclass
class Fsdp2Options:
    """Options of strategy.name fsdp2 and hsdp (torch's fully_shard through Fabric's ModelParallelStrategy).

    Args:
        tensor_parallel_size: Devices that split each layer (tensor parallel, inside a node); must
            divide devices. 1 turns tensor parallel off.
        float8: Train the blocks' linear layers in float8 with torchao (GPUs with compute
            capability 8.9 or newer: H100, L4, ...).
        cpu_offload: Keep parameters, gradients and optimizer state in host memory between uses
            (GPUs only; torch's CPUOffloadPolicy): a larger model on fewer GPUs, at some speed.
        pipeline_parallel_size: Pipeline stages the blocks are split into, each on its own group of
            devices (torch.distributed.pipelining); 1 turns pipeline parallel off. The mesh is
            (pipeline, data parallel, tensor parallel): devices x num_nodes = pp x dp x tp.
        pipeline_microbatches: Pieces each micro-batch is cut into and fed through the pipeline
            (divides train.micro_batch_size); more pieces, a smaller bubble.
        pipeline_schedule: GPipe, 1F1B, Interleaved1F1B (several stages per device), or the
            zero-bubble schedules InterleavedZeroBubble (one or more stages per device) and
            ZBVZeroBubble (two per device, in a V), which run each backward's weight half in the
            bubble and keep a stage's blocks gathered from forward to backward.
        pipeline_stages_per_rank: Stages each pipeline rank holds (1 for GPipe/1F1B, >= 2 for
            Interleaved1F1B, >= 1 for InterleavedZeroBubble, 2 for ZBVZeroBubble).
        pipeline_split: Blocks per stage, in order (sums to the number of blocks); empty: balanced by
            parameter count.
        context_parallel_size: Ranks that split every sequence of their shared samples (context parallel): each
            holds 2 of 2 x cp load-balanced chunks and attends over the keys and values gathered from the others.
            Divides the data-parallel ranks (hsdp: cp x tensor_parallel_size divides devices, a group inside a
            node); 2 x cp divides the sequence length. 1 turns it off.
        expert_parallel_size: Data-parallel ranks that split each mixture-of-experts layer's experts between them
            (each holds num_experts / ep; tokens reach their experts by all-to-all), sharded further over the ranks
            holding the same ones. Divides the data-parallel size (with context parallel: the data x context
            ranks; hsdp: the ranks of a node) and the model's experts; 1 turns it off.
    """

    tensor_parallel_size: int = field(default=1, metadata=bounds(at_least=1))
    float8: bool = False
    cpu_offload: bool = False
    pipeline_parallel_size: int = field(default=1, metadata=bounds(at_least=1))
    pipeline_microbatches: int = 4
    pipeline_schedule: Literal["GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"] = "1F1B"
    pipeline_stages_per_rank: int = 1
    pipeline_split: list[int] = field(default_factory=list)
    context_parallel_size: int = field(default=1, metadata=bounds(at_least=1))
    expert_parallel_size: int = field(default=1, metadata=bounds(at_least=1))


@dataclass
class FsdpOptions:
    """Options of strategy.name fsdp (FSDP1 through Fabric's FSDPStrategy; GPUs only).

    Args:
        sharding: FULL_SHARD (ZeRO-3-like), SHARD_GRAD_OP (ZeRO-2-like: parameters kept whole
            between forward and backward) or HYBRID_SHARD (shard inside a node, replicate across nodes).
        cpu_offload: Keep parameters, gradients and optimizer state in CPU memory.
    """

    sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] = "FULL_SHARD"
    cpu_offload: bool = False


@dataclass
class DeepSpeedOptions:
    """Options of strategy.name deepspeed (ZeRO through Fabric's DeepSpeedStrategy; GPUs only).

    Args:
        stage: ZeRO stage 1 (optimizer state sharded), 2 (+ gradients) or 3 (+ parameters).
        offload_optimizer: Where optimizer state lives: none (GPU), cpu, or nvme (stage 3 only;
            files under nvme_path).
        offload_parameters: Where parameters live between uses: none (GPU), cpu or nvme; stage 3 only.
        nvme_path: Folder on a local NVMe drive for nvme offload (required for it).
    """

    stage: Literal[1, 2, 3] = 2
    offload_optimizer: Offload = "none"
    offload_parameters: Offload = "none"
    nvme_path: str | None = None


@dataclass
class StrategyConfig:
    """How the model and the work are spread over devices.

    Options of one strategy family sit in a section named after it (`fsdp2:`, `fsdp:`,
    `deepspeed:`); a section of another family than `name` is refused, so no option is silently ignored.

    Args:
        name: ddp (every device holds the whole model; use when model + optimizer fit on one
            device), fsdp2 (parameters, gradients and optimizer state sharded per transformer block
            with torch's fully_shard), hsdp (fsdp2 sharded inside a node, replicated across nodes),
            fsdp (FSDP1 through Fabric's FSDPStrategy; GPUs only) or deepspeed (ZeRO through
            Fabric's DeepSpeedStrategy; GPUs only). The strategies/ package lists them.
        process_group_backend: Collective backend; null picks nccl on GPUs and gloo on CPUs.
        timeout_minutes: How long a collective may wait for the other ranks before the job fails.
        activation_checkpointing: Recompute each checkpointed block's activations in backward
            instead of keeping them: less memory, about a third more compute.
        activation_checkpointing_every: Checkpoint every k-th block (1: every block).
        activation_checkpointing_policy: What a checkpointed block recomputes: full (everything: it keeps only
            its input) or selective (per operation, as torchtitan's op policy: it keeps the attention outputs
            and every other matmul's output and recomputes the rest: more memory than full, less compute).
        compile: torch.compile each transformer block.
        meta_init: Build the model on the meta device and materialise it sharded, so a model
            larger than one process's memory can be built (fsdp2, hsdp, fsdp, deepspeed stage 3).
            The initial weights then differ from an ordinary build with the same seed; deepspeed
            stage 3 always builds the model partitioned (deepspeed.zero.Init), with the same weights.
        fsdp2: Options of fsdp2 and hsdp (tensor parallel, float8).
        fsdp: Options of fsdp (FSDP1 sharding, CPU offload).
        deepspeed: Options of deepspeed (ZeRO stage, offload).
    """

    name: str = "fsdp2"
    process_group_backend: Literal["nccl", "gloo"] | None = None
    timeout_minutes: int = field(default=30, metadata=bounds(at_least=1))
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = field(default=1, metadata=bounds(at_least=1))
    activation_checkpointing_policy: Literal["full", "selective"] = "full"
    compile: bool = False
    meta_init: bool = False
    fsdp2: Fsdp2Options | None = None
    fsdp: FsdpOptions | None = None
    deepspeed: DeepSpeedOptions | None = None


# The per-family options sections of StrategyConfig; at most the one of `name` may be set.
STRATEGY_SECTIONS = ("fsdp2", "fsdp", "deepspeed")
