"""Bake the template with the cookiecutter API, as a user's `cookiecutter <repo>` would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cookiecutter.main import cookiecutter

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
# The recipe library, one folder per task, inside the template: a project keeps its task's in recipes/.
LIBRARY = REPO / "template" / "{{cookiecutter.project_slug}}" / "recipes"


def bake(output_dir: Path, **answers: Any) -> Path:
    """Generate a project with default answers overridden by `answers`; return its folder."""
    return Path(cookiecutter(str(REPO), no_input=True, extra_context=answers, output_dir=str(output_dir)))


def run(args: list[str], cwd: Path, timeout: float = 900, **env: str) -> subprocess.CompletedProcess:
    """Run a command with this interpreter's tools first on PATH."""
    environment = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", **env}
    environment.pop("WANDB_API_KEY", None)
    return subprocess.run(args, cwd=cwd, env=environment, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def default_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project generated with every default answer."""
    return bake(tmp_path_factory.mktemp("default"))


@pytest.fixture(scope="session")
def image_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project generated with every default answer but `task: image_classification`."""
    return bake(tmp_path_factory.mktemp("image"), task="image_classification")
