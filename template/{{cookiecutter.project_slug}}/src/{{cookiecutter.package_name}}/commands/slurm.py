"""`<project> slurm RECIPE > job.sbatch`: print an sbatch script whose counts come from the recipe (cluster/slurm.py)."""

from __future__ import annotations

import os

from jsonargparse import ArgumentParser

from ..cluster.slurm import add_job_options, check_job_options, sbatch_script
from ..project import PROJECT
from ..recipe.library import find_recipe
from ..recipe.load import load_recipe
from . import parse_arguments

HELP = f"Write an sbatch script: {PROJECT} slurm RECIPE > job.sbatch."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`slurm`'s arguments: the recipe and the job options it shares with `submit`."""
    parser.description = "Print an sbatch script for a recipe (nodes, tasks, GPUs)."
    parser.add_argument("recipe", help="Recipe name or path.")
    add_job_options(parser, job_name=prog)


def run(argv: list[str], prog: str) -> None:
    """Print the sbatch script for a recipe; its counts come from the recipe."""
    args = parse_arguments(prog, "slurm", add_arguments, argv)
    path = find_recipe(args.recipe)
    recipe = load_recipe(path)
    check_job_options(args.time, args.cpus_per_task, args.job_name, args.partition, args.account)
    # Relative to the folder sbatch is run from (the job starts there), so the script works on any clone.
    relative = os.path.relpath(path.resolve())
    recipe_path = str(path.resolve()) if relative.startswith("..") else relative
    print(
        sbatch_script(recipe, recipe_path, args.time, args.partition, args.account, args.job_name, args.cpus_per_task),
        end="",
    )
