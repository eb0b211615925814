"""`<project> recipes list|show|copy|validate`: browse, copy and check the recipe library (recipe/library.py).

`validate FILE... [recipe overrides]` reads each file as `train` does (recipe/load.py's `parse_recipe`), with the
same dotted overrides (`--train.max_steps 5`), so a recipe and overrides it accepts are what `train` accepts.
"""

from __future__ import annotations

from jsonargparse import ArgumentParser

from ..recipe.checks import needs_gpu
from ..recipe.library import copy_recipe, find_recipe, list_recipes, show_recipe
from ..recipe.load import parse_recipe
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
    validate = ArgumentParser(
        exit_on_error=False,
        description="Check recipes as `train` reads them and say where they run. Every recipe field is an override"
        " too, after the files and applied to each: --train.max_steps 5, --devices 4, ...",
    )
    validate.add_argument("files", nargs="+", help="Recipe files or names (first).")
    actions.add_subcommand("validate", validate, help="Check recipes and say where they run.")


def run(argv: list[str], prog: str) -> None:
    """Run a `recipes` subcommand; without one, show the choices."""
    if not argv:
        choose_a_command(as_subcommand(prog, "recipes", add_arguments), ["recipes"])
    words, overrides = split_validate(argv)
    args = parse_arguments(prog, "recipes", add_arguments, words)
    if args.action == "list":
        list_recipes()
    elif args.action == "show":
        show_recipe(args.show.name)
    elif args.action == "copy":
        copy_recipe(args.copy.name, args.copy.dest, args.copy.force, program=prog)
    else:
        validate_recipes(args.validate.files, overrides, prog)


def split_validate(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the words `recipes` parses, the recipe overrides) of `validate FILE... [overrides]`: the overrides, from the
    first option on, go to `parse_recipe` as `train`'s do; its own parser would refuse them in other words."""
    if argv[:1] != ["validate"]:
        return argv, []
    first_option = next((index for index, word in enumerate(argv) if word.startswith("-")), len(argv))
    rest = argv[first_option:]
    if any(word in ("-h", "--help") for word in rest):
        return argv, []
    return argv[:first_option], rest


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


def validate_recipes(files: list[str], overrides: list[str], prog: str) -> None:
    """Check recipe files, each with the same overrides, as `train` reads them; raises on the first invalid one."""
    for name in files:
        path = find_recipe(name)
        recipe = parse_recipe(["--config", str(path), *overrides], f"{prog} recipes validate")
        applied = f" {' '.join(overrides)}" if overrides else ""
        print(f"ok: {path}{applied}: {describe(recipe)}")
        if data := task_for(recipe).describe():
            print(f"    {data}")
