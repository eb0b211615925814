"""DDP: every device holds the whole model and optimizer; gradients are all-reduced. Choose it when they fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from {{ cookiecutter.package_name }}.strategies.base import (
    PlanOption,
    TrainingStrategy,
    one_device_strategy,
    process_group_options,
)

if TYPE_CHECKING:
    from lightning.fabric.strategies import Strategy


class DDP(TrainingStrategy):
    """Fabric's DDPStrategy; on one process, Fabric's SingleDeviceStrategy (nothing to replicate)."""

    name = "ddp"
    checkpoint_layout = "replicated"

    def fabric_strategy(self) -> Strategy:
        from lightning.fabric.strategies import DDPStrategy

        if self.recipe.world_size == 1:
            return one_device_strategy()
        return DDPStrategy(**process_group_options(self.recipe))

    def plan_options(self) -> list[PlanOption]:
        return [
            PlanOption(
                "ddp",
                (False, False, False),
                ("ddp-node", "ddp-node"),
                preference=0,
                why="the model and its optimizer state fit on one GPU; nothing to shard",
            )
        ]
