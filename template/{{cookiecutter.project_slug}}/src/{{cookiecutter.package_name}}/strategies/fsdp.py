"""FSDP1 through Fabric's FSDPStrategy: FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, CPU offload. GPUs only.

One FSDP unit and one activation checkpoint per transformer block (the model's `block_class`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from ..planner.options import PlanOption
from ..recipe.schema import FsdpOptions
from .base import (
    GpuRequirement,
    MakeOptimizer,
    TrainingStrategy,
    gpu_only,
    prepare_blocks,
    process_group_options,
)

if TYPE_CHECKING:
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import Strategy
    from torch import nn


class FSDP1(TrainingStrategy):
    """Fabric's FSDPStrategy with sharded checkpoints."""

    name = "fsdp"
    options_key = "fsdp"
    options_type = FsdpOptions
    checkpoint_layout = "own"
    supports_meta_init = True
    not_rehearsed = "Fabric builds FSDP1 on CUDA devices only; rehearse the same layout under strategy.name=fsdp2"

    def check(self) -> None:
        config = self.config
        if config.activation_checkpointing and config.activation_checkpointing_every != 1:
            raise RecipeError(
                f"strategy.activation_checkpointing_every={config.activation_checkpointing_every}:"
                " strategy.name=fsdp checkpoints every block (set 1, or choose fsdp2 to checkpoint every k-th block)"
            )
        if config.activation_checkpointing and config.activation_checkpointing_policy != "full":
            raise RecipeError(
                f"strategy.activation_checkpointing_policy={config.activation_checkpointing_policy}: strategy.name=fsdp"
                " checkpoints whole blocks (set full, or choose fsdp2 for selective checkpointing)"
            )
        if self.options.sharding == "HYBRID_SHARD" and self.recipe.num_nodes < 2:
            raise RecipeError(
                "strategy.fsdp.sharding=HYBRID_SHARD needs num_nodes >= 2 (it shards inside a node and replicates"
                " across nodes); on one node choose FULL_SHARD"
            )

    def gpu_requirement(self) -> GpuRequirement:
        return gpu_only(self.name)

    def describe(self) -> str:
        return f"strategy {self.name} ({self.options.sharding})"

    def plan_options(self) -> list[PlanOption]:
        return []  # the same state per GPU as fsdp2 (FULL_SHARD) or zero2 (SHARD_GRAD_OP); plan lists those

    def fabric_strategy(self) -> Strategy:
        from lightning.fabric.strategies import FSDPStrategy

        block = self.task.block_class()
        hybrid = self.options.sharding == "HYBRID_SHARD"
        return FSDPStrategy(
            sharding_strategy=self.options.sharding,
            auto_wrap_policy={block},
            activation_checkpointing_policy={block} if self.config.activation_checkpointing else None,
            cpu_offload=self.options.cpu_offload,
            state_dict_type="sharded",
            # HYBRID_SHARD: replicate across nodes, shard over the devices of a node.
            device_mesh=(self.recipe.num_nodes, self.recipe.devices) if hybrid else None,
            **process_group_options(self.recipe),
        )

    def setup(self, fabric: Fabric, model: nn.Module, make_optimizer: MakeOptimizer) -> tuple[Any, Any, Any]:
        # FSDPStrategy checkpoints blocks itself (activation_checkpointing_policy), inside its wrapping.
        prepare_blocks(model, replace(self.config, activation_checkpointing=False))
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model))
        return model, optimizer, optimizer
