"""`<project> train`: train with a recipe file and dotted overrides (`--train.max_steps 20`)."""

from __future__ import annotations

from jsonargparse import ActionConfigFile, ArgumentParser

from ..project import TASK
from ..recipe.load import parse_recipe
from ..tasks import task_class

HELP = "Train with a recipe and overrides."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """A recipe file (`--config`) and every field of the default task's recipe as an override, as
    recipe/load.py's `recipe_parser`; `run` reads the recipe with `parse_recipe`, which picks the recipe's task."""
    parser.description = "Train with a recipe."
    parser.add_argument("--config", action=ActionConfigFile, help="Recipe YAML file.")
    parser.add_class_arguments(task_class(TASK).recipe_type, nested_key=None, fail_untyped=True)


def run(argv: list[str], prog: str) -> None:
    """Read and check the recipe (before torch loads), start the node's other ranks, then train it."""
    from ..cluster.lifecycle import end_with_launcher
    from ..cluster.preemption import Preemption
    from ..cluster.prestart import start_other_ranks, wait_for_release

    end_with_launcher()  # a rank started by another rank dies with it
    # First: a stop signal during start-up ends the run as a preemption, not as killed. Handed back at the end.
    with Preemption() as preemption:
        recipe = parse_recipe(argv, f"{prog} train")
        start_other_ranks(recipe, argv)  # the node's other ranks import beside this one (cluster/prestart.py)
        from ..training.loop import train_to_the_end  # imports torch: only when training

        wait_for_release()  # a rank started early waits here for the first rank's launch
        train_to_the_end(recipe, preemption)
