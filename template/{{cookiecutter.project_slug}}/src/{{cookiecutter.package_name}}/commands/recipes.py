"""`<project> recipes list|show|copy|validate`: browse, copy and check the recipe library (recipe/library.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from ..recipe.checks import needs_gpu
from ..recipe.library import copy_recipe, find_recipe, list_recipes, show_recipe
from ..recipe.load import load_recipe
from ..recipe.schema import Recipe
from ..strategies import strategy_for
from ..tasks import task_for
from . import as_subcommand, choose_a_command, parse_arguments

HELP = "The recipe library."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`recipes`' subcommands."""
    parser.description = "Browse, copy and check the recipe library."
    actions = parser.add_subcommands(dest="action")
    actions.add_subcommand("list", ArgumentParser(exit_on_error=False), help="One line per recipe.")
    show = ArgumentParser(exit_on_error=False)
    show.add_argument("name", help="Recipe name or path.")
    actions.add_subcommand("show", show, help="Print a recipe.")
    copy = ArgumentParser(exit_on_error=False)
    copy.add_argument("name", help="Recipe name or path.")
    copy.add_argument("dest", help="File (or folder) to write.")
    copy.add_argument("--force", action="store_true", help="Overwrite an existing file.")
    actions.add_subcommand("copy", copy, help="Copy a recipe to edit.")
    validate = ArgumentParser(exit_on_error=False)
    validate.add_argument("files", nargs="+", help="Recipe files or names.")
    actions.add_subcommand("validate", validate, help="Check recipes and say where they run.")


def run(argv: list[str], prog: str) -> None:
    """Run a `recipes` subcommand; without one, show the choices."""
    if not argv:
        choose_a_command(as_subcommand(prog, "recipes", add_arguments), ["recipes"])
    args = parse_arguments(prog, "recipes", add_arguments, argv)
    if args.action == "list":
        list_recipes()
    elif args.action == "show":
        show_recipe(args.show.name)
    elif args.action == "copy":
        copy_recipe(args.copy.name, args.copy.dest, args.copy.force, program=prog)
    else:
        validate_recipes(args.validate.files)


def describe(recipe: Recipe) -> str:
    """Where a recipe runs, in words; says so when it needs GPUs this machine does not have."""
    strategy = strategy_for(recipe)
    gpu_only = needs_gpu(recipe)
    hardware = "GPU" if gpu_only else ("CPU" if recipe.accelerator == "cpu" else "GPU, or CPU if none")
    text = (
        f"{recipe.world_size} process(es) = {recipe.devices} device(s) x {recipe.num_nodes} node(s),"
        f" {hardware}, {strategy.describe()}, precision {recipe.precision}"
    )
    if gpu_only:
        import torch  # only for recipes that need GPUs: listing and checking stay fast

        if not torch.cuda.is_available():
            requirement = strategy.gpu_requirement()
            reason = requirement.why if requirement is not None else "accelerator=cuda"
            text += f" (needs CUDA GPUs: {reason}; this machine has none, so train it on a GPU machine)"
    return text


def validate_recipes(files: list[str]) -> None:
    """Check recipe files; raises on the first invalid one."""
    for name in files:
        path = find_recipe(name)
        recipe = load_recipe(path)
        print(f"ok: {path}: {describe(recipe)}")
        if data := task_for(recipe).describe():
            print(f"    {data}")
