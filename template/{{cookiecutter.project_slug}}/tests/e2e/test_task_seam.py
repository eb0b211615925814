"""A task is one package: the toy task of tests/toy_task/ (regression of random vectors with an MLP built from
blocks), copied as tasks/vector_regression/ into a copy of this project's package with no other file touched, is
found by its folder, passes `check`, and trains with the project's machinery. Its recipe is its own file: the
machinery's sections plus the task's `model:` and `data:`. `register` adds a task defined outside the package.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
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
from toy_task.task import VectorRecipe, VectorRegression

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.tasks import register

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


def run_toy(source: Path, *args: str, fault: str = "") -> subprocess.CompletedProcess:
    """`python -m <package> ARGS` on the copy of the source that holds the toy task (conftest.py's `toy_source`)."""
    return run_cli(*args, fault=fault, source=source)


def train_toy(source: Path, folder: Path, strategy: str, fault: str = "") -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    return run_toy(source, "train", "--config", str(write_recipe(folder, strategy)), fault=fault)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> dict[str, Path]:
    """One uninterrupted run of the toy task under each strategy: its out_dir."""
    runs = {}
    for strategy in ("ddp", "fsdp2"):
        folder = tmp_path_factory.mktemp(strategy)
        result = train_toy(toy_source, folder, strategy)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[strategy] = folder / "run"
    return runs


@pytest.mark.slow
def test_a_task_added_as_one_package_trains_under_ddp_and_fsdp2_alike(uninterrupted: dict[str, Path]) -> None:
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
        6.0 * (8 * 32 + 3 * 2 * 2 * 32 * 32 + 32 * 4)  # input, 3 blocks of fc (32 -> 64) and proj (64 -> 32), head
    }
    project_unit = f"throughput/{UNIT}s"  # the project task's unit, not this one's
    assert not any(key.startswith(project_unit) for row in rows for key in row if row[key])
    assert {key for row in rows for key in row if row[key] and key.startswith("val/")} == {"val/loss", "val/mae"}


@pytest.mark.slow
def test_a_killed_run_of_the_toy_task_resumes_bitwise(
    tmp_path: Path, toy_source: Path, uninterrupted: dict[str, Path]
) -> None:
    killed = train_toy(toy_source, tmp_path, "fsdp2", fault="kill-at-step:6")
    assert killed.returncode != 0
    resumed = train_toy(toy_source, tmp_path, "fsdp2")
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


class VectorRegressionWithoutTensorParallel(VectorRegression):
    """The toy task declaring no dimension tensor parallel must divide: it has no tensor-parallel plan to use."""

    name = "vector_regression_without_tensor_parallel"

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        return {}


def test_a_registered_task_reads_its_own_sections_and_refuses_the_project_tasks(tmp_path: Path) -> None:
    register(VectorRegression)
    register(VectorRegressionWithoutTensorParallel)
    try:
        from {{ cookiecutter.package_name }}.errors import RecipeError
        from {{ cookiecutter.package_name }}.recipe.load import load_recipe, parse_recipe

        recipe = load_recipe(write_recipe(tmp_path, "fsdp2"))
        assert isinstance(recipe, VectorRecipe) and recipe.model.width == 32 and recipe.data.samples == 512
        with pytest.raises(RecipeError, match=r"unknown option '--model.n_layer' \(allowed in model: inputs"):
            parse_recipe(["--config", str(write_recipe(tmp_path, "fsdp2")), "--model.n_layer", "2"])
        without_plan = ["--task", VectorRegressionWithoutTensorParallel.name, "--strategy.fsdp2.tensor_parallel_size"]
        with pytest.raises(RecipeError, match="task=vector_regression_without_tensor_parallel has no tensor-parallel"):
            parse_recipe(["--config", str(write_recipe(tmp_path, "fsdp2")), *without_plan, "2"])
    finally:
        from {{ cookiecutter.package_name }}.tasks import REGISTRY

        REGISTRY.pop(VectorRegression.name)
        REGISTRY.pop(VectorRegressionWithoutTensorParallel.name)


def test_a_task_package_is_found_by_its_folder_and_passes_check(tmp_path: Path, toy_source: Path) -> None:
    checked = run_toy(toy_source, "check", "--config", str(write_recipe(tmp_path, "fsdp2")))
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert checked.stdout.splitlines()[-1] == f"task {VectorRegression.name}: the machinery finds all it needs"
