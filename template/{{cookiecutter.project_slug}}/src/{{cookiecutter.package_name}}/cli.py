"""Command line: `train`, `recipes list|show|copy|validate`, `plan`, `checkpoint list|inspect|consolidate`, `slurm`,
`submit`, `prepare`, `sample`, `export`.

Parse and dispatch only (the commands live in train.py, commands.py, submit.py and recipe/library.py). Every user
error ends in one line on stderr naming what is wrong and what is allowed, exit code 2 (errors.py).
"""

from __future__ import annotations

import contextlib
import sys

from jsonargparse import ArgumentParser

from {{ cookiecutter.package_name }} import __version__
from {{ cookiecutter.package_name }}.errors import RecipeError, run_command
from {{ cookiecutter.package_name }}.recipe.library import copy_recipe, list_recipes, show_recipe
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe, recipe_parser

PROG = "{{ cookiecutter.project_slug }}"


def build_parser() -> ArgumentParser:
    """The top-level parser and its subcommands."""
    parser = ArgumentParser(prog=PROG, exit_on_error=False, description="Distributed training with Lightning Fabric.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subcommands(dest="command")
    commands.add_subcommand("train", recipe_parser(f"{PROG} train"), help="Train with a recipe and overrides.")

    recipes = ArgumentParser(exit_on_error=False, description="Browse, copy and check the recipe library.")
    commands.add_subcommand("recipes", recipes, help="The recipe library.")
    recipe_commands = recipes.add_subcommands(dest="action")
    recipe_commands.add_subcommand("list", ArgumentParser(exit_on_error=False), help="One line per recipe.")
    show = ArgumentParser(exit_on_error=False)
    show.add_argument("name", help="Recipe name or path.")
    recipe_commands.add_subcommand("show", show, help="Print a recipe.")
    copy = ArgumentParser(exit_on_error=False)
    copy.add_argument("name", help="Recipe name or path.")
    copy.add_argument("dest", help="File (or folder) to write.")
    copy.add_argument("--force", action="store_true", help="Overwrite an existing file.")
    recipe_commands.add_subcommand("copy", copy, help="Copy a recipe to edit.")
    validate = ArgumentParser(exit_on_error=False)
    validate.add_argument("files", nargs="+", help="Recipe files or names.")
    recipe_commands.add_subcommand("validate", validate, help="Check recipes and say where they run.")

    checkpoints = ArgumentParser(exit_on_error=False, description="List, inspect and consolidate checkpoints.")
    commands.add_subcommand("checkpoint", checkpoints, help="Checkpoints of a run.")
    checkpoint_commands = checkpoints.add_subcommands(dest="action")
    listing = ArgumentParser(exit_on_error=False)
    listing.add_argument("run", help="A run's out_dir or its checkpoints folder.")
    checkpoint_commands.add_subcommand("list", listing, help="Steps, sizes, complete or not.")
    inspect = ArgumentParser(exit_on_error=False)
    inspect.add_argument("path", help="A checkpoint folder (step-N).")
    checkpoint_commands.add_subcommand("inspect", inspect, help="What a checkpoint holds.")
    consolidate = ArgumentParser(exit_on_error=False)
    consolidate.add_argument("path", help="A checkpoint folder (step-N).")
    consolidate.add_argument("output", help="File to write the model weights to.")
    checkpoint_commands.add_subcommand("consolidate", consolidate, help="One weights file for plain PyTorch.")

    from {{ cookiecutter.package_name }}.commands import plan_parser

    commands.add_subcommand("plan", plan_parser(PROG), help="Which strategy for a model on a cluster.")

    from {{ cookiecutter.package_name }}.cluster.slurm import add_job_options
    from {{ cookiecutter.package_name }}.cluster.submit import submit_parser

    slurm = ArgumentParser(exit_on_error=False, description="Print an sbatch script for a recipe (nodes, tasks, GPUs).")
    slurm.add_argument("recipe", help="Recipe name or path.")
    add_job_options(slurm, job_name=PROG)
    commands.add_subcommand("slurm", slurm, help=f"Write an sbatch script: {PROG} slurm RECIPE > job.sbatch.")
    commands.add_subcommand(
        "submit", submit_parser(PROG), help="Submit training to SLURM (or run it here) with submitit."
    )

    preparer = ArgumentParser(exit_on_error=False, description="Tokenize .txt/.jsonl/.parquet files into token shards.")
    preparer.add_argument("inputs", nargs="+", help="Folders, files or globs of .txt, .jsonl and .parquet files.")
    preparer.add_argument("--out", required=True, help="Folder to write (must not exist); data.path of the recipe.")
    preparer.add_argument("--tokenizer", default=None, help="A Hugging Face tokenizer.json to tokenize with.")
    preparer.add_argument("--train-tokenizer", type=int, default=None, help="Train a byte-level BPE of this size.")
    preparer.add_argument("--text-field", default="text", help="Text field of .jsonl records / column of .parquet.")
    preparer.add_argument("--val-fraction", type=float, default=0.01, help="Share of tokens held out.")
    preparer.add_argument("--workers", type=int, default=None, help="Tokenizing processes (default: every core).")
    preparer.add_argument("--shard-tokens", type=int, default=1 << 28, help="Tokens per shard file.")
    commands.add_subcommand("prepare", preparer, help="Text -> token shards (data.source=prepared).")

    sampler = ArgumentParser(exit_on_error=False, description="Continue a prompt with a trained checkpoint.")
    sampler.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    sampler.add_argument("--prompt", default="", help="Text to continue (empty: start a new document).")
    sampler.add_argument("--max-new-tokens", type=int, default=200, help="Tokens to generate.")
    sampler.add_argument("--temperature", type=float, default=0.8, help="Sampling temperature (0: greedy).")
    sampler.add_argument("--top-k", type=int, default=200, help="Sample among the k most likely tokens only.")
    sampler.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")
    commands.add_subcommand("sample", sampler, help="Print what a checkpoint's model writes after a prompt.")

    exporter = ArgumentParser(exit_on_error=False, description="Write a checkpoint as a Hugging Face model folder.")
    exporter.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    exporter.add_argument("out_dir", help="Folder to write (new or empty).")
    exporter.add_argument("--format", choices=["hf"], default="hf", help="hf: config.json + safetensors (+ tokenizer).")
    exporter.add_argument("--max-shard-bytes", type=int, default=5 * 10**9, help="Largest safetensors file.")
    commands.add_subcommand("export", exporter, help="Checkpoint -> transformers' from_pretrained folder.")
    return parser


def dispatch(argv: list[str]) -> None:
    """Run a command line; raises RecipeError for user errors."""
    if argv[:1] == ["train"]:
        recipe = parse_recipe(argv[1:], f"{PROG} train")
        from {{ cookiecutter.package_name }}.training.loop import train  # imports torch: only when training

        train(recipe)
        return
    if argv[:1] == ["plan"]:  # its own options and every recipe field as an override
        from {{ cookiecutter.package_name }}.commands import print_plan

        print_plan(argv[1:], PROG)
        return
    if argv[:1] == ["submit"]:  # likewise
        from {{ cookiecutter.package_name }}.cluster.submit import submit

        submit(argv[1:], PROG)
        return
    if argv in ([], ["recipes"], ["checkpoint"]):  # a command without its subcommand: show the choices
        with contextlib.suppress(SystemExit):
            build_parser().parse_args([*argv, "--help"])
        raise RecipeError(f"choose a command: {' '.join([PROG, *argv])} COMMAND (the commands are listed above)")
    try:
        args = build_parser().parse_args(argv)
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(str(error).strip().splitlines()[0]) from None
    from {{ cookiecutter.package_name }} import commands

    if args.command == "slurm":
        commands.print_sbatch(args.slurm)
    elif args.command == "prepare":
        commands.prepare_data(args.prepare)
    elif args.command == "sample":
        commands.print_sample(args.sample)
    elif args.command == "export":
        commands.export_checkpoint(args.export)
    elif args.command == "checkpoint":
        sub = args.checkpoint
        if sub.action == "list":
            commands.list_checkpoint_folders(sub.list.run)
        elif sub.action == "inspect":
            commands.inspect_checkpoint(sub.inspect.path)
        else:
            commands.consolidate_checkpoint(sub.consolidate.path, sub.consolidate.output)
    elif args.recipes.action == "list":
        list_recipes()
    elif args.recipes.action == "show":
        show_recipe(args.recipes.show.name)
    elif args.recipes.action == "copy":
        copy_recipe(args.recipes.copy.name, args.recipes.copy.dest, args.recipes.copy.force, program=PROG)
    elif args.recipes.action == "validate":
        commands.validate_recipes(args.recipes.validate.files)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the command and exit with its code."""
    arguments = sys.argv[1:] if argv is None else argv
    run_command(lambda: dispatch(arguments))
