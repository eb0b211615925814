"""The template generates a clean, lint-free project for every answer, and refuses bad answers."""

from __future__ import annotations

import itertools
import re
import sys
from pathlib import Path

import pytest
from conftest import REPO, bake, run
from cookiecutter.exceptions import FailedHookException

JINJA = re.compile(r"\{\{|\{%|\{#")


def text_files(project: Path) -> list[Path]:
    return [p for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts]


def assert_fully_rendered(project: Path) -> None:
    for path in text_files(project):
        assert not JINJA.search(path.read_text()), f"unrendered template syntax in {path}"


def assert_ruff_clean(project: Path) -> None:
    lint = run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=project)
    assert lint.returncode == 0, lint.stdout + lint.stderr
    fmt = run([sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."], cwd=project)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr


def test_default_answers_give_the_documented_layout(default_project: Path) -> None:
    assert default_project.name == "my-project"
    package = default_project / "src" / "my_project"
    modules = {"cli", "config", "fabric_setup", "parallel", "model", "data", "train", "checkpoint", "observe"}
    packages = {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}  # e.g. data/
    assert modules <= {p.stem for p in package.glob("*.py")} | packages
    for extra in ("pyproject.toml", "README.md", ".github/workflows/ci.yml", "scripts/slurm/train.sbatch"):
        assert (default_project / extra).is_file(), extra
    assert 'default="wandb"' in (package / "config.py").read_text().replace(" ", "").replace(
        'Literal["wandb","tensorboard","csv","none"]=', "default="
    )


def test_the_recipe_library_is_copied_verbatim(default_project: Path) -> None:
    library = sorted((REPO / "recipes").glob("*.yaml"))
    assert len(library) >= 5
    for recipe in library:
        assert (default_project / "recipes" / recipe.name).read_bytes() == recipe.read_bytes()


@pytest.mark.parametrize(
    ("logger", "include_slurm"), list(itertools.product(["wandb", "tensorboard", "csv"], ["yes", "no"]))
)
def test_every_choice_renders_lints_and_passes_its_quick_tests(tmp_path: Path, logger: str, include_slurm: str) -> None:
    project = bake(tmp_path, logger=logger, include_slurm=include_slurm)
    assert_fully_rendered(project)
    assert_ruff_clean(project)
    assert (project / "scripts" / "slurm" / "train.sbatch").exists() == (include_slurm == "yes")
    assert ("sbatch" in (project / "README.md").read_text()) == (include_slurm == "yes")
    config = (project / "src" / "my_project" / "config.py").read_text()
    assert re.search(rf'name: Literal\[.*\] = "{logger}"', config)
    quick = run([sys.executable, "-m", "pytest", "-q", "-m", "not slow", "-p", "no:cacheprovider"], cwd=project)
    assert quick.returncode == 0, quick.stdout[-3000:] + quick.stderr[-2000:]
    assert " passed" in quick.stdout and "skipped" not in quick.stdout, quick.stdout[-500:]


def test_custom_names_flow_into_package_command_and_imports(tmp_path: Path) -> None:
    project = bake(tmp_path, project_name="Deep Net 2", author="Ada O'Neil", description="Trains it.")
    assert project.name == "deep-net-2"
    assert (project / "src" / "deep_net_2" / "train.py").is_file()
    assert 'deep-net-2 = "deep_net_2.cli:main"' in (project / "pyproject.toml").read_text()
    assert_fully_rendered(project)
    assert_ruff_clean(project)
    listed = run([sys.executable, "-m", "deep_net_2", "recipes", "list"], cwd=project, PYTHONPATH=str(project / "src"))
    assert listed.returncode == 0 and "cpu-debug" in listed.stdout, listed.stderr


@pytest.mark.parametrize(
    ("answers", "message"),
    [
        ({"package_name": "2fast"}, "package_name '2fast' is not a valid Python package name"),
        ({"package_name": "class"}, "package_name 'class' is not a valid Python package name"),
        ({"project_slug": "team/project"}, "project_slug 'team/project' is not a valid folder"),
        ({"description": 'say "hi"'}, "description"),
    ],
)
def test_invalid_answers_stop_generation_with_a_message(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], answers: dict[str, str], message: str
) -> None:
    with pytest.raises(FailedHookException):
        bake(tmp_path, **answers)
    assert message in capfd.readouterr().err
    # cookiecutter itself may leave an empty parent folder of a slug with '/'; no file may remain.
    assert not [p for p in tmp_path.rglob("*") if p.is_file()], "a refused project must leave nothing behind"


def test_command_line_no_input_generates_the_default_project(tmp_path: Path) -> None:
    result = run(
        [str(Path(sys.executable).parent / "cookiecutter"), "--no-input", str(REPO), "-o", str(tmp_path)], cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "my-project" / "recipes" / "cpu-debug.yaml").is_file()


def test_unknown_choice_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="logger"):
        bake(tmp_path, logger="mlflow")


def test_every_recipe_says_when_to_choose_it() -> None:
    for recipe in sorted((REPO / "recipes").glob("*.yaml")):
        header = recipe.read_text().splitlines()[:2]
        assert all(line.startswith("# ") for line in header), recipe.name
        assert "choose" in " ".join(header).lower(), recipe.name
