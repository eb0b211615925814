"""A recipe is checked before anything runs: bad input gets one line naming the field, exit code 2."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from helpers import RECIPES, fail_with, run_cli

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.checks import check_recipe
from {{ cookiecutter.package_name }}.recipe.load import load_recipe, parse_recipe
from {{ cookiecutter.package_name }}.recipe.schema import Recipe


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("recipe", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_library_recipe_validates(recipe: Path) -> None:
    assert isinstance(load_recipe(recipe), Recipe)


def test_unknown_strategy_names_field_and_choices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(["train", "--config", str(write(tmp_path, "strategy:\n  name: zero9\n"))], capsys)
    assert "strategy.name" in err and "zero9" in err and "ddp" in err and "fsdp2" in err


def test_unknown_top_level_key_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(["train", "--config", str(write(tmp_path, "devicez: 2\n"))], capsys)
    assert "devicez" in err and "devices" in err and "bad.yaml" in err


def test_unknown_nested_key_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(["train", "--config", str(write(tmp_path, "train:\n  max_step: 5\n"))], capsys)
    assert "train.max_step" in err and "max_steps" in err


def test_devices_must_be_an_int(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(["train", "--config", str(write(tmp_path, "devices: two\n"))], capsys)
    assert "devices" in err and "int" in err and "two" in err


def test_negative_steps_from_override(capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(["train", "--config", str(RECIPES / "cpu-debug.yaml"), "--train.max_steps", "-5"], capsys)
    assert "train.max_steps=-5" in err and ">= 1" in err


def test_missing_config_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(["train", "--config", str(tmp_path / "nope.yaml")], capsys)
    assert "nope.yaml" in err and "does not exist" in err


def test_fsdp2_refuses_16_mixed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = fail_with(
        ["train", "--config", str(write(tmp_path, "strategy:\n  name: fsdp2\nprecision: 16-mixed\n"))], capsys
    )
    assert "precision=16-mixed" in err and "bf16-mixed" in err


def test_missing_resume_checkpoint_fails_before_writing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "run"
    argv = [
        "train",
        "--config",
        str(RECIPES / "cpu-debug.yaml"),
        "--out_dir",
        str(out_dir),
        "--checkpoint.resume",
        str(tmp_path / "missing"),
    ]
    err = fail_with(argv, capsys)
    assert "checkpoint.resume" in err and "missing" in err
    assert not out_dir.exists()


def test_bad_input_from_the_command_line_prints_no_traceback(tmp_path: Path) -> None:
    result = run_cli(
        "train", "--config", str(write(tmp_path, "strategy:\n  name: zero9\n")), "--out_dir", str(tmp_path / "o")
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and "strategy.name" in result.stderr
    assert not (tmp_path / "o").exists()


def test_dotted_overrides_apply_on_top_of_the_file() -> None:
    recipe = parse_recipe(
        ["--config", str(RECIPES / "cpu-debug.yaml"), "--train.max_steps", "7", "--strategy.name", "ddp"]
    )
    assert recipe.train.max_steps == 7 and recipe.strategy.name == "ddp"
    assert recipe.devices == 2  # untouched values come from the file


def test_recipes_validate_applies_the_overrides_train_takes(capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes", "validate", "cpu-debug", str(RECIPES / "cpu-debug.yaml"), "--devices", "3", "--train.max_steps=5"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and all(" --devices 3 --train.max_steps=5: 3 process(es) = 3 device(s)" in x for x in lines)


@pytest.mark.parametrize(
    ("override", "field"),
    [(["--train.max_step", "5"], "--train.max_step"), (["--train.max_steps", "-5"], "train.max_steps=-5")],
    ids=["unknown field", "out of range"],
)
def test_recipes_validate_refuses_a_bad_override_as_train_does(
    override: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = str(RECIPES / "cpu-debug.yaml")
    refused = fail_with(["recipes", "validate", recipe, *override], capsys)
    assert field in refused and "cpu-debug.yaml" in refused
    assert refused == fail_with(["train", "--config", recipe, *override], capsys)


def test_recipes_validate_refuses_a_key_given_twice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    recipe = tmp_path / "twice.yaml"
    recipe.write_text((RECIPES / "cpu-debug.yaml").read_text() + "\ndevices: 3\n")
    assert "duplicate key 'devices' (first on line" in fail_with(["recipes", "validate", str(recipe)], capsys)


def test_print_config_shows_the_resolved_recipe() -> None:
    result = run_cli("train", "--config", str(RECIPES / "cpu-debug.yaml"), "--train.max_steps", "7", "--print_config")
    assert result.returncode == 0, result.stderr
    assert "max_steps: 7" in result.stdout and "name: fsdp2" in result.stdout


@pytest.mark.parametrize(
    "printing", [["--print_config"], ["--print_config=skip_null"], ["--print_config", "skip_null"]]
)
def test_print_config_runs_the_checks_before_printing(printing: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["train", "--config", str(RECIPES / "cpu-debug.yaml"), "--train.max_steps", "-5", *printing]
    assert "train.max_steps=-5 must be >= 1" in fail_with(argv, capsys)  # exit 2, nothing printed but the line


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"devices": 0}, "devices"),
        ({"model": {"n_head": 3}}, "model.n_head"),
        ({"data": {"val_fraction": 1.5}}, "data.val_fraction"),
{%- if cookiecutter.task == "language_model" %}
        ({"data": {"shuffle_blocks": 0}}, "data.shuffle_blocks"),
        ({"data": {"cache_gb": 0.0}}, "data.cache_gb"),
{%- endif %}
        ({"data": {"source": "{% if cookiecutter.task == "language_model" %}tokens{% else %}prepared{% endif %}"}}, "data.path"),
        ({"train": {"learning_rate": 0.0}}, "train.learning_rate"),
    ],
)
def test_check_recipe_names_the_field(change: dict, field: str) -> None:
    recipe = load_recipe(RECIPES / "cpu-debug.yaml")
    for key, value in change.items():
        if isinstance(value, dict):
            for sub, subvalue in value.items():
                setattr(getattr(recipe, key), sub, subvalue)
        else:
            setattr(recipe, key, value)
    with pytest.raises(RecipeError, match=field.replace(".", r"\.")):
        check_recipe(recipe)


def test_a_recipe_whose_aliases_explode_is_refused_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A few hundred bytes of nested aliases ("billion laughs") would expand to gigabytes; refused before building."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 9)]
    bomb = write(tmp_path, "\n".join(lines) + "\ndevices: *a8\n")
    assert bomb.stat().st_size < 1000
    started = time.perf_counter()
    err = fail_with(["train", "--config", str(bomb)], capsys)
    assert "aliases expand it beyond" in err and time.perf_counter() - started < 5


def test_a_huge_recipe_file_and_a_huge_value_give_a_short_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = fail_with(["train", "--config", str(write(tmp_path, "devices: 2\n" + "#" * (2 << 20) + "\n"))], capsys)
    assert "a recipe is at most" in err
    huge = write(tmp_path, "devices: [" + "1, " * 30_000 + "]\n")  # jsonargparse's message quotes the value
    err = fail_with(["train", "--config", str(huge)], capsys)
    assert "devices" in err and len(err) <= len("error: ") + 1000  # errors.MAX_ERROR_CHARACTERS


@pytest.mark.parametrize(
    ("override", "field"),
    [
        (["--train.max_steps", str(10**18)], "train.max_steps"),
        (["--train.seed", str(2**63)], "train.seed"),
        (["--train.seed", "-1"], "train.seed"),
        (["--train.micro_batch_size", str(2**40)], "train.micro_batch_size"),
    ],
)
def test_values_that_would_overflow_later_are_refused_at_the_recipe(
    override: list[str], field: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = fail_with(
        ["train", "--config", str(RECIPES / "cpu-debug.yaml"), *override, "--out_dir", str(tmp_path / "r")], capsys
    )
    assert f"{field}=" in err and not (tmp_path / "r").exists()


def test_more_cpu_processes_than_the_machine_holds_are_refused_before_any_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from {{ cookiecutter.package_name }}.training.run import cpu_process_limit

    devices = str(cpu_process_limit() + 1)
    err = fail_with(
        ["train", "--config", str(RECIPES / "cpu-debug.yaml"), "--devices", devices, "--out_dir", str(tmp_path / "r")],
        capsys,
    )
    assert f"devices={devices} CPU processes on one node" in err
