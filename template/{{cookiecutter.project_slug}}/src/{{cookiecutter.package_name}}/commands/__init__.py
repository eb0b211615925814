"""The commands: one module per command, and the one table the command line is built from.

Every command module exposes the same three names (the `Command` protocol below):
    HELP: str                                   its line in `<project> --help`
    add_arguments(parser, prog: str) -> None    fill the command's parser: description, arguments, subcommands
    run(argv: list[str], prog: str) -> None     parse the words after the command's name and run it; a user
                                                error is a RecipeError (one line on stderr, exit 2)
`prog` is the program's name. The parser is made by the caller and filled by the command (jsonargparse adds nested subcommands only
top-down): the command line's parser holds every command; a command parses its own words as a
subcommand of the program (`parse_arguments`: the usage and errors read as they always have), or,
taking recipe overrides as well (`train`, `plan`, `k8s`), with a parser of its own.

`COMMANDS` names the machinery's commands whose module the project has (a project generated without SLURM has
no `slurm` or `submit` module); a task adds its own through its `commands` class variable
(a task's `prepare`, `sample` or `predict`, and `export` live in tasks/<task>/commands/), and
`command_table()` is the two together for the project's default task. A module is imported only when
its command runs (or for `--help`), and none imports torch at the top: torch loads inside the bodies
that need it, so listing, validating and planning start without it.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable
from importlib import import_module
from importlib.util import find_spec
from typing import Any, NoReturn, Protocol, cast

from jsonargparse import ArgumentParser

from ..errors import RecipeError
from ..project import TASK
from ..tasks import task_class

# The machinery's commands, in the order `--help` lists them.
NAMES = (
    "train",
    "check",
    "rehearse",
    "recipes",
    "checkpoint",
    "plan",
    "slurm",
    "submit",
    "k8s",
    "ray",
    "report",
    "data",
)
# command name -> the module that holds its parser and its body; one the project was generated without is skipped
# (found without importing it, so that listing the commands imports none).
COMMANDS: dict[str, str] = {
    name: f"{__package__}.{name}" for name in NAMES if find_spec(f"{__package__}.{name}") is not None
}


class Command(Protocol):
    """What every command module exposes."""

    HELP: str

    def add_arguments(self, parser: ArgumentParser, prog: str) -> None:
        """Fill the command's parser: its description, arguments and subcommands; `prog` is the program's name."""
        ...

    def run(self, argv: list[str], prog: str) -> None:
        """Parse the words after the command's name and run it; raise RecipeError for a user error."""
        ...


def command_table() -> dict[str, str]:
    """Every command of the command line: the machinery's, then those of the project's task (project.TASK).

    A task's command cannot replace one of the machinery's: the machinery's keeps its name.
    """
    task_commands = task_class(TASK).commands
    return {**COMMANDS, **{name: module for name, module in task_commands.items() if name not in COMMANDS}}


def load_command(name: str, table: dict[str, str] | None = None) -> Command:
    """The module of a command of the table (imported now, on first use)."""
    return cast(Command, import_module((table or command_table())[name]))


def first_line(error: Exception) -> str:
    """jsonargparse's error in one line (its messages span lines): its first, or for a value it refused
    (`Parser key "x":` then why) the option and why."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
    refused = re.fullmatch(r'Parser key "([\w.]+)":', lines[0])
    return f"--{refused.group(1)}: {lines[1]}" if refused and len(lines) > 1 else lines[0]


def as_subcommand(prog: str, name: str, add_arguments: Callable[[ArgumentParser, str], None]) -> ArgumentParser:
    """The program's parser holding only the command `name`, as the command line parses it: the command's usage
    reads `<prog> [options] NAME ...` and its errors name its arguments `NAME.argument`."""
    program = ArgumentParser(prog=prog, exit_on_error=False)
    command = ArgumentParser(exit_on_error=False)
    program.add_subcommands(dest="command").add_subcommand(name, command)
    add_arguments(command, prog)  # after adding it: jsonargparse adds nested subcommands only top-down
    return program


def parse_arguments(prog: str, name: str, add_arguments: Callable[[ArgumentParser, str], None], argv: list[str]) -> Any:
    """The namespace of a command's own words, parsed as the subcommand `name`; an error is a one-line RecipeError."""
    try:
        return as_subcommand(prog, name, add_arguments).parse_args([name, *argv])[name]
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(first_line(error)) from None


def choose_a_command(parser: ArgumentParser, words: list[str]) -> NoReturn:
    """A command given without its subcommand: print the choices (the parser's help) and refuse in one line."""
    with contextlib.suppress(SystemExit):  # --help prints the help and exits 0
        parser.parse_args([*words, "--help"])
    raise RecipeError(f"choose a command: {' '.join([parser.prog, *words])} COMMAND (the commands are listed above)")
