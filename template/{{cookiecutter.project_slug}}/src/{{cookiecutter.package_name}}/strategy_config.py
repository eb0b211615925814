"""The strategy part of a recipe: which strategy, its options, and which combinations can run.

`StrategyConfig` is the `strategy:` section of a recipe (config.py puts it in `Recipe`);
`check_strategy` refuses settings that do not fit together, with one line naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from {{ cookiecutter.package_name }}.errors import RecipeError

if TYPE_CHECKING:
    from {{ cookiecutter.package_name }}.config import Recipe

StrategyName = Literal["ddp", "fsdp2", "hsdp", "fsdp", "deepspeed"]
Offload = Literal["none", "cpu", "nvme"]
SHARDED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
# Fabric's ModelParallelStrategy (fully_shard, tensor parallel): runs on CPU (gloo) as well as GPUs.
MODEL_PARALLEL = ("fsdp2", "hsdp")
# Fabric refuses these on CPU: FSDPStrategy (FSDP1) and DeepSpeedStrategy need CUDA GPUs.
GPU_ONLY_STRATEGIES = ("fsdp", "deepspeed")


@dataclass
class StrategyConfig:
    """How the model and the work are spread over devices.

    Args:
        name: ddp (every device holds the whole model; use when model + optimizer fit on one
            device), fsdp2 (parameters, gradients and optimizer state sharded per transformer block
            with torch's fully_shard), hsdp (fsdp2 sharded inside a node, replicated across nodes),
            fsdp (FSDP1 through Fabric's FSDPStrategy; GPUs only) or deepspeed (ZeRO through
            Fabric's DeepSpeedStrategy; GPUs only).
        process_group_backend: Collective backend; null picks nccl on GPUs and gloo on CPUs.
        timeout_minutes: How long a collective may wait for the other ranks before the job fails.
        tensor_parallel_size: fsdp2/hsdp: devices that split each layer (tensor parallel, inside a
            node); must divide devices. 1 turns tensor parallel off.
        fsdp_sharding: fsdp: FULL_SHARD (ZeRO-3-like), SHARD_GRAD_OP (ZeRO-2-like: parameters
            kept whole between forward and backward) or HYBRID_SHARD (shard inside a node,
            replicate across nodes).
        cpu_offload: fsdp: keep parameters, gradients and optimizer state in CPU memory.
        deepspeed_stage: deepspeed: ZeRO stage 1 (optimizer state sharded), 2 (+ gradients) or
            3 (+ parameters).
        offload_optimizer: deepspeed: where optimizer state lives: none (GPU), cpu, or nvme
            (stage 3 only; files under nvme_path).
        offload_parameters: deepspeed: where parameters live between uses: none (GPU), cpu or
            nvme; stage 3 only.
        nvme_path: deepspeed: folder on a local NVMe drive for nvme offload (required for it).
        activation_checkpointing: Recompute each checkpointed block's activations in backward
            instead of keeping them: less memory, about a third more compute.
        activation_checkpointing_every: Checkpoint every k-th block (1: every block).
        compile: torch.compile each transformer block.
        meta_init: Build the model on the meta device and materialise it sharded, so a model
            larger than one process's memory can be built (fsdp2, hsdp, fsdp). The initial
            weights then differ from an ordinary build with the same seed. deepspeed stage 3
            always builds the model partitioned (deepspeed.zero.Init), with the same weights.
        float8: fsdp2/hsdp: train the linear layers in float8 with torchao (GPUs with compute
            capability 8.9 or newer: H100, L4, ...).
    """

    name: StrategyName = "fsdp2"
    process_group_backend: Literal["nccl", "gloo"] | None = None
    timeout_minutes: int = 30
    tensor_parallel_size: int = 1
    fsdp_sharding: Literal["FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"] = "FULL_SHARD"
    cpu_offload: bool = False
    deepspeed_stage: Literal[1, 2, 3] = 2
    offload_optimizer: Offload = "none"
    offload_parameters: Offload = "none"
    nvme_path: str | None = None
    activation_checkpointing: bool = False
    activation_checkpointing_every: int = 1
    compile: bool = False
    meta_init: bool = False
    float8: bool = False


def check_strategy(recipe: Recipe) -> None:
    """Reject strategy settings that do not fit together or do not fit the device layout."""
    strategy, name = recipe.strategy, recipe.strategy.name
    only_for = {
        "tensor_parallel_size": (strategy.tensor_parallel_size != 1, MODEL_PARALLEL),
        "fsdp_sharding": (strategy.fsdp_sharding != "FULL_SHARD", ("fsdp",)),
        "cpu_offload": (strategy.cpu_offload, ("fsdp",)),
        "deepspeed_stage": (strategy.deepspeed_stage != 2, ("deepspeed",)),
        "offload_optimizer": (strategy.offload_optimizer != "none", ("deepspeed",)),
        "offload_parameters": (strategy.offload_parameters != "none", ("deepspeed",)),
        "nvme_path": (strategy.nvme_path is not None, ("deepspeed",)),
        "meta_init": (strategy.meta_init, (*MODEL_PARALLEL, *GPU_ONLY_STRATEGIES)),
        "float8": (strategy.float8, MODEL_PARALLEL),
    }
    for key, (is_set, names) in only_for.items():
        if is_set and name not in names:
            raise RecipeError(
                f"strategy.{key}={getattr(strategy, key)} applies only to strategy.name={' or '.join(names)}"
                f" (this recipe has {name}; remove the key or change the strategy)"
            )
    if name in GPU_ONLY_STRATEGIES and recipe.accelerator == "cpu":
        raise RecipeError(
            f"strategy.name={name} needs CUDA GPUs (Fabric runs it only on GPUs); on accelerator=cpu choose"
            " ddp, fsdp2 or hsdp"
        )
    if name == "fsdp" and strategy.activation_checkpointing and strategy.activation_checkpointing_every != 1:
        raise RecipeError(
            f"strategy.activation_checkpointing_every={strategy.activation_checkpointing_every}: strategy.name=fsdp"
            " checkpoints every block (set 1, or choose fsdp2 to checkpoint every k-th block)"
        )
    if strategy.float8 and strategy.tensor_parallel_size > 1:
        raise RecipeError("strategy.float8=true works with strategy.tensor_parallel_size=1 only (float8 + FSDP2)")
    if strategy.float8 and recipe.accelerator == "cpu":
        raise RecipeError("strategy.float8=true needs GPUs with compute capability 8.9 or newer; on CPU set it false")
    tensor_parallel = strategy.tensor_parallel_size
    if recipe.devices % tensor_parallel:
        divisors = [str(d) for d in range(1, recipe.devices + 1) if recipe.devices % d == 0]
        raise RecipeError(
            f"strategy.tensor_parallel_size={tensor_parallel} does not divide devices={recipe.devices}"
            f" (tensor parallel stays inside a node: choose {', '.join(divisors)})"
        )
    for key, size in (("model.n_head", recipe.model.n_head), ("model.n_embd", recipe.model.n_embd)):
        if size % tensor_parallel:
            raise RecipeError(
                f"strategy.tensor_parallel_size={tensor_parallel} does not divide {key}={size}"
                " (each tensor-parallel rank holds an equal share of heads and width)"
            )
    hybrid = name == "hsdp" or (name == "fsdp" and strategy.fsdp_sharding == "HYBRID_SHARD")
    if hybrid and recipe.num_nodes < 2:
        what = "strategy.name=hsdp" if name == "hsdp" else "strategy.fsdp_sharding=HYBRID_SHARD"
        raise RecipeError(
            f"{what} needs num_nodes >= 2 (it shards inside a node and replicates across nodes);"
            " on one node choose fsdp2 (or FULL_SHARD)"
        )
    if name in MODEL_PARALLEL and recipe.precision not in SHARDED_PRECISIONS:
        raise RecipeError(
            f"precision={recipe.precision} is not supported with strategy.name={name}"
            f" (choose {', '.join(SHARDED_PRECISIONS)})"
        )
    for key in ("offload_optimizer", "offload_parameters"):
        where = getattr(strategy, key)
        if where == "nvme" and not strategy.nvme_path:
            raise RecipeError(f"strategy.{key}=nvme needs strategy.nvme_path (a folder on a local NVMe drive)")
        if where != "none" and strategy.deepspeed_stage != 3 and (key == "offload_parameters" or where == "nvme"):
            raise RecipeError(
                f"strategy.{key}={where} needs strategy.deepspeed_stage=3"
                " (stages 1 and 2 offload only the optimizer, and only to cpu)"
            )
    if name == "deepspeed" and strategy.meta_init and strategy.deepspeed_stage != 3:
        raise RecipeError(
            "strategy.meta_init=true needs strategy.deepspeed_stage=3 (stages 1 and 2 keep every parameter whole"
            " on every rank; stage 3 always builds the model partitioned)"
        )
