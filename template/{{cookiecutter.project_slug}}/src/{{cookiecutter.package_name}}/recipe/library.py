"""The recipe library: find a recipe by name, list, show and copy them (`<project> recipes ...`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import RecipeError


def recipes_dir() -> Path:
    """The recipe library: `recipes/` of the source checkout (also under an editable install), else the
    copy a regular install or wheel carries as package data (`<package>/recipes`, see pyproject.toml), else
    `recipes/` in the current folder."""
    beside_source = Path(__file__).resolve().parents[3] / "recipes"
    if beside_source.is_dir():
        return beside_source
    installed = Path(__file__).resolve().parents[1] / "recipes"
    return installed if installed.is_dir() else Path.cwd() / "recipes"


def find_recipe(name: str) -> Path:
    """A recipe by library name (`cpu-debug`) or by path."""
    path = Path(name)
    if path.is_file():
        return path
    candidate = recipes_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if candidate.is_file():
        return candidate
    available = ", ".join(p.stem for p in sorted(recipes_dir().glob("*.yaml"))) or "none"
    raise RecipeError(f"recipe {name!r} not found (library recipes: {available})")


def recipes_on(accelerator: str) -> list[str]:
    """The library's recipes for one accelerator (`cuda`: the GPU recipes), by name."""
    import yaml

    return [
        path.stem
        for path in sorted(recipes_dir().glob("*.yaml"))
        if (yaml.safe_load(path.read_text()) or {}).get("accelerator") == accelerator
    ]


def recipe_for_layout(cpu: bool, several_nodes: bool) -> Path:
    """The first library recipe on CPUs (or GPUs) and on one node (or several): what `plan --write` starts from
    when the recipe its strategy names is not in this library."""
    import yaml

    for path in sorted(recipes_dir().glob("*.yaml")):
        recipe = yaml.safe_load(path.read_text()) or {}
        if (recipe.get("accelerator") == "cpu") == cpu and (int(recipe.get("num_nodes", 1)) > 1) == several_nodes:
            return path
    raise RecipeError("no library recipe of this layout to write the plan from: pass one (`plan RECIPE --write ...`)")


def summary(path: Path) -> str:
    """The first header comment line of a recipe: when to choose it."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def list_recipes() -> None:
    """Print the library, one line per recipe."""
    recipes = sorted(recipes_dir().glob("*.yaml"))
    width = max((len(p.stem) for p in recipes), default=0)
    for path in recipes:
        print(f"{path.stem:<{width}}  {summary(path)}")


def show_recipe(name: str) -> None:
    """Print a recipe file as it is."""
    print(find_recipe(name).read_text(), end="")


def copy_recipe(name: str, dest: str, force: bool = False, program: str = "") -> None:
    """Copy a library recipe to a new file to edit."""
    source, target = find_recipe(name), Path(dest)
    if target.is_dir() or dest.endswith(("/", os.sep)):  # `copy X newdir/`: into that folder, made if needed
        target = target / source.name
    if target.exists() and not force:
        raise RecipeError(f"{target} already exists (choose another destination or pass --force)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    print(f"Copied {source.stem} to {target}; edit it, then: {program} train --config {target}")
