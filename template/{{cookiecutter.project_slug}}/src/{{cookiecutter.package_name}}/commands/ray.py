"""`<project> ray RECIPE [--address ADDRESS] [--max_failures N] [recipe overrides]`: check the recipe, then train it in
Ray Train's workers on a Ray cluster (or a local one); cluster/ray.py holds the Ray side.

Everything is checked before Ray or torch is imported; every recipe field is an override too
(`--train.max_steps`, `--devices`), split from the command's own options by recipe/load.py.
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from ..errors import RecipeError
from ..recipe.library import find_recipe
from ..recipe.load import parse_recipe, split_command_line
from ..recipe.schema import CheckpointConfig, Recipe, field_path
from . import first_line

HELP = "Train in Ray Train's workers, on a Ray cluster or a local one."
VALUE_OPTIONS = ("--address", "--max_failures")


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`ray`'s own options; every recipe field is an override too."""
    parser.description = (
        "Train in Ray Train's workers (TorchTrainer): devices x num_nodes workers, a GPU each unless the"
        " accelerator is cpu. A worker that dies restarts the group, which resumes from the newest checkpoint."
        " Every recipe field is an override too: --train.max_steps, --devices, ..."
    )
    parser.add_argument("recipe", help="Recipe name or path (first).")
    parser.add_argument(
        "--address",
        default=None,
        help="The Ray cluster: host:port of its head (or ray://host:port); default RAY_ADDRESS, else a local one.",
    )
    parser.add_argument(
        "--max_failures",
        type=int,
        default=None,
        help="Restarts of the worker group after a failure (-1: no limit); default the recipe's checkpoint.max_failures.",
    )


def run(argv: list[str], prog: str) -> None:
    """`ray RECIPE [options] [recipe overrides]`: check everything, then train in Ray's workers until done."""
    name, own, overrides = split_command_line(argv, VALUE_OPTIONS)
    parser = ArgumentParser(prog=f"{prog} ray", exit_on_error=False)
    add_arguments(parser, prog)
    try:
        options = parser.parse_args([*own, *([name] if name else [])])
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(first_line(error)) from None
    if options.address is not None and not options.address.strip():
        raise RecipeError("--address is empty: give the head node's host:port, or omit it for a local cluster")
    if options.max_failures is not None and options.max_failures < -1:
        raise RecipeError(f"--max_failures={options.max_failures} must be >= -1 (-1: restart without limit)")
    path = find_recipe(options.recipe)
    resume = f"--{field_path(CheckpointConfig, 'resume')}"
    recipe = parse_recipe(["--config", str(path), resume, "auto", *overrides], f"{prog} ray")
    max_failures = recipe.checkpoint.max_failures if options.max_failures is None else options.max_failures
    from ..cluster.ray import require_ray, train_with_ray

    require_ray()
    train_with_ray(recipe, options.address, max_failures, train_in_a_worker)


def train_in_a_worker(recipe: Recipe) -> None:
    """The loop, as a Ray worker runs it: pickled by name, it imports torch only in the worker."""
    from ..training.loop import train

    train(recipe)
