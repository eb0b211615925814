#!/usr/bin/env bash
# Rewrite each task's hash-locked test set, template/{{cookiecutter.project_slug}}/locks/<task>.lock, with the
# generated project's own scripts/lock.sh: a project of each task is generated (SLURM included, so that the lock
# holds submitit too) and locked from its pyproject.toml and constraints.txt, the one list of tested versions.
# Run it after changing either of them in the template (tests/test_bake.py checks that the locks agree with them).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-$PWD/.venv}
export PATH="$VENV/bin:$PATH" PYTHON="$VENV/bin/python"
locks="template/{{cookiecutter.project_slug}}/locks"
mkdir -p "$locks"
for task in language_model image_classification; do
  rm -rf "build/lock/$task"
  cookiecutter --no-input . --output-dir "build/lock/$task" task="$task" include_slurm=yes
  bash "build/lock/$task/my-project/scripts/lock.sh"
  cp "build/lock/$task/my-project/requirements-test.lock" "$locks/$task.lock"
done
