"""A small task kept beside the tests: regression of random vectors with a residual MLP built from blocks.

It is what a user's own task looks like (tasks/base.py: the required methods, the model contract) and what the
machinery's tests train when they need a task that is not the project's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torchmetrics import MeanAbsoluteError, Metric
from torchmetrics.aggregation import MeanMetric

from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.tasks import Splits, Task
from {{ cookiecutter.package_name }}.tasks.base import init_parameters


@dataclass
class MlpConfig:
    """A residual MLP: an input layer, `depth` blocks of width `width`, a linear head."""

    inputs: int = 8
    outputs: int = 4
    width: int = 32
    depth: int = 3


@dataclass
class VectorData:
    """Random vectors x and targets y = W x + noise, W fixed by `seed`."""

    samples: int = 512
    noise: float = 0.01
    seed: int = 0


@dataclass
class VectorRecipe(Recipe):
    """A recipe of `task: vector_regression`."""

    model: MlpConfig = field(default_factory=MlpConfig)
    data: VectorData = field(default_factory=VectorData)


class Block(nn.Module):
    """x + proj(GELU(fc(LayerNorm(x)))), fc widening by 2: the unit strategies shard, checkpoint and compile."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(width), nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(nn.functional.gelu(self.fc(self.norm(x))))


class Mlp(nn.Module):
    """The model contract of tasks/base.py (TrainableModel): `blocks`, `tensor_parallel_plan()`, `init_parameter`,
    and for pipeline parallel `pipeline_ends()` (a stage without the input layer or the head has None there)."""

    def __init__(self, config: MlpConfig) -> None:
        super().__init__()
        self.input = nn.Linear(config.inputs, config.width)
        self.blocks = nn.ModuleList(Block(config.width) for _ in range(config.depth))
        self.head = nn.Linear(config.width, config.outputs)
        init_parameters(self)

    @staticmethod
    def tensor_parallel_plan() -> dict[str, Any]:
        """fc split by columns (hidden units), proj by rows: one all-reduce per block."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        return {"fc": ColwiseParallel(), "proj": RowwiseParallel()}

    @staticmethod
    def pipeline_ends() -> tuple[list[str], list[str]]:
        return ["input"], ["head"]

    def init_parameter(self, name: str, param: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif param.dim() < 2:
            nn.init.zeros_(param)
        else:
            nn.init.normal_(param, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input(x) if self.input is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


class Vectors:
    """Samples: (x, y) pairs made from a seed."""

    def __init__(self, config: VectorData, model: MlpConfig, first: int, count: int) -> None:
        rng = np.random.default_rng(config.seed)
        weights = rng.standard_normal((model.inputs, model.outputs)).astype(np.float32)
        x = rng.standard_normal((config.samples, model.inputs)).astype(np.float32)
        y = x @ weights + config.noise * rng.standard_normal((config.samples, model.outputs)).astype(np.float32)
        self.x, self.y = torch.from_numpy(x[first : first + count]), torch.from_numpy(y[first : first + count])

    def __len__(self) -> int:
        return len(self.x)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[list(indices)], self.y[list(indices)]


class VectorRegression(Task):
    """Mean squared error of an MLP on random linear data; validation also reports the mean absolute error."""

    name = "vector_regression"
    recipe_type = VectorRecipe
    unit = "vector"

    def build_model(self) -> nn.Module:
        return Mlp(self.recipe.model)

    def datasets(self) -> Splits:
        data, model = self.recipe.data, self.recipe.model
        held_out = data.samples // 8
        train = Vectors(data, model, 0, data.samples - held_out)
        return Splits(train, Vectors(data, model, data.samples - held_out, held_out))

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(outputs, targets)

    def metrics(self) -> dict[str, Metric]:
        return {"loss": MeanMetric(), "mae": MeanAbsoluteError()}

    def update_metrics(self, outputs: torch.Tensor, targets: torch.Tensor, metrics: dict[str, Metric]) -> None:
        metrics["loss"].update(self.loss(outputs, targets))
        metrics["mae"].update(outputs, targets)

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        return {"model.width": self.recipe.model.width}

    def pipeline_blocks(self) -> int:
        return self.recipe.model.depth

    def flops_per_unit(self) -> float:
        config = self.recipe.model
        blocks = config.depth * 2 * (2 * config.width * config.width)  # fc and proj
        return 6.0 * (config.inputs * config.width + blocks + config.width * config.outputs)
