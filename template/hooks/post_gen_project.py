"""Bring the recipe library into the new project and remove files for options not chosen."""

import shutil
import sys
from pathlib import Path

# The template folder; the recipe library lives beside it at the top of the template repository.
TEMPLATE_DIR = Path("{{ cookiecutter._repo_dir }}")
INCLUDE_SLURM = "{{ cookiecutter.include_slurm }}" == "yes"
LICENSE = "{{ cookiecutter.license }}"


def copy_recipes(project: Path) -> None:
    """Copy the top-level recipes/ (the single source of truth) into the project."""
    library = TEMPLATE_DIR.parent / "recipes"
    if not library.is_dir():
        sys.exit(f"ERROR: recipe library not found at {library}; the template repository is incomplete")
    target = project / "recipes"
    target.mkdir(exist_ok=True)
    for recipe in sorted(library.glob("*.yaml")):
        shutil.copy2(recipe, target / recipe.name)


def prune(project: Path) -> None:
    """Remove what the chosen options do not use."""
    if LICENSE == "none":
        (project / "LICENSE").unlink()
    if not INCLUDE_SLURM:
        shutil.rmtree(project / "scripts" / "slurm")
        scripts = project / "scripts"
        if scripts.is_dir() and not any(scripts.iterdir()):
            scripts.rmdir()


if __name__ == "__main__":
    project_dir = Path.cwd()
    copy_recipes(project_dir)
    prune(project_dir)
