"""`<project> data verify PATH`: every byte of a prepared folder against the SHA-256 its manifest records.

The folder is read by the task whose `prepare` wrote it (the manifest's `"task"`), else by the project's task.

A run checks only the manifest and the files' sizes at start (data/shards.py), so that start-up does not
grow with the corpus; this reads every byte once, with a progress bar, after a copy to new storage or
when a shard is suspected. `data.verify: full` in a recipe does the same at every start instead.
"""

from __future__ import annotations

from pathlib import Path

from jsonargparse import ArgumentParser

from ..data.remote import is_url
from ..data.shards import MANIFEST, written_by
from ..errors import RecipeError
from ..project import TASK
from ..tasks import task_class, task_names
from . import as_subcommand, choose_a_command, parse_arguments

HELP = "Prepared data: verify every byte of a folder against its manifest."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`data`'s subcommands."""
    parser.description = "Prepared data folders."
    actions = parser.add_subcommands(dest="action")
    verify = ArgumentParser(exit_on_error=False)
    verify.add_argument("path", help="A folder `prepare` wrote (data.path of a recipe).")
    actions.add_subcommand("verify", verify, help="Check every file's size and SHA-256 against the manifest.")


def run(argv: list[str], prog: str) -> None:
    """Run a `data` subcommand; without one, show the choices."""
    if not argv:
        choose_a_command(as_subcommand(prog, "data", add_arguments), ["data"])
    args = parse_arguments(prog, "data", add_arguments, argv)
    # A URL stays a string (a Path would fold `s3://b` into `s3:/b`); its manifest is read by the task's reader.
    folder: Path | str = args.verify.path if is_url(args.verify.path) else Path(args.verify.path)
    task = (written_by(folder) if isinstance(folder, Path) else None) or TASK
    if task not in task_names():
        raise RecipeError(
            f"PATH={str(folder)!r}: {MANIFEST} says task {task!r} prepared it, a task this project does not have"
            f" (its tasks: {', '.join(task_names())})"
        )
    summary = task_class(task).verify_prepared(folder)
    print(f"{folder}: every file matches its manifest: {summary}")
