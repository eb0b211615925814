"""What `plan` weighs, in the planner's own types: a strategy family describes its ways of holding the training
state as `PlanOption`s and adds its runtime's bytes as `PlanTerm`s computed from `PlanSizes`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PlanOption:
    """One way a strategy family can hold the training state, as `plan` weighs it (plan.py has the formulas)."""

    name: str  # the candidate's name in plan's table and JSON: "zero3_offload"
    stage: int  # the ZeRO stage its model states follow: 0 replicated, 1 optimizer state, 2 + gradients, 3 + parameters
    why: str  # the sentence when it is recommended; may name {device}, {devices} and {offloaded}
    comm_vs_ddp: float = 1.0  # data-parallel volume per micro-batch vs ddp's all-reduce (ZeRO paper, section 7)
    tensor_parallel: int = 1  # devices that split each layer
    offload: str = "none"  # none | cpu | nvme: where parameters and optimizer state live
    hybrid: bool = False  # sharded inside a node, replicated across nodes (needs num_nodes >= 2)
    runs_on_cpu: bool = True
    sixteen_bit_module: bool = False  # mixed precision runs a 16-bit copy of the module: activations, collectives
    fp32_gradient_reduce: bool = False  # a 16-bit module whose gradients are still reduced in fp32 (fully_shard's)
    pipeline_parallel: int = 1  # stages the blocks are split into, one group of devices each
    pipeline_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B | InterleavedZeroBubble | ZBVZeroBubble
    pipeline_stages_per_rank: int = 1
    splits_experts: bool = False  # can split a mixture of experts' experts over its data-parallel ranks
    expert_parallel: int = 1  # data-parallel ranks that split each layer's experts (rows reach them by all-to-all)
    context_parallel: int = (
        1  # data-parallel ranks that split every sequence (keys and values reach them by all-gather)
    )

    def layout(self) -> tuple[int, int]:
        """(pipeline, tensor parallel) sizes: options that differ only in their schedule share a layout."""
        return self.pipeline_parallel, self.tensor_parallel


@dataclass(frozen=True)
class PlanSizes:
    """What an option's runtime terms are computed from: parameters on one device, and the run."""

    parameters: float  # on one tensor-parallel rank
    layer: float  # of one layer on it: what a sharded runtime gathers at a time
    root: float  # outside the layers (embeddings, final norm, head)
    precision: str
    data_parallel: int  # ranks the model states are sharded over
    trained: float = 1.0  # the share of the parameters that train (adapters: a small one), the rest frozen
    apart: float = 0.0  # of one layer, what the rank never gathers (other groups' experts): layer + apart is all of it
    micro_batches: int = 1  # per optimizer step

    @property
    def gathered_blocks(self) -> float:
        """Parameters of the rank's blocks it gathers: all but the root, less the experts of other groups."""
        blocks = self.parameters - self.root
        return blocks * self.layer / (self.layer + self.apart) if self.apart else blocks


@dataclass(frozen=True)
class PlanTerm:
    """Bytes a runtime holds beyond the ZeRO paper's model states, per device."""

    label: str
    bytes: float
    with_optimizer: bool = False  # offloaded with the optimizer state when the option offloads


@dataclass(frozen=True)
class RankStep:
    """What one rank runs in one optimizer step, as far as its collectives go."""

    blocks: int  # the blocks it holds: every block without a pipeline
    micro_batches: int
    expert_units: int = 0  # blocks whose experts the runtime shards as units of their own (planner/experts.py)
    expert_mesh: bool = False  # the experts' gradients lie on a mesh of their own (fully_shard.py's shard_experts)
    ends: int = 1  # modules outside the blocks holding parameters: the root; under a pipeline its stages' first/last
    pieces: int = 1  # a pipeline's pieces per micro-batch
    boundaries: int = 0  # stage boundaries between its stages and another rank's
    zero_bubble: bool = False  # a schedule that keeps the blocks gathered until its last backward
    clipped: bool = True  # the step clips the gradients' norm
    checkpointed: int = 0  # blocks whose forward backward recomputes

    @property
    def passes(self) -> int:
        """Pieces through the rank's blocks per step."""
        return self.micro_batches * self.pieces
