"""The bounds declared on the schema's fields: every default lies within them, a value outside them is refused in
one line naming the field's path (from a recipe file and from the command line alike), and `field_path` names a
field where the recipe holds it."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import types
import typing
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import PROJECT, RECIPES, fail_with, run_cli

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.bounds import Bounds, bounds, bounds_of
from {{ cookiecutter.package_name }}.recipe.schema import Fsdp2Options, Recipe, StrategyConfig, TrainConfig, field_path
from {{ cookiecutter.package_name }}.recipe.typecheck import check_values
from {{ cookiecutter.package_name }}.tasks import task_class

TASKS = [path.parent.name for path in sorted((PROJECT / "src" / "{{ cookiecutter.package_name }}" / "tasks").glob("*/task.py"))]


def bounded_fields(cls: type, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, typing.Any]]:
    """(path, field, annotation) of every field of a recipe dataclass that declares bounds, its sections walked."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        members = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
        for member in members:
            if isinstance(member, type) and dataclasses.is_dataclass(member):
                yield from bounded_fields(member, f"{prefix}{field.name}.")
        if bounds_of(field) is not None:
            yield prefix + field.name, field, kind


def default(field: dataclasses.Field) -> typing.Any:
    return field.default if field.default_factory is dataclasses.MISSING else field.default_factory()


@pytest.mark.parametrize("task", TASKS)
def test_every_default_lies_within_its_fields_bounds(task: str) -> None:
    recipe_type = task_class(task).recipe_type
    fields = list(bounded_fields(recipe_type))
    assert any(path == "train.max_steps" for path, _, _ in fields)
    outside = [
        f"{path}={default(field)} {refusal}"
        for path, field, _ in fields
        if default(field) is not None and (refusal := bounds_of(field).refusal(default(field))) is not None
    ]
    assert not outside, outside
    check_values(recipe_type())  # the walk over a whole Recipe of defaults refuses nothing either


@pytest.mark.parametrize("task", TASKS)
def test_bounds_are_declared_on_number_fields_only(task: str) -> None:
    numbers = {int, float}
    for path, _, kind in bounded_fields(task_class(task).recipe_type):
        members = set(typing.get_args(kind)) - {type(None)} if typing.get_origin(kind) else {kind}
        # A word offered beside the number (save_every_minutes: auto) is no number: the bounds are the number's.
        numeric = {member for member in members if typing.get_origin(member) is not typing.Literal}
        assert numeric and numeric <= numbers, f"{path}: bounds on a {kind}"


@pytest.mark.parametrize(
    ("declared", "value", "refusal"),
    [
        (bounds(at_least=1, at_most=10**12), 0, "must be >= 1"),
        (bounds(at_least=1, at_most=4096), 5000, "must be <= 4,096"),  # a closed pair names the side broken
        (bounds(at_least=0, below=1), 1.0, "must be in [0, 1)"),  # an open side: the whole range
        (bounds(above=0, at_most=1, note="a share"), 0.0, "must be in (0, 1] (a share)"),
        (bounds(above=0), -1.0, "must be > 0"),
        (bounds(at_least=0, note="0: never"), -1, "must be >= 0 (0: never)"),
        (bounds(above=0), math.nan, "must be > 0"),  # NaN lies within no bound
        (bounds(at_least=1, at_most=4096), 4096, None),
    ],
)
def test_a_bound_refuses_what_lies_outside_and_says_what_is_allowed(
    declared: dict[str, Bounds], value: float, refusal: str | None
) -> None:
    (bound,) = declared.values()
    assert bound.refusal(value) == refusal


def test_a_field_has_one_lower_and_one_upper_bound_at_most() -> None:
    with pytest.raises(ValueError, match="one lower bound"):
        bounds(at_least=0, above=0)


def test_a_bound_broken_in_a_recipe_file_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("accelerator: cpu\ncheckpoint:\n  max_failures: -2\n")
    error = fail_with(["train", "--config", str(recipe), "--out_dir", str(tmp_path / "run")], capsys)
    assert error == "error: recipe 'bad.yaml': checkpoint.max_failures=-2 must be >= -1"
    assert not (tmp_path / "run").exists()


def test_a_bound_broken_on_the_command_line_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["train", "--config", str(RECIPES / "cpu-debug.yaml"), "--out_dir", str(tmp_path / "run")]
    error = fail_with([*argv, "--strategy.fsdp2.tensor_parallel_size", "0"], capsys)
    assert error == "error: recipe 'cpu-debug.yaml': strategy.fsdp2.tensor_parallel_size=0 must be >= 1"
    assert not (tmp_path / "run").exists()


def test_a_broken_bound_exits_with_code_2_and_no_traceback(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("train:\n  seed: 4294967296\n")
    result = run_cli("train", "--config", str(recipe), "--out_dir", str(tmp_path / "run"), timeout=120)
    assert (result.returncode, result.stderr) == (
        2,
        "error: recipe 'bad.yaml': train.seed=4294967296 must be <= 4,294,967,295\n",
    )


def test_field_path_names_a_field_where_the_recipe_holds_it() -> None:
    assert field_path(TrainConfig, "max_steps") == "train.max_steps"
    assert field_path(TrainConfig(), "seed") == "train.seed"  # an instance names its section as its class does
    assert field_path(Fsdp2Options, "tensor_parallel_size") == "strategy.fsdp2.tensor_parallel_size"
    assert field_path(Recipe, "devices") == "devices"
    recipe = task_class(Recipe.task).recipe_type()
    assert field_path(recipe.data, "path") == "data.path"


def test_field_path_refuses_a_field_the_section_does_not_have() -> None:
    with pytest.raises(LookupError, match="StrategyConfig has no recipe field 'nmae'"):
        field_path(StrategyConfig, "nmae")


def test_a_value_outside_its_choices_is_refused_by_the_same_walk() -> None:
    recipe = task_class(Recipe.task).recipe_type()
    recipe.train.schedule = "linear"  # type: ignore[assignment]
    refusal = r"^train\.schedule: 'linear' is not allowed \(choose one of 'cosine', 'wsd'\)$"
    with pytest.raises(RecipeError, match=refusal):
        check_values(recipe)


def test_the_recipe_reference_shows_each_fields_bounds() -> None:
    hook = importlib.util.spec_from_file_location("reference", PROJECT / "docs" / "hooks" / "reference.py")
    assert hook is not None and hook.loader is not None
    reference = importlib.util.module_from_spec(hook)
    hook.loader.exec_module(reference)
    page = reference.recipe_page()
    assert "**`train.max_steps`** (`int`, default `100`, at least 1, at most 1,000,000,000,000)" in page
    assert "**`train.beta1`** (`float`, default `0.9`, in [0, 1))" in page
