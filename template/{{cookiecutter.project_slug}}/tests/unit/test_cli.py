"""The recipe library is browsable and copyable from the command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import MULTINODE, RECIPES, cli_env

from {{ cookiecutter.package_name }}.cli import build_parser, main


def test_recipes_list_prints_one_line_per_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes", "list"])
    lines = capsys.readouterr().out.strip().splitlines()
    names = sorted(p.stem for p in RECIPES.glob("*.yaml"))
    assert [line.split()[0] for line in lines] == names
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # every recipe says when to choose it


def test_recipes_show_prints_the_file(capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes", "show", "cpu-debug"])
    assert capsys.readouterr().out == (RECIPES / "cpu-debug.yaml").read_text()


def test_recipes_copy_writes_an_identical_file_and_refuses_to_overwrite(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "mine.yaml"
    main(["recipes", "copy", MULTINODE, str(dest)])
    assert dest.read_text() == (RECIPES / f"{MULTINODE}.yaml").read_text()
    dest.write_text("edited")
    with pytest.raises(SystemExit) as exited:
        main(["recipes", "copy", MULTINODE, str(dest)])
    assert exited.value.code == 2 and dest.read_text() == "edited"
    assert "already exists" in capsys.readouterr().err


def test_recipes_validate_reports_where_each_runs(capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes", "validate", *map(str, sorted(RECIPES.glob("*.yaml")))])
    out = capsys.readouterr().out
    assert out.count("ok: ") == len(list(RECIPES.glob("*.yaml")))
    assert "32 process(es) = 8 device(s) x 4 node(s)" in out


def test_unknown_recipe_name_lists_the_library(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["recipes", "show", "no-such-recipe"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "no-such-recipe" in err and "cpu-debug" in err


def test_unknown_subcommand_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["recipes", "frobnicate"])
    assert exited.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_copying_into_a_folder_keeps_the_recipes_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["recipes", "copy", "cpu-debug", f"{tmp_path / 'new'}/"])  # a folder that does not exist yet
    assert (tmp_path / "new" / "cpu-debug.yaml").read_text() == (RECIPES / "cpu-debug.yaml").read_text()


@pytest.mark.parametrize("argv", [[], ["recipes"], ["checkpoint"]])
def test_a_command_without_its_subcommand_shows_the_choices_and_exits_2(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    captured = capsys.readouterr()
    assert "usage:" in captured.out and ("list" in captured.out if argv else "train" in captured.out)
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: choose a command")


def test_version_is_printed(capsys: pytest.CaptureFixture[str]) -> None:
    from {{ cookiecutter.package_name }} import __version__

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip().endswith(__version__)


def test_checkpoint_list_does_not_import_torch(tmp_path: Path) -> None:
    script = (
        "import sys; sys.modules['torch'] = None\n"
        "from {{ cookiecutter.package_name }}.cli import main\n"
        f"main(['checkpoint', 'list', {str(tmp_path)!r}])\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=cli_env(), capture_output=True, text=True)
    assert result.returncode == 0 and "no checkpoints in" in result.stdout, result.stderr[-2000:]


def command_options(parser: Any, command: str = "") -> dict[str, list[str]]:
    """Every long option of every command (and subcommand) of the command line, by command."""
    options: dict[str, list[str]] = {}
    for action in parser._actions:  # argparse's record of the parser's arguments
        if isinstance(action.choices, dict):  # subcommands: their parsers
            for name, subparser in action.choices.items():
                options |= command_options(subparser, f"{command} {name}".strip())
        else:
            options.setdefault(command, []).extend(o for o in action.option_strings if o.startswith("--"))
    return options


def test_every_option_of_every_command_is_spelled_with_underscores() -> None:
    options = command_options(build_parser())
    every = {name for names in options.values() for name in names}
    assert {"--gpu_memory_gib", "--train.max_steps", "--pvc"} <= every
{%- if cookiecutter.include_slurm == "yes" %}
    assert {"--job_name", "--max_timeouts"} <= every
{%- endif %}
    dashed = {command: [name for name in names if "-" in name[2:]] for command, names in options.items()}
    assert not {command: names for command, names in dashed.items() if names}


@pytest.mark.parametrize(
    "words",
    [
        ["plan", "fsdp2-node", "--gpu-memory-gib", "80"],
{%- if cookiecutter.include_slurm == "yes" %}
        ["slurm", "fsdp2-node", "--job-name=mine"],
        ["submit", "cpu-debug", "--max-timeouts", "2"],
{%- endif %}
        ["train", "--config", "recipes/cpu-debug.yaml", "--train.max-steps", "5"],
    ],
)
def test_a_dashed_option_is_refused_naming_its_underscore_spelling(
    words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    (dashed,) = [word.split("=")[0] for word in words if word.startswith("--") and "-" in word[2:]]
    with pytest.raises(SystemExit) as exited:
        main(words)
    assert exited.value.code == 2
    right = "--" + dashed[2:].replace("-", "_")
    assert capsys.readouterr().err == f"error: {dashed}: options are spelled with underscores: {right}\n"


def test_every_dashed_spelling_of_a_command_option_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """The task's commands too (`prepare`, `sample`/`predict`, `export`), not only the machinery's."""
    for command, names in command_options(build_parser()).items():
        for name in [name for name in names if "_" in name and "." not in name]:
            dashed = "--" + name[2:].replace("_", "-")
            with pytest.raises(SystemExit) as exited:
                main([*command.split(), dashed, "1"])
            assert exited.value.code == 2
            assert capsys.readouterr().err == f"error: {dashed}: options are spelled with underscores: {name}\n"
