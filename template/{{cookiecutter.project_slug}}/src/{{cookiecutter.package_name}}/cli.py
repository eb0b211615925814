"""Command line: `<project> COMMAND ...`, one command per module of commands/ (train, recipes, plan, checkpoint,
ray, ...) plus the default task's own (the language model's prepare, sample, export).

The commands come from one table (commands/__init__.py: `command_table()`, the machinery's `COMMANDS` and the
task's `commands`); this module builds the top-level parser from it, each command listed with its HELP,
and dispatches a command line to the module its first word names, which parses the rest and runs it.
Only that module is imported, and torch only inside the bodies that need it. Every user error ends in
one line on stderr naming what is wrong and what is allowed, exit code 2 (errors.run_command).
"""

from __future__ import annotations

import sys

from jsonargparse import ArgumentParser

from . import __version__
from .commands import choose_a_command, command_table, first_line, load_command
from .errors import RecipeError, refuse_dashed_options, run_command
from .project import PROJECT

PROG = PROJECT


def build_parser(table: dict[str, str] | None = None) -> ArgumentParser:
    """The top-level parser: `--version` and a subcommand per command of the table (imports every command module)."""
    table = table or command_table()
    parser = ArgumentParser(prog=PROG, exit_on_error=False, description="Distributed training with Lightning Fabric.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    subcommands = parser.add_subcommands(dest="command")
    for name in table:
        command = load_command(name, table)
        command_parser = ArgumentParser(exit_on_error=False)
        subcommands.add_subcommand(name, command_parser, help=command.HELP)
        command.add_arguments(command_parser, PROG)  # once added: jsonargparse nests subcommands only top-down
    return parser


def dispatch(argv: list[str]) -> None:
    """Run a command line; raises RecipeError for user errors."""
    refuse_dashed_options(argv)
    table = command_table()
    if argv and argv[0] in table:  # the command parses its own words
        load_command(argv[0], table).run(argv[1:], PROG)
        return
    parser = build_parser(table)
    if not argv:  # no command: show the choices
        choose_a_command(parser, [])
    try:  # --help, --version, or not a command: the parser prints, or says what is wrong
        args = parser.parse_args(argv)
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(first_line(error)) from None
    load_command(args.command, table).run(argv[argv.index(args.command) + 1 :], PROG)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the command and exit with its code."""
    arguments = sys.argv[1:] if argv is None else argv
    run_command(lambda: dispatch(arguments))
