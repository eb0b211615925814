"""A small task kept beside the tests: regression of random vectors with a residual MLP built from blocks.

It is what a user's own task looks like (tasks/base.py: the required methods, the model contract) and what the
machinery's tests train when they need a task that is not the project's. As a task of the project, it imports
torch only where it builds or runs something, so a recipe of it is checked without torch (config.py has the
recipe's sections, model.py the model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from {{ cookiecutter.package_name }}.tasks import Splits, Task
from {{ cookiecutter.package_name }}.tasks.base import ModelCost

from .config import MlpConfig, VectorData, VectorRecipe

__all__ = ["MlpConfig", "VectorData", "VectorRecipe", "VectorRegression"]  # the task with its recipe's sections

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchmetrics import Metric


class VectorRegression(Task):
    """Mean squared error of an MLP on random linear data; validation also reports the mean absolute error."""

    name = "vector_regression"
    recipe_type = VectorRecipe
    unit = "vector"

    def build_model(self) -> nn.Module:
        from .model import Mlp

        return Mlp(self.recipe.model)

    def datasets(self) -> Splits:
        from .model import Vectors

        data, model = self.recipe.data, self.recipe.model
        held_out = data.samples // 8
        train = Vectors(data, model, 0, data.samples - held_out)
        return Splits(train, Vectors(data, model, data.samples - held_out, held_out))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.nn.functional import mse_loss

        return mse_loss(outputs, targets)

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics import MeanAbsoluteError
        from torchmetrics.aggregation import MeanMetric

        return {"loss": MeanMetric(), "mae": MeanAbsoluteError()}

    def update_metrics(self, outputs: torch.Tensor, targets: torch.Tensor, metrics: dict[str, Metric]) -> None:
        metrics["loss"].update(self.loss(outputs, targets))
        metrics["mae"].update(outputs, targets)

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        return {"model.width": self.recipe.model.width}

    def pipeline_blocks(self) -> int:
        return self.recipe.model.depth

    def model_cost(self) -> ModelCost:
        from .sizing import MlpShape

        return MlpShape(self.recipe.model)

    def flops_per_unit(self) -> float:
        return self.model_cost().training_flops_per_sample()
