"""The recipe library is browsable and copyable from the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import RECIPES

from {{ cookiecutter.package_name }}.cli import main


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
    main(["recipes", "copy", "fsdp2-multinode", str(dest)])
    assert dest.read_text() == (RECIPES / "fsdp2-multinode.yaml").read_text()
    dest.write_text("edited")
    with pytest.raises(SystemExit) as exited:
        main(["recipes", "copy", "fsdp2-multinode", str(dest)])
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
