"""`<project> check RECIPE [overrides]`: the recipe's task checked against what the machinery needs, on one process
and without training (training/task_check.py): one line per check, each problem named; exit 2 when one is found."""

from __future__ import annotations

import sys

from jsonargparse import ArgumentParser

from ..errors import RecipeError
from . import train

HELP = "Check a recipe's task against what the machinery needs (one process, no training)."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """The same words as `train`: a recipe file and dotted overrides."""
    train.add_arguments(parser, prog)
    parser.description = (
        "Build the recipe's model (meta device; on the CPU too where it is small), draw a micro-batch, run the loss and"
        " a validation step as every strategy composes them, and name what the machinery needs and does not find."
    )


def run(argv: list[str], prog: str) -> None:
    """Read the recipe as `train` does, run every check, print one line each; refuse (exit 2) when one fails."""
    from ..recipe.load import parse_recipe

    recipe = parse_recipe(argv, f"{prog} check")
    from ..training.task_check import task_checks  # imports torch: only once the recipe is read

    problems = 0
    for what, problem in task_checks(recipe):
        if problem is None:
            print(f"ok: {what}")
        else:
            problems += 1
            print(f"problem: {what}: {problem}", file=sys.stderr, flush=True)
    if problems:
        raise RecipeError(f"task {recipe.task}: {problems} problem(s) above, each named in one line")
    print(f"task {recipe.task}: the machinery finds all it needs")
