"""SLURM job scripts: `<project> slurm RECIPE` writes an sbatch script whose counts come from the recipe.

scripts/slurm/train.sbatch is the same script with the recipe as an argument. Both ask SLURM for
SIGUSR1 120 s before the time limit; the training processes then save, requeue the job and exit
with ExitCode.REQUEUE (preemption.py), which the script reports as a requeue, not a failure.
"""

from __future__ import annotations

import shlex

from {{ cookiecutter.package_name }}.errors import ExitCode
from {{ cookiecutter.package_name }}.recipe.checks import needs_gpu
from {{ cookiecutter.package_name }}.recipe.schema import Recipe

SIGNAL_SECONDS_BEFORE_LIMIT = 120
PACKAGE = "{{ cookiecutter.package_name }}"


def sbatch_script(
    recipe: Recipe,
    recipe_path: str,
    time: str = "24:00:00",
    partition: str | None = None,
    account: str | None = None,
    job_name: str = "{{ cookiecutter.project_slug }}",
    cpus_per_task: int = 8,
) -> str:
    """An sbatch script that trains `recipe_path` with one task per device on `recipe.num_nodes` nodes."""
    options = [f"--job-name={job_name}", f"--nodes={recipe.num_nodes}", f"--ntasks-per-node={recipe.devices}"]
    if recipe.accelerator != "cpu" or needs_gpu(recipe):
        options.append(f"--gpus-per-node={recipe.devices}")
    options += [f"--cpus-per-task={cpus_per_task}", f"--time={time}"]
    options += [f"--partition={partition}"] * bool(partition) + [f"--account={account}"] * bool(account)
    options += [
        "--requeue",
        f"--signal=USR1@{SIGNAL_SECONDS_BEFORE_LIMIT}",
        "--open-mode=append",
        "--output=logs/%x-%j.out",
    ]
    header = [
        "#!/bin/bash",
        f"# Train {recipe_path} on {recipe.num_nodes} node(s) x {recipe.devices} task(s), one per device.",
        "# Submit: mkdir -p logs && sbatch job.sbatch [--key.sub value ...]  (recipe overrides)",
        *(f"#SBATCH {option}" for option in options),
    ]
    return "\n".join([*header, "", *run_lines(shlex.quote(recipe_path))]) + "\n"


def run_lines(recipe_argument: str) -> list[str]:
    """The body shared by generated scripts and scripts/slurm/train.sbatch: srun, then requeue-aware exit."""
    return [
        "set -uo pipefail",
        "# SIGUSR1 (--signal) or SIGTERM: every rank saves at the next step boundary, rank 0 runs",
        f"# `scontrol requeue $SLURM_JOB_ID`, the tasks exit {int(ExitCode.REQUEUE)}; the requeued job resumes (resume auto).",
        "# The job's Python: the environment active at submission (sbatch exports it), else ./.venv if present.",
        'if [ -z "${VIRTUAL_ENV:-}" ] && [ -f .venv/bin/activate ]; then source .venv/bin/activate; fi',
        "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "status=0",
        f"srun python -m {PACKAGE} train --config {recipe_argument} \\",
        '  --num_nodes "$SLURM_JOB_NUM_NODES" --devices "$SLURM_NTASKS_PER_NODE" \\',
        '  --checkpoint.resume auto "$@" || status=$?',
        f'if [ "$status" -eq {int(ExitCode.REQUEUE)} ]; then',
        '  echo "checkpoint saved and job $SLURM_JOB_ID requeued: it resumes from there"',
        "  exit 0",
        "fi",
        'exit "$status"',
    ]
