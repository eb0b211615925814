"""A task is a class and a registration: this file adds one (regression of random vectors with an MLP built from
blocks) and trains it with the project's machinery, changing no other module.

`python tests/e2e/test_task_seam.py train ...` is the command line with the toy task registered (Fabric re-runs this
script in each process it launches, so every rank registers it). Its recipe is its own file: the machinery's
sections plus the task's `model:` and `data:`.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml
from helpers import (
    UNIT,
    assert_same_losses,
    assert_same_weights,
    final_weights,
    read_csv_metrics,
    run_cli,
    train_losses,
)
from torch import nn
from torchmetrics import MeanAbsoluteError, Metric
from torchmetrics.aggregation import MeanMetric

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.tasks import Splits, Task, register


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
    """x + Linear(GELU(LayerNorm(x))): the unit strategies shard, checkpoint and compile."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(nn.functional.gelu(self.norm(x)))


class Mlp(nn.Module):
    """The model contract of tasks/base.py: `blocks`, `tensor_parallel_plan()`, `init_parameter(name, param)`."""

    def __init__(self, config: MlpConfig) -> None:
        super().__init__()
        self.input = nn.Linear(config.inputs, config.width)
        self.blocks = nn.ModuleList(Block(config.width) for _ in range(config.depth))
        self.head = nn.Linear(config.width, config.outputs)
        for name, param in self.named_parameters():
            self.init_parameter(name, param)

    def tensor_parallel_plan(self) -> dict[str, Any]:
        return {}

    def init_parameter(self, name: str, param: torch.Tensor) -> None:
        if name.endswith("norm.weight"):
            nn.init.ones_(param)
        elif param.dim() < 2:
            nn.init.zeros_(param)
        else:
            nn.init.normal_(param, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.input(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


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

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)

    def validation_metrics(self) -> dict[str, Metric]:
        return {"loss": MeanMetric(), "mae": MeanAbsoluteError()}

    def validation_step(self, model: Any, batch: Any, metrics: dict[str, Metric]) -> None:
        x, y = batch
        prediction = model(x)
        metrics["loss"].update(nn.functional.mse_loss(prediction, y))
        metrics["mae"].update(prediction, y)

    def flops_per_unit(self) -> float:
        config = self.recipe.model
        matmul = config.inputs * config.width + config.depth * config.width**2 + config.width * config.outputs
        return 6.0 * matmul


STEPS = 8


def write_recipe(folder: Path, strategy: str) -> Path:
    """The toy task's own recipe: 2 CPU processes, CSV logs, validation every 4 steps."""
    recipe = {
        "task": VectorRegression.name,
        "accelerator": "cpu",
        "devices": 2,
        "out_dir": str(folder / "run"),
        "strategy": {"name": strategy, "process_group_backend": "gloo", "timeout_minutes": 5},
        "model": {"width": 32, "depth": 3},
        "data": {"samples": 512},
        "train": {"max_steps": STEPS, "micro_batch_size": 8, "learning_rate": 0.01, "warmup_steps": 2},
        "eval": {"every_steps": 4, "batches": 2},
        "checkpoint": {"save_every_steps": 4, "resume": "auto"},
        "logger": {"name": "csv", "log_every_steps": 1},
    }
    path = folder / "vectors.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def train_toy(folder: Path, strategy: str, fault: str = "") -> Any:
    folder.mkdir(parents=True, exist_ok=True)
    return run_cli("train", "--config", str(write_recipe(folder, strategy)), script=Path(__file__), fault=fault)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One uninterrupted run of the toy task under each strategy: its out_dir."""
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        folder = tmp_path_factory.mktemp(strategy)
        result = train_toy(folder, strategy)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[strategy] = folder / "run"
    return runs


@pytest.mark.slow
def test_a_task_registered_outside_the_package_trains_under_ddp_and_fsdp2_alike(uninterrupted: dict[str, Path]) -> None:
    ddp, fsdp2 = train_losses(uninterrupted["ddp"]), train_losses(uninterrupted["fsdp2"])
    assert sorted(ddp) == list(range(1, STEPS + 1))
    assert_same_losses(fsdp2, ddp, tolerance=1e-5)
    assert ddp[STEPS] < ddp[1] / 2  # it learns
    rows = read_csv_metrics(uninterrupted["fsdp2"])
    # Its own validation metric and its own unit reach the logger; its FLOPs give a FLOP figure per vector.
    mae = [float(row["val/mae"]) for row in rows if row.get("val/mae")]
    assert len(mae) == 2 and all(math.isfinite(value) and value > 0 for value in mae)
    assert any(row.get("throughput/vectors_per_second") for row in rows)
    assert {float(row["throughput/flops_per_vector"]) for row in rows if row.get("throughput/flops_per_vector")} == {
        6.0 * (8 * 32 + 3 * 32 * 32 + 32 * 4)
    }
    project_unit = f"throughput/{UNIT}s"  # the project task's unit, not this one's
    assert not any(key.startswith(project_unit) for row in rows for key in row if row[key])
    assert {key for row in rows for key in row if row[key] and key.startswith("val/")} == {"val/loss", "val/mae"}


@pytest.mark.slow
def test_a_killed_run_of_the_toy_task_resumes_bitwise(tmp_path: Path, uninterrupted: dict[str, Path]) -> None:
    killed = train_toy(tmp_path, "fsdp2", fault="kill-at-step:6")
    assert killed.returncode != 0
    resumed = train_toy(tmp_path, "fsdp2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Resumed from" in resumed.stdout and "step-00000004" in resumed.stdout
    assert_same_losses(train_losses(tmp_path / "run"), train_losses(uninterrupted["fsdp2"]), tolerance=0.0)
    assert_same_weights(final_weights(tmp_path / "run", STEPS), final_weights(uninterrupted["fsdp2"], STEPS))


def test_an_unregistered_task_is_refused_naming_the_registered_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["train", "--config", str(write_recipe(tmp_path, "ddp"))])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"task='{VectorRegression.name}' is not one of: {{ cookiecutter.task }}" in err


def test_a_registered_task_reads_its_own_sections_and_refuses_the_project_tasks(tmp_path: Path) -> None:
    register(VectorRegression)
    try:
        from {{ cookiecutter.package_name }}.errors import RecipeError
        from {{ cookiecutter.package_name }}.recipe.load import load_recipe, parse_recipe

        recipe = load_recipe(write_recipe(tmp_path, "fsdp2"))
        assert isinstance(recipe, VectorRecipe) and recipe.model.width == 32 and recipe.data.samples == 512
        with pytest.raises(RecipeError, match=r"unknown option '--model.n_layer' \(allowed in model: inputs"):
            parse_recipe(["--config", str(write_recipe(tmp_path, "fsdp2")), "--model.n_layer", "2"])
        with pytest.raises(RecipeError, match="task=vector_regression has no tensor-parallel plan"):
            parse_recipe(
                ["--config", str(write_recipe(tmp_path, "fsdp2")), "--strategy.fsdp2.tensor_parallel_size", "2"]
            )
    finally:
        from {{ cookiecutter.package_name }}.tasks import REGISTRY

        REGISTRY.pop(VectorRegression.name)


if __name__ == "__main__":
    register(VectorRegression)
    main(sys.argv[1:])
