"""`<project> submit RECIPE [options] [recipe overrides]`: check the recipe and the job, then submit training to
SLURM (or run it on this machine with `--local`) through submitit; cluster/submit.py holds the job itself.

Everything is checked before submitit or torch is imported; every recipe field is an override too
(`--train.max_steps`, `--devices`), split from the command's own options by recipe/load.py.
"""

from __future__ import annotations

import shutil

from jsonargparse import ArgumentParser

from ..checkpoint.layout import checkpoint_root
from ..cluster.preemption import Preemption
from ..cluster.slurm import add_job_options, check_job_options
from ..cluster.submit import Training, executor, wait
from ..errors import RecipeError
from ..recipe.library import find_recipe
from ..recipe.load import parse_recipe, split_command_line
from ..recipe.schema import CheckpointConfig, Recipe, field_path
from . import first_line

HELP = "Submit training to SLURM (or run it here) with submitit."
VALUE_OPTIONS = ("--time", "--partition", "--account", "--job_name", "--cpus_per_task", "--folder", "--max_timeouts")
SWITCHES = ("--local", "--wait")


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`submit`'s own options (the `slurm` command's, and submitit's); every recipe field is an override too."""
    parser.description = (
        "Submit training to SLURM with submitit: one task per device, requeued and resumed when"
        " preempted or timed out. Every recipe field is an override too: --train.max_steps, --devices, ..."
    )
    parser.add_argument("recipe", help="Recipe name or path (first).")
    add_job_options(parser, job_name=prog)
    parser.add_argument("--folder", default="logs/submitit", help="submitit's folder: the job's logs and pickles.")
    parser.add_argument(
        "--max_timeouts", type=int, default=3, help="Time limits after which submitit requeues no more (submitit's 3)."
    )
    parser.add_argument("--local", action="store_true", help="Run the job on this machine (one node), not SLURM.")
    parser.add_argument("--wait", action="store_true", help="Wait for the job to end, through requeues.")


def run(argv: list[str], prog: str) -> None:
    """`submit RECIPE [options] [recipe overrides]`: check everything, submit, print the job id and its logs."""
    name, own, overrides = split_command_line(argv, VALUE_OPTIONS, SWITCHES)
    parser = ArgumentParser(prog=f"{prog} submit", exit_on_error=False)
    add_arguments(parser, prog)
    try:
        options = parser.parse_args([*own, *([name] if name else [])])
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(first_line(error)) from None
    seconds = check_job_options(
        options.time, options.cpus_per_task, options.job_name, options.partition, options.account
    )
    if options.max_timeouts < 0:
        raise RecipeError(f"--max_timeouts={options.max_timeouts} must be >= 0")
    path = find_recipe(options.recipe)
    resume = f"--{field_path(CheckpointConfig, 'resume')}"
    recipe = parse_recipe(["--config", str(path), resume, "auto", *overrides], f"{prog} submit")
    if options.local and recipe.num_nodes > 1:
        raise RecipeError(
            f"submit --local runs the job on this machine, one node, but the recipe asks for num_nodes="
            f"{recipe.num_nodes} (override it with --num_nodes 1, or submit to SLURM without --local)"
        )
    if not options.local and not all(shutil.which(tool) for tool in ("sbatch", "srun")):
        raise RecipeError("no SLURM here (sbatch and srun not on PATH): submit from a SLURM login node, or add --local")
    job = executor(options, recipe, seconds).submit(Training(recipe, train_in_the_job))
    where = "on this machine" if options.local else "to SLURM"
    print(
        f"submitted job {job.job_id} {where}: {recipe.num_nodes} node(s) x {recipe.devices} task(s), one per device,"
        f" time limit {options.time}"
    )
    print(f"logs: {job.paths.stdout} and {job.paths.stderr} (rank 0; rank N: {job.job_id}_N_log.*)")
    print(f"checkpoints: {checkpoint_root(recipe)} (preempted or timed out, the job saves there, is requeued, resumes)")
    if options.wait:
        wait(job)


def train_in_the_job(recipe: Recipe, preemption: Preemption) -> None:
    """The loop, as a job's task runs it: pickled by name, it imports torch only when called, after `Training` has
    put its preemption flag in place (cluster/submit.py)."""
    from ..training.loop import train

    train(recipe, preemption)
