"""The documentation: the site builds strictly and offline, its generated reference names every command and every
recipe field, every page of its nav is built, and the README stays one screen."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import types
import typing
from fnmatch import fnmatch
from pathlib import Path

import pytest
import yaml
from helpers import PROJECT

from {{ cookiecutter.package_name }}.commands import command_table
from {{ cookiecutter.package_name }}.project import TASK
from {{ cookiecutter.package_name }}.recipe.library import recipes_on
from {{ cookiecutter.package_name }}.tasks import task_class

README_LINES = 300  # one screen to start; the rest is in docs/
NOWHERE = "http://127.0.0.1:9"  # a proxy that refuses: a build that reaches for the network fails


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built as CI builds it: strict (any warning, a missing page or anchor, fails), offline."""
    folder = tmp_path_factory.mktemp("site")
    offline = {name: NOWHERE for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")}
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(folder)],
        cwd=PROJECT,
        capture_output=True,
        text=True,
        env={**os.environ, **offline, "NO_PROXY": "", "no_proxy": "", "NO_MKDOCS_2_WARNING": "1"},
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return folder


def nav_pages(nav: list) -> list[str]:
    """The Markdown pages a nav lists, sections walked."""
    found = []
    for entry in nav:
        for value in entry.values() if isinstance(entry, dict) else [entry]:
            found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def built_page(site: Path, page: str) -> Path:
    """Where a page of docs/ lands in the site (a folder per page, index.md at the top)."""
    stem = page.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem}/index.html")


def recipe_fields(cls: type, prefix: str = "") -> list[str]:
    """Every field of a recipe dataclass by its dotted name, sections (optional ones too) walked."""
    names = []
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        kind = hints[field.name]
        if typing.get_origin(kind) in (typing.Union, types.UnionType):
            members = [arg for arg in typing.get_args(kind) if arg is not type(None)]
            kind = members[0] if len(members) == 1 else kind
        names.append(prefix + field.name)
        if dataclasses.is_dataclass(kind) and isinstance(kind, type):
            names += recipe_fields(kind, f"{prefix}{field.name}.")
    return names


def test_the_readme_is_one_screen() -> None:
    lines = (PROJECT / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines: move a topic into docs/"


def test_the_readmes_table_of_rehearsed_against_planned_names_every_gpu_recipe_of_the_library() -> None:
    readme = (PROJECT / "README.md").read_text()
    rows = [line.split("|")[1] for line in readme.splitlines() if re.match(r"^\| [a-z0-9*-]+[ ,(|]", line)]
    named = [re.sub(r"\(.*", "", name).strip() for row in rows for name in row.split(",")]
    missing = [recipe for recipe in recipes_on("cuda") if not any(fnmatch(recipe, name) for name in named)]
    assert not missing, f"the README's table of rehearsed against planned lacks {missing}"


def test_the_site_is_offline_and_every_page_of_its_nav_is_built(site: Path) -> None:
    config = yaml.safe_load((PROJECT / "mkdocs.yml").read_text())
    assert config["strict"] is True
    assert config["theme"]["name"] == "material" and config["theme"]["font"] is False  # no web fonts
    assert not {next(iter(plugin)) if isinstance(plugin, dict) else plugin for plugin in config.get("plugins", [])} - {
        "search"
    }, "a plugin beyond search may fetch from the network"
    pages = nav_pages(config["nav"])
    for page in pages:
        assert built_page(site, page).is_file(), f"{page}: in the nav, not in the site"
    written = {path.relative_to(PROJECT / "docs").as_posix() for path in (PROJECT / "docs").glob("*.md")}
    assert written <= set(pages), f"pages the nav does not list: {sorted(written - set(pages))}"


def test_the_command_reference_holds_every_command(site: Path) -> None:
    page = built_page(site, "reference/commands.md").read_text()
    for name in command_table():
        assert f"<code>{name}</code>" in page, f"{name}: not in the command reference"
    assert "usage:" in page


def test_the_recipe_reference_holds_every_field_of_the_tasks_recipe(site: Path) -> None:
    page = built_page(site, "reference/recipe.md").read_text()
    fields = recipe_fields(task_class(TASK).recipe_type)
    assert "strategy.fsdp2.tensor_parallel_size" in fields and "train.max_steps" in fields
    missing = [name for name in fields if f"<code>{name}</code>" not in page]
    assert missing == [], f"not in the recipe reference: {missing}"
