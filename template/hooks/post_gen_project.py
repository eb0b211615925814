"""Keep the chosen task's recipe library and lock in the new project and remove files for options not chosen:
the other task's package, recipes and tests, the SLURM job writers and their tests, the LICENSE."""

import shutil
import sys
from pathlib import Path

INCLUDE_SLURM = {{ cookiecutter.include_slurm | tojson }} == "yes"
LICENSE = {{ cookiecutter.license | tojson }}
TASK = {{ cookiecutter.task | tojson }}
PACKAGE = {{ cookiecutter.package_name | tojson }}
# What only one task uses, beside its package src/<package>/tasks/<task>/ and its tests tests/tasks/<task>/: the
# language model's benchmarks (benchmarks/ times the loop, checkpoints and data on its GPT and token shards; their
# test is tests/tasks/language_model/test_benchmarks.py), the GPU scripts that run them, and its docs pages. The
# machinery's tests (tests/unit, tests/e2e) train the toy task of tests/toy_task/ and stay in every project.
TASK_FILES = {
    "language_model": [
        "benchmarks",
        *(f"scripts/{name}.sh" for name in ("gpu_bench", "gpu_session")),
        *(f"docs/{name}.md" for name in ("fine-tuning", "benchmarks")),
    ],
    "image_classification": [],
}


# What writes or submits SLURM jobs: the job script, the `slurm` command (sbatch scripts) and the `submit` command
# (submitit, whose job options and checks are the `slurm` command's). commands/__init__.py lists only the
# commands whose module is there. A run started inside a SLURM allocation is still recognised (Fabric reads
# SLURM's ranks; a preempted rank requeues its job): that is the environment a run finds, not a job writer.
SLURM_FILES = [
    "scripts/slurm",
    *(f"src/{PACKAGE}/{layer}/{name}.py" for layer in ("commands", "cluster") for name in ("slurm", "submit")),
    "tests/unit/test_slurm.py",
    "tests/e2e/test_submit.py",
]


def remove(project: Path, names: list[str]) -> None:
    """Remove these files and folders of the project."""
    for name in names:
        path = project / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def keep_the_tasks_recipes(project: Path) -> None:
    """The template holds every task's recipe library, recipes/<task>/ (so that cookiecutter and cruft bring it with
    the rest of the template, in one fetch); the project keeps its task's, directly in recipes/."""
    library = project / "recipes"
    chosen = library / TASK
    if not chosen.is_dir():
        sys.exit(f"ERROR: the template has no recipes for task {TASK} (recipes/{TASK}/): it is incomplete")
    for recipe in sorted(chosen.glob("*.yaml")):
        recipe.rename(library / recipe.name)
    for folder in [path for path in library.iterdir() if path.is_dir()]:
        shutil.rmtree(folder)


def keep_the_tasks_lock(project: Path) -> None:
    """The template holds each task's hash-locked test set, locks/<task>.lock (the tasks' dependencies differ);
    the project keeps its task's as requirements-test.lock, which its scripts/lock.sh rewrites."""
    locks = project / "locks"
    chosen = locks / f"{TASK}.lock"
    if not chosen.is_file():
        sys.exit(f"ERROR: the template has no lock for task {TASK} (locks/{TASK}.lock): it is incomplete")
    chosen.rename(project / "requirements-test.lock")
    shutil.rmtree(locks)


def prune(project: Path) -> None:
    """Remove what the chosen options do not use."""
    for task, files in TASK_FILES.items():
        if task != TASK:
            shutil.rmtree(project / "src" / PACKAGE / "tasks" / task)
            shutil.rmtree(project / "tests" / "tasks" / task)
            remove(project, files)
    if LICENSE == "none":
        (project / "LICENSE").unlink()
    if not INCLUDE_SLURM:
        remove(project, SLURM_FILES)
        scripts = project / "scripts"
        if scripts.is_dir() and not any(scripts.iterdir()):
            scripts.rmdir()


if __name__ == "__main__":
    project_dir = Path.cwd()
    keep_the_tasks_recipes(project_dir)
    keep_the_tasks_lock(project_dir)
    prune(project_dir)
