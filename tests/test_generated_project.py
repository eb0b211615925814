"""The generated project installs, its commands work, and its whole test suite passes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from conftest import run

SKIPPED = re.compile(r"\b\d+ skipped\b")  # pytest's summary count (a test's name may hold the word)


def test_generated_test_suite_passes(default_project: Path) -> None:
    """Every test of the default project but its `matrix` cases (more cases of what another case shows)."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not matrix"]
    result = run(args, cwd=default_project, timeout=3600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and not SKIPPED.search(result.stdout)


def test_generated_image_project_passes_its_tasks_tests(image_project: Path) -> None:
    """The image classifier's project: its task's tests, quick and multi-process. The machinery's quick tests run on
    an image classifier's project in test_bake.py (`test_every_choice_passes_its_quick_tests`), the machinery's
    multi-process tests on this one under `scripts/test.sh --full`."""
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not matrix", "tests/tasks"]
    result = run(args, cwd=image_project, timeout=1800)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and not SKIPPED.search(result.stdout)


@pytest.mark.full
def test_generated_projects_matrix_cases_pass(default_project: Path) -> None:
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "matrix"], cwd=default_project)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and not SKIPPED.search(result.stdout)


@pytest.mark.full
def test_generated_image_project_passes_its_whole_suite(image_project: Path) -> None:
    result = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"], cwd=image_project, timeout=2400)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and not SKIPPED.search(result.stdout)


def test_installed_console_script_and_module_entry_point(default_project: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    install = run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--disable-pip-version-check",
            "--target",
            str(site),
            str(default_project),
        ],
        cwd=tmp_path,
    )
    assert install.returncode == 0, install.stderr
    script = site / "bin" / "my-project"
    listed = run([sys.executable, str(script), "recipes", "list"], cwd=default_project, PYTHONPATH=str(site))
    assert listed.returncode == 0 and "fsdp2-multinode" in listed.stdout, listed.stderr
    validated = run(
        [sys.executable, "-m", "my_project", "recipes", "validate", "recipes/cpu-debug.yaml"],
        cwd=default_project,
        PYTHONPATH=str(site),
    )
    assert validated.returncode == 0 and "ok: recipes/cpu-debug.yaml" in validated.stdout, validated.stderr
