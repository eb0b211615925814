"""The toy task's model, a residual MLP built from blocks, and its samples, random vectors made from a seed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from {{ cookiecutter.package_name }}.tasks.base import init_parameters

from .config import MlpConfig, VectorData


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
