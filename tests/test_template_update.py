"""A project made with cruft takes in later template changes, keeping its own edits."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from conftest import BIN, LIBRARY, REPO, run

# Commits in temporary repositories need an identity; none is read from the machine's git config.
GIT = {
    "GIT_AUTHOR_NAME": "Test",
    "GIT_AUTHOR_EMAIL": "test@example.com",
    "GIT_COMMITTER_NAME": "Test",
    "GIT_COMMITTER_EMAIL": "test@example.com",
    "GIT_CONFIG_GLOBAL": "/dev/null",
}
NOT_TEMPLATE = shutil.ignore_patterns(".git", ".venv", "build", "__pycache__", ".*_cache", "runs", "wandb")


def git(cwd: Path, *args: str) -> str:
    result = run(["git", *args], cwd=cwd, **GIT)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def commit_all(cwd: Path, message: str) -> str:
    git(cwd, "add", "-A")
    git(cwd, "commit", "-q", "-m", message)
    return git(cwd, "rev-parse", "HEAD")


def cruft(cwd: Path, *args: str, **env: str) -> None:
    result = run([str(BIN / "cruft"), *args], cwd=cwd, **GIT, **env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def counting_git(folder: Path) -> tuple[dict[str, str], Path]:
    """An environment whose `git` records each command line in a log, then runs git; and that log."""
    folder.mkdir()
    log = folder / "git.log"
    real = shutil.which("git")
    wrapper = folder / "git"
    wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    return {
        "PATH": f"{folder}{os.pathsep}{BIN}{os.pathsep}{os.environ['PATH']}",
        "GIT_PYTHON_GIT_EXECUTABLE": str(wrapper),
    }, log


def test_cruft_update_applies_a_later_template_change_and_keeps_local_edits(tmp_path: Path) -> None:
    template = tmp_path / "template-repo"
    shutil.copytree(REPO, template, ignore=NOT_TEMPLATE)
    git(template, "init", "-q")
    first = commit_all(template, "template v1")

    # What the README tells a user to run: the template is fetched once, recipes and all.
    env, git_log = counting_git(tmp_path / "bin")
    cruft(tmp_path, "create", str(template), "--directory", "template", "--no-input", **env)
    clones = [line for line in git_log.read_text().splitlines() if " clone " in f" {line} "]
    assert len(clones) == 1 and str(template) in clones[0], clones
    project = tmp_path / "my-project"
    recorded = json.loads((project / ".cruft.json").read_text())
    assert (recorded["template"], recorded["commit"], recorded["directory"]) == (str(template), first, "template")
    library = sorted(path.name for path in (LIBRARY / "language_model").glob("*.yaml"))
    assert sorted(path.name for path in (project / "recipes").glob("*.yaml")) == library

    git(project, "init", "-q")
    commit_all(project, "generated")
    readme = project / "README.md"
    readme.write_text(readme.read_text() + "\nOur cluster: 16 nodes of 8 H100.\n")
    commit_all(project, "local edit")

    # Later template work: the generated README and a recipe of the library change.
    template_readme = next((template / "template").glob("*/README.md"))
    lines = template_readme.read_text().splitlines(keepends=True)
    template_readme.write_text("".join([lines[0], "\nA line added to the template later.\n", *lines[1:]]))
    recipe = template / LIBRARY.relative_to(REPO) / "language_model" / "cpu-debug.yaml"
    recipe.write_text(recipe.read_text() + "# a comment added to the library later\n")
    later = commit_all(template, "template v2")

    cruft(project, "update", "--skip-apply-ask")
    text = readme.read_text()
    assert "A line added to the template later." in text
    assert "Our cluster: 16 nodes of 8 H100." in text
    assert (project / "recipes" / "cpu-debug.yaml").read_text().endswith("# a comment added to the library later\n")
    assert json.loads((project / ".cruft.json").read_text())["commit"] == later
    cruft(project, "check")
