"""DDP: every device holds the whole model and optimizer; gradients are all-reduced. Choose it when they fit."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..planner.options import PlanOption, PlanSizes, PlanTerm
from ..precision import torch_model_states
from .base import (
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
    trains_adapters = True  # frozen parameters get no gradient, so only the adapters' are all-reduced

    def fabric_strategy(self) -> Strategy:
        from lightning.fabric.strategies import DDPStrategy

        if self.recipe.world_size == 1:
            return one_device_strategy()
        return DDPStrategy(**process_group_options(self.recipe))

    def plan_options(self) -> list[PlanOption]:
        return [
            PlanOption(
                self.name,
                stage=0,
                why="every {device} holds the whole model, its optimizer state and activations, so nothing needs sharding",
            )
        ]

    def plan_runtime_terms(self, option: PlanOption, sizes: PlanSizes) -> list[PlanTerm]:
        # Fabric's DDP keeps gradient_as_bucket_view off: its buckets are a second copy of the gradients (of the
        # parameters that train: frozen ones have none).
        gradients = torch_model_states(sizes.parameters, sizes.precision, 0, 1, sizes.trained).gradients
        return [PlanTerm("DDP gradient buckets", gradients)]
