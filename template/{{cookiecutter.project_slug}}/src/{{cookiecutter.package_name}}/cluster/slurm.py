"""SLURM job scripts: `<project> slurm RECIPE` writes an sbatch script whose counts come from the recipe.

scripts/slurm/train.sbatch is the same script with the recipe as an argument. Both ask SLURM for
SIGUSR1 120 s before the time limit; the training processes then save, requeue the job and exit
with ExitCode.REQUEUE (preemption.py), which the script reports as a requeue, not a failure.
The job options and their checks are shared by the `slurm` and `submit` commands (commands/slurm.py,
commands/submit.py).
"""

from __future__ import annotations

import re
import shlex

from jsonargparse import ArgumentParser

from ..errors import ExitCode, RecipeError
from ..project import PROJECT
from ..recipe.schema import Recipe
from .jobs import gpus_per_node, shown

SIGNAL_SECONDS_BEFORE_LIMIT = 120
PACKAGE = __name__.partition(".")[0]  # this package's name: launchers run it with -m
# SLURM's time formats: MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES, DAYS-HOURS:MINUTES:SECONDS.
TIME_LIMIT = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def add_job_options(parser: ArgumentParser, job_name: str) -> None:
    """The options of a SLURM job that `slurm` and `submit` share: time limit, partition, account, name, cores."""
    parser.add_argument("--time", default="24:00:00", help="Time limit (HH:MM:SS or D-HH:MM:SS).")
    parser.add_argument("--partition", default=None, help="SLURM partition.")
    parser.add_argument("--account", default=None, help="SLURM account.")
    parser.add_argument("--job_name", default=job_name, help="Job name.")
    parser.add_argument("--cpus_per_task", type=int, default=8, help="CPU cores per task (data loading, threads).")


def time_limit_seconds(time: str) -> int:
    """A SLURM time limit in seconds; refuses one SLURM would not read, or one that leaves no time to save."""
    match = TIME_LIMIT.fullmatch(time)
    if match is None:
        raise RecipeError(f"--time={time!r} is not a SLURM time limit (MINUTES, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS)")
    days, first, second, third = (int(part) if part else 0 for part in match.groups())
    if match.group(1):  # D-HH[:MM[:SS]]
        seconds = ((days * 24 + first) * 60 + second) * 60 + third
    elif match.group(4):  # HH:MM:SS
        seconds = (first * 60 + second) * 60 + third
    else:  # MINUTES[:SECONDS]
        seconds = first * 60 + second
    if seconds <= SIGNAL_SECONDS_BEFORE_LIMIT:
        raise RecipeError(
            f"--time={time} leaves no time to train: the job is signalled {SIGNAL_SECONDS_BEFORE_LIMIT} s before"
            " its time limit to save (ask for more, e.g. --time 1:00:00)"
        )
    return seconds


# What SLURM takes for a job, partition and account name; nothing else is written into a job script, so a
# value with a newline (which would start a command of its own in the script) never reaches one.
SLURM_NAME = re.compile(r"[A-Za-z0-9_.+-]{1,128}")
SLURM_NAMES = re.compile(r"[A-Za-z0-9_.-]{1,128}(,[A-Za-z0-9_.-]{1,128})*")  # a partition list: gpu,gpu-long


def check_job_options(
    time: str, cpus_per_task: int, job_name: str | None = None, partition: str | None = None, account: str | None = None
) -> int:
    """Refuse job options SLURM would not take (and any that could break out of a job script); the time limit in
    seconds."""
    if cpus_per_task < 1:
        raise RecipeError(f"--cpus_per_task={cpus_per_task} must be >= 1")
    for flag, value, pattern, allowed in (
        ("job_name", job_name, SLURM_NAME, "letters, digits, '_', '.', '+', '-'"),
        ("partition", partition, SLURM_NAMES, "letters, digits, '_', '.', '-', comma-separated"),
        ("account", account, SLURM_NAME, "letters, digits, '_', '.', '+', '-'"),
    ):
        if value is not None and not pattern.fullmatch(value):
            raise RecipeError(f"--{flag}={shown(value)} is not a SLURM name: use {allowed} (at most 128)")
    return time_limit_seconds(time)


def check_script_path(path: str) -> None:
    """Refuse a recipe path that a job script could not hold on one line (control characters)."""
    if any(ord(char) < 32 or ord(char) == 127 for char in path):
        raise RecipeError(f"recipe path {shown(path)} has control characters: rename the file")


def sbatch_script(
    recipe: Recipe,
    recipe_path: str,
    time: str = "24:00:00",
    partition: str | None = None,
    account: str | None = None,
    job_name: str = PROJECT,
    cpus_per_task: int = 8,
) -> str:
    """An sbatch script that trains `recipe_path` with one task per device on `recipe.num_nodes` nodes."""
    check_job_options(time, cpus_per_task, job_name, partition, account)
    check_script_path(recipe_path)
    options = [f"--job-name={job_name}", f"--nodes={recipe.num_nodes}", f"--ntasks-per-node={recipe.devices}"]
    if gpus_per_node(recipe):
        options.append(f"--gpus-per-node={gpus_per_node(recipe)}")
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
        f"# Train {shlex.quote(recipe_path)} on {recipe.num_nodes} node(s) x {recipe.devices} task(s), one per device.",
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
        "# Each task's CPU threads: its share of the node's cores (unset, every task would use all of them).",
        'export OMP_NUM_THREADS="${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}"',
        "status=0",
        f"srun python -m {PACKAGE} train --config {recipe_argument} \\",
        '  --num_nodes "$SLURM_JOB_NUM_NODES" --devices "$SLURM_NTASKS_PER_NODE" \\',
        '  --checkpoint.resume auto "$@" || status=$?',
        f'if [ "$status" -eq {int(ExitCode.REQUEUE)} ]; then',
        '  echo "job $SLURM_JOB_ID preempted; rank 0 requeued it (its line above says so): it resumes from its newest checkpoint"',
        "  exit 0",
        "fi",
        'exit "$status"',
    ]
