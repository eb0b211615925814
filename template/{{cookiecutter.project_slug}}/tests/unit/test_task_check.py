"""`check RECIPE` names, one line each, what the machinery needs of a task and does not find; a model that lacks
part of the contract is refused in one line right after it is built, before any strategy touches it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from helpers import PROJECT
from torch import nn
from toy_task.model import Mlp
from toy_task.task import VectorRegression

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.tasks import REGISTRY, register, task_for
from {{ cookiecutter.package_name }}.tasks.base import checked_model


class MlpWithoutInit(nn.Module):
    """Blocks and a tensor-parallel plan, but no `init_parameter`: a meta-device build could not be initialised."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def tensor_parallel_plan(self) -> dict[str, Any]:
        return {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](x))


class MlpReturningAView(Mlp):
    """Returns a view of its output (as `.squeeze()` does), which FSDP2 warns about at every step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x).unsqueeze(0).squeeze(0)


class WithoutInit(VectorRegression):
    name = "vectors_without_init"

    def build_model(self) -> nn.Module:
        return MlpWithoutInit()


class ReturningAView(VectorRegression):
    name = "vectors_returning_a_view"

    def build_model(self) -> nn.Module:
        return MlpReturningAView(self.recipe.model)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    tasks = (VectorRegression, WithoutInit, ReturningAView)
    for task in tasks:
        register(task)
    yield
    for task in tasks:
        REGISTRY.pop(task.name)


def recipe_file(folder: Path, task: str, eval_batches: int = 2) -> Path:
    """A 2-process recipe of the toy task (512 samples: 64 held out for validation)."""
    recipe = {
        "task": task,
        "accelerator": "cpu",
        "devices": 2,
        "out_dir": str(folder / "run"),
        "strategy": {"name": "fsdp2", "process_group_backend": "gloo"},
        "data": {"samples": 512},
        "train": {"max_steps": 4, "micro_batch_size": 8},
        "eval": {"every_steps": 2, "batches": eval_batches},
        "logger": {"name": "csv"},
    }
    path = folder / f"{task}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def check(path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run `check --config PATH` in this process: (exit code, stdout, stderr)."""
    code = 0
    try:
        main(["check", "--config", str(path)])
    except SystemExit as exited:  # raised only for a non-zero code
        code = int(exited.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_task_that_has_what_the_machinery_needs_passes_every_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = check(recipe_file(tmp_path, VectorRegression.name), capsys)
    assert code == 0, err
    assert err == ""
    lines = out.splitlines()
    assert len([line for line in lines if line.startswith("ok: ")]) == 6
    assert lines[-1] == f"task {VectorRegression.name}: the machinery finds all it needs"


def test_a_model_without_init_parameter_is_named_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = check(recipe_file(tmp_path, WithoutInit.name), capsys)
    assert code == 2
    problems = [line for line in err.splitlines() if line.startswith("problem: ")]
    assert problems == [
        "problem: the model follows the contract (blocks, tensor_parallel_plan, init_parameter):"
        " no `init_parameter(name, parameter)` method"
    ]
    assert err.splitlines()[-1] == f"error: task {WithoutInit.name}: 1 problem(s) above, each named in one line"


def test_a_view_returned_from_forward_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = check(recipe_file(tmp_path, ReturningAView.name), capsys)
    assert code == 2
    (problem,) = [line for line in err.splitlines() if line.startswith("problem: ")]
    assert problem.startswith("problem: the model's forward returns a tensor of its own: forward returns a view")
    assert "ok: loss is a finite scalar that backward runs through" in out  # the other checks still ran


def test_validation_sizes_that_would_count_samples_twice_are_named_with_the_largest_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 64 validation samples; 5 batches x 8 samples x 2 ranks = 80 would wrap around; 4 x 8 x 2 = 64 fits.
    code, _, err = check(recipe_file(tmp_path, VectorRegression.name, eval_batches=5), capsys)
    assert code == 2
    (problem,) = [line for line in err.splitlines() if line.startswith("problem: ")]
    assert "eval.batches=5 x train.micro_batch_size=8 x 2 data-parallel rank(s) = 80 samples" in problem
    assert "holds 64" in problem and "choose eval.batches <= 4" in problem
    code, _, err = check(recipe_file(tmp_path, VectorRegression.name, eval_batches=4), capsys)
    assert code == 0, err


def test_a_model_without_the_contract_is_refused_right_after_it_is_built(tmp_path: Path) -> None:
    task = task_for(load_recipe(recipe_file(tmp_path, WithoutInit.name)))
    with pytest.raises(RecipeError, match=r"^task vectors_without_init: its model \(MlpWithoutInit\) has no `init_par"):
        checked_model(task)
    assert isinstance(checked_model(task_for(load_recipe(recipe_file(tmp_path, VectorRegression.name)))), Mlp)


def test_the_projects_own_debug_recipe_passes_every_check(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = check(PROJECT / "recipes" / "cpu-debug.yaml", capsys)
    assert code == 0, err
    assert out.splitlines()[-1].endswith("the machinery finds all it needs")
