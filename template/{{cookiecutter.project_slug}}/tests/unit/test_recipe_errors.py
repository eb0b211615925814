"""Every refusal of a recipe's keys and value types, word for word: the line a user reads is the project's own.

Each case is a recipe file or command-line overrides that the schema refuses; the test holds the whole line
(exit code 2, one line, no traceback). Lists of keys are read from the schema, so a new field changes them
without changing the test.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
from helpers import RECIPES

from {{ cookiecutter.package_name }}.errors import RecipeError, run_command
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.recipe.schema import DeepSpeedOptions, Fsdp2Options, Recipe, TrainConfig
from {{ cookiecutter.package_name }}.recipe.typecheck import check_document, check_overrides
from {{ cookiecutter.package_name }}.tasks import task_class


def keys(cls: type) -> str:
    return ", ".join(field.name for field in dataclasses.fields(cls))


TOP = keys(task_class(Recipe.task).recipe_type)
TRAIN = keys(TrainConfig)
FSDP2 = keys(Fsdp2Options)
DEEPSPEED = keys(DeepSpeedOptions)
PRECISIONS = "'32-true', 'bf16-mixed', 'bf16-true', '16-mixed', '16-true'"
FILE = "recipe 'bad.yaml'"
DEBUG = "recipe 'cpu-debug.yaml'"

# (id, recipe text, the whole line after "error: ")
IN_THE_FILE: list[tuple[str, str, str]] = [
    (
        "a key given twice",
        "devices: 2\ntrain:\n  max_steps: 5\n  max_steps: 50\n",
        f"{FILE}: line 4, column 3: duplicate key 'max_steps' (first on line 3; give each key once)",
    ),
    (
        "a key given twice in one line",
        "train: {max_steps: 5, max_steps: 50}\n",
        f"{FILE}: line 1, column 23: duplicate key 'max_steps' (first on line 1; give each key once)",
    ),
    ("misspelt key", "devicez: 2\n", f"{FILE}: unknown key 'devicez': did you mean 'devices'? (allowed: {TOP})"),
    ("unknown key with an empty mapping", "optimiser: {}\n", f"{FILE}: unknown key 'optimiser' (allowed: {TOP})"),
    (
        "misspelt key in a section",
        "train:\n  max_step: 5\n",
        f"{FILE}: unknown key 'train.max_step': did you mean 'train.max_steps'? (allowed in train: {TRAIN})",
    ),
    (
        "misspelt key in an options section",
        "strategy:\n  name: deepspeed\n  deepspeed:\n    stagee: 3\n",
        f"{FILE}: unknown key 'strategy.deepspeed.stagee': did you mean 'strategy.deepspeed.stage'? "
        f"(allowed in strategy.deepspeed: {DEEPSPEED})",
    ),
    ("a word for an int", "devices: two\n", f"{FILE}: devices: expected int, got 'two'"),
    ("a boolean for an int", "devices: true\n", f"{FILE}: devices: expected int, got true"),
    ("a fraction for an int", "devices: 2.5\n", f"{FILE}: devices: expected int, got 2.5"),
    ("a number for a string", "out_dir: 5\n", f"{FILE}: out_dir: expected str, got 5"),
    (
        "a word for a float",
        "train:\n  learning_rate: fast\n",
        f"{FILE}: train.learning_rate: expected float, got 'fast'",
    ),
    (
        "a word for a boolean",
        "checkpoint:\n  async_save: maybe\n",
        f"{FILE}: checkpoint.async_save: expected bool, got 'maybe'",
    ),
    ("a word for a list", "logger:\n  tags: foo\n", f"{FILE}: logger.tags: expected a list of str, got 'foo'"),
    (
        "numbers in a list of strings",
        "logger:\n  tags: [1, 2]\n",
        f"{FILE}: logger.tags: expected a list of str, got [1, 2]",
    ),
    (
        "a choice that is not offered",
        "precision: fp8\n",
        f"{FILE}: precision: 'fp8' is not allowed (choose one of {PRECISIONS})",
    ),
    (
        "a number that is not offered",
        "strategy:\n  name: deepspeed\n  deepspeed:\n    stage: 4\n",
        f"{FILE}: strategy.deepspeed.stage: 4 is not allowed (choose one of 1, 2, 3)",
    ),
    (
        "a wrong type in an options section",
        "strategy:\n  fsdp2:\n    tensor_parallel_size: x\n",
        f"{FILE}: strategy.fsdp2.tensor_parallel_size: expected int, got 'x'",
    ),
    (
        "a choice that is not offered, or null",
        "strategy:\n  process_group_backend: mpi\n",
        f"{FILE}: strategy.process_group_backend: 'mpi' is not allowed (choose one of 'nccl', 'gloo', null)",
    ),
    (
        "a number for a string or null",
        "checkpoint:\n  resume: 5\n",
        f"{FILE}: checkpoint.resume: expected str or null, got 5",
    ),
    (
        "a number for an options section",
        "strategy:\n  fsdp2: 3\n",
        f"{FILE}: strategy.fsdp2: expected a mapping of its keys ({FSDP2}) or null, got 3",
    ),
    ("a number for a section", "train: 5\n", f"{FILE}: train: expected a mapping of its keys ({TRAIN}), got 5"),
    ("null for a section", "train:\n", f"{FILE}: train: expected a mapping of its keys ({TRAIN}), got null"),
    ("null for an int", "devices: null\n", f"{FILE}: devices: expected int, got null"),
]

# (id, overrides on top of cpu-debug.yaml, the whole line after "error: ")
ON_THE_COMMAND_LINE: list[tuple[str, list[str], str]] = [
    (
        "misspelt flag",
        ["--devicez", "2"],
        f"{DEBUG}: unknown option '--devicez': did you mean '--devices'? (allowed: {TOP})",
    ),
    (
        "abbreviated flag",
        ["--train.max_step", "5"],
        f"{DEBUG}: unknown option '--train.max_step': did you mean '--train.max_steps'? (allowed in train: {TRAIN})",
    ),
    (
        "flag of an unknown section",
        ["--trian.max_steps", "5"],
        f"{DEBUG}: unknown option '--trian.max_steps': did you mean '--train.max_steps'? (allowed: {TOP})",
    ),
    (
        "misspelt flag of an options section",
        ["--strategy.fsdp2.bogus", "1"],
        f"{DEBUG}: unknown option '--strategy.fsdp2.bogus' (allowed in strategy.fsdp2: {FSDP2})",
    ),
    (
        "misspelt key in an options section given whole",
        ["--strategy.deepspeed", "{stagee: 4}"],
        f"{DEBUG}: unknown option '--strategy.deepspeed.stagee': did you mean '--strategy.deepspeed.stage'? "
        f"(allowed in strategy.deepspeed: {DEEPSPEED})",
    ),
    ("a word for an int", ["--devices", "two"], f"{DEBUG}: --devices: expected int, got 'two'"),
    ("a word for an int, with =", ["--devices=two"], f"{DEBUG}: --devices: expected int, got 'two'"),
    ("null for an int", ["--devices", "null"], f"{DEBUG}: --devices: expected int, got null"),
    (
        "keys under a value",
        ["--devices.count", "2"],
        f"{DEBUG}: unknown option '--devices.count' (devices takes a value, not keys)",
    ),
    (
        "a choice that is not offered",
        ["--precision", "fp8"],
        f"{DEBUG}: --precision: 'fp8' is not allowed (choose one of {PRECISIONS})",
    ),
    (
        "a number that is not offered",
        ["--strategy.deepspeed.stage", "4"],
        f"{DEBUG}: --strategy.deepspeed.stage: 4 is not allowed (choose one of 1, 2, 3)",
    ),
    (
        "a choice that is not offered, or null",
        ["--strategy.process_group_backend", "mpi"],
        f"{DEBUG}: --strategy.process_group_backend: 'mpi' is not allowed (choose one of 'nccl', 'gloo', null)",
    ),
    (
        "a word for a float or null",
        ["--logger.peak_tflops", "x"],
        f"{DEBUG}: --logger.peak_tflops: expected float or null, got 'x'",
    ),
    ("a number for a section", ["--train", "5"], f"{DEBUG}: --train: expected a mapping of its keys ({TRAIN}), got 5"),
    (
        "a flag without its value",
        ["--train.max_steps"],
        f"{DEBUG}: --train.max_steps: expected int, got no value",
    ),
    (
        "a boolean flag without its value",
        ["--strategy.compile", "--devices", "1"],
        f"{DEBUG}: --strategy.compile: expected bool, got no value",
    ),
    (
        "appending to a value that is not a list",
        ["--devices+", "2"],
        f"{DEBUG}: unknown option '--devices+' (+ appends to a list; devices is not one)",
    ),
    (
        "a word that is not a flag",
        ["extra"],
        f"{DEBUG}: unexpected 'extra' (an override is --key value, as --train.max_steps 20)",
    ),
    ("a recipe flag without its file", ["--config"], f"{DEBUG}: --config: expected a recipe file, got no value"),
]


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The line with which `train` refuses argv (exit code 2, one line, no traceback); argv is only read, so a
    recipe accepted by mistake fails the test rather than training."""

    def read() -> None:
        parse_recipe(argv, "train")

    with pytest.raises(SystemExit) as exited:
        run_command(read)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "line"), [case[1:] for case in IN_THE_FILE], ids=[case[0] for case in IN_THE_FILE])
def test_a_recipe_file_is_refused_in_these_words(
    text: str, line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert refused(["--config", str(write(tmp_path, text))], capsys) == f"error: {line}"


@pytest.mark.parametrize(
    ("overrides", "line"), [case[1:] for case in ON_THE_COMMAND_LINE], ids=[case[0] for case in ON_THE_COMMAND_LINE]
)
def test_a_command_line_override_is_refused_in_these_words(
    overrides: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert refused(["--config", str(RECIPES / "cpu-debug.yaml"), *overrides], capsys) == f"error: {line}"


def test_a_missing_recipe_file_or_a_folder_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    line = refused(["--config", str(missing)], capsys)
    assert line == f"error: recipe 'nope.yaml': file does not exist: '{missing}'"
    line = refused(["--config", str(tmp_path)], capsys)
    assert line == f"error: recipe '{tmp_path.name}': '{tmp_path}' is a folder, not a recipe file"


def test_values_the_schema_accepts_in_any_of_their_spellings(tmp_path: Path) -> None:
    """Numbers in exponent form or quoted, YAML's yes, null for an optional, a list and a section written inline,
    an item appended to a list."""
    recipe_file = write(tmp_path, "devices: '2'\ntrain:\n  learning_rate: 1e-3\n")
    recipe = parse_recipe(
        [
            "--config",
            str(recipe_file),
            "--train.min_learning_rate",
            "1e-4",
            "--checkpoint.async_save",
            "yes",
            "--checkpoint.resume",
            "null",
            "--logger.tags",
            "[a, b]",
            "--logger.tags+",
            "c",
            "--eval",
            "{every_steps: 7}",
            "--out_dir",
            "5",
        ]
    )
    assert recipe.devices == 2 and recipe.train.learning_rate == 1e-3 and recipe.train.min_learning_rate == 1e-4
    assert recipe.checkpoint.async_save is True and recipe.checkpoint.resume is None
    assert recipe.logger.tags == ["a", "b", "c"] and recipe.eval.every_steps == 7 and recipe.out_dir == "5"


@dataclass
class ProfileSection:
    """A section the schema does not have, with the kinds of field it uses."""

    schedule: Literal["once", "every"] = "once"
    steps: list[int] = field(default_factory=list)
    wait_minutes: float | None = None


@dataclass
class GrownRecipe(Recipe):
    profile: ProfileSection = field(default_factory=ProfileSection)


# (id, a recipe file's data or command-line overrides, the line)
GROWN_CASES: list[tuple[str, dict | list[str], str]] = [
    (
        "a choice",
        {"profile": {"schedule": "often"}},
        "profile.schedule: 'often' is not allowed (choose one of 'once', 'every')",
    ),
    (
        "a key",
        {"profile": {"step": [1]}},
        "unknown key 'profile.step': did you mean 'profile.steps'? (allowed in profile: schedule, steps, wait_minutes)",
    ),
    ("a list item", ["--profile.steps", "[1, x]"], '--profile.steps: expected a list of int, got [1, "x"]'),
    (
        "an item appended to a list",
        ["--profile.steps+", "x"],
        "--profile.steps: expected a list of int or int, got 'x'",
    ),
    (
        "an optional float",
        ["--profile.wait_minutes=soon"],
        "--profile.wait_minutes: expected float or null, got 'soon'",
    ),
    (
        "a section",
        ["--profil.steps", "[1]"],
        f"unknown option '--profil.steps': did you mean '--profile.steps'? (allowed: {keys(GrownRecipe)})",
    ),
]


@pytest.mark.parametrize(("given", "line"), [case[1:] for case in GROWN_CASES], ids=[case[0] for case in GROWN_CASES])
def test_a_section_added_to_the_schema_is_checked_with_no_change_to_the_checks(
    given: dict | list[str], line: str
) -> None:
    with pytest.raises(RecipeError) as refused:
        check_document(given, GrownRecipe) if isinstance(given, dict) else check_overrides(given, GrownRecipe)
    assert str(refused.value) == line
    check_document({"profile": {"schedule": "every", "steps": [10, 20], "wait_minutes": None}}, GrownRecipe)
    check_overrides(["--profile.steps", "[1, 2]", "--profile.wait_minutes", "1e-1"], GrownRecipe)
