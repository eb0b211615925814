"""Every refusal of a recipe's keys and value types, word for word: the line a user reads is the project's own.

Each case is a recipe file or command-line overrides that the schema refuses; the test holds the whole line
(exit code 2, one line, no traceback). Lists of keys are read from the schema, so a new field changes them
without changing the test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from helpers import RECIPES, fail_with

from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.recipe.schema import DeepSpeedOptions, Fsdp2Options, Recipe, TrainConfig
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
    ("misspelt key", "devicez: 2\n", f"{FILE}: unknown key 'devicez' (allowed: {TOP})"),
    ("unknown key with an empty mapping", "optimiser: {}\n", f"{FILE}: unknown key 'optimiser' (allowed: {TOP})"),
    (
        "misspelt key in a section",
        "train:\n  max_step: 5\n",
        f"{FILE}: unknown key 'train.max_step' (allowed in train: {TRAIN})",
    ),
    (
        "misspelt key in an options section",
        "strategy:\n  name: deepspeed\n  deepspeed:\n    stagee: 3\n",
        f"{FILE}: unknown key 'strategy.deepspeed.stagee' (allowed in strategy.deepspeed: {DEEPSPEED})",
    ),
    ("a word for an int", "devices: two\n", f"{FILE}: devices: expected int, got 'two'"),
    ("a boolean for an int", "devices: true\n", f"{FILE}: devices: expected int, got 'True'"),
    ("a fraction for an int", "devices: 2.5\n", f"{FILE}: devices: expected int, got '2.5'"),
    ("a number for a string", "out_dir: 5\n", f"{FILE}: out_dir: expected str, got '5'"),
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
    ("a word for a list", "logger:\n  tags: foo\n", f"{FILE}: logger.tags: expected list, got 'foo'"),
    ("numbers in a list of strings", "logger:\n  tags: [1, 2]\n", f"{FILE}: logger.tags: expected str, got '1'"),
    (
        "a choice that is not offered",
        "precision: fp8\n",
        f"{FILE}: precision: 'fp8' is not allowed (choose one of {PRECISIONS})",
    ),
    (
        "a number that is not offered",
        "strategy:\n  name: deepspeed\n  deepspeed:\n    stage: 4\n",
        f"{FILE}: strategy.deepspeed.stage: '4' is not allowed (choose one of 1, 2, 3)",
    ),
    (
        "a wrong type in an options section",
        "strategy:\n  fsdp2:\n    tensor_parallel_size: x\n",
        f"{FILE}: strategy.fsdp2.tensor_parallel_size: expected int, got 'x'",
    ),
    (
        "a choice that is not offered, or null",
        "strategy:\n  process_group_backend: mpi\n",
        f"{FILE}: strategy.process_group_backend: Does not validate against any of the Union subtypes",
    ),
    (
        "a number for a string or null",
        "checkpoint:\n  resume: 5\n",
        f"{FILE}: checkpoint.resume: Does not validate against any of the Union subtypes",
    ),
    (
        "a number for an options section",
        "strategy:\n  fsdp2: 3\n",
        f"{FILE}: strategy.fsdp2: Does not validate against any of the Union subtypes",
    ),
]

# (id, overrides on top of cpu-debug.yaml, the whole line after "error: ")
ON_THE_COMMAND_LINE: list[tuple[str, list[str], str]] = [
    (
        "misspelt flag",
        ["--devicez", "2"],
        f"{DEBUG}: unknown option '--devicez' (allowed: {TOP}; abbreviations are not accepted)",
    ),
    (
        "abbreviated flag",
        ["--train.max_step", "5"],
        f"{DEBUG}: unknown option '--train.max_step' (allowed in train: {TRAIN}; abbreviations are not accepted)",
    ),
    (
        "flag of an unknown section",
        ["--trian.max_steps", "5"],
        f"{DEBUG}: unknown option '--trian.max_steps' (no section 'trian'; sections and keys: {TOP})",
    ),
    (
        "misspelt flag of an options section",
        ["--strategy.fsdp2.bogus", "1"],
        f"{DEBUG}: unknown key 'strategy.fsdp2.bogus' (allowed in strategy.fsdp2: {FSDP2})",
    ),
    (
        "misspelt key in an options section given whole",
        ["--strategy.deepspeed", "{stagee: 4}"],
        f"{DEBUG}: unknown key 'strategy.deepspeed.stagee' (allowed in strategy.deepspeed: {DEEPSPEED})",
    ),
    ("a word for an int", ["--devices", "two"], f"{DEBUG}: devices: expected int, got 'two'"),
    ("a word for an int, with =", ["--devices=two"], f"{DEBUG}: devices: expected int, got 'two'"),
    ("null for an int", ["--devices", "null"], f"{DEBUG}: devices: expected int, got 'None'"),
    (
        "a choice that is not offered",
        ["--precision", "fp8"],
        f"{DEBUG}: precision: 'fp8' is not allowed (choose one of {PRECISIONS})",
    ),
    (
        "a number that is not offered",
        ["--strategy.deepspeed.stage", "4"],
        f"{DEBUG}: strategy.deepspeed.stage: '4' is not allowed (choose one of 1, 2, 3)",
    ),
    (
        "a choice that is not offered, or null",
        ["--strategy.process_group_backend", "mpi"],
        f"{DEBUG}: strategy.process_group_backend: Does not validate against any of the Union subtypes",
    ),
    (
        "a word for a float or null",
        ["--logger.peak_tflops", "x"],
        f"{DEBUG}: logger.peak_tflops: Does not validate against any of the Union subtypes",
    ),
    ("a number for a section", ["--train", "5"], f"{DEBUG}: train: Unable to load config '5'"),
    (
        "a flag without its value",
        ["--train.max_steps"],
        f"{DEBUG}: argument --train.max_steps: expected one argument",
    ),
    (
        "a boolean flag without its value",
        ["--strategy.compile", "--devices", "1"],
        f"{DEBUG}: argument --strategy.compile: expected one argument",
    ),
    ("a word that is not a flag", ["extra"], f"{DEBUG}: unrecognized arguments: extra"),
]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "line"), [case[1:] for case in IN_THE_FILE], ids=[case[0] for case in IN_THE_FILE])
def test_a_recipe_file_is_refused_in_these_words(
    text: str, line: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fail_with(["train", "--config", str(write(tmp_path, text))], capsys) == f"error: {line}"


@pytest.mark.parametrize(
    ("overrides", "line"), [case[1:] for case in ON_THE_COMMAND_LINE], ids=[case[0] for case in ON_THE_COMMAND_LINE]
)
def test_a_command_line_override_is_refused_in_these_words(
    overrides: list[str], line: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fail_with(["train", "--config", str(RECIPES / "cpu-debug.yaml"), *overrides], capsys) == f"error: {line}"


def test_a_missing_recipe_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.yaml"
    line = fail_with(["train", "--config", str(missing)], capsys)
    assert line == f"error: recipe 'nope.yaml': file does not exist: '{missing}'"


def test_values_the_schema_accepts_in_any_of_their_spellings(tmp_path: Path) -> None:
    """Numbers in exponent form or quoted, YAML's yes, null for an optional, a list and a section written inline."""
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
            "--eval",
            "{every_steps: 7}",
            "--out_dir",
            "5",
        ]
    )
    assert recipe.devices == 2 and recipe.train.learning_rate == 1e-3 and recipe.train.min_learning_rate == 1e-4
    assert recipe.checkpoint.async_save is True and recipe.checkpoint.resume is None
    assert recipe.logger.tags == ["a", "b"] and recipe.eval.every_steps == 7 and recipe.out_dir == "5"
