"""MkDocs hook: the reference pages, written from the code each time the site is built.

reference/recipe.md: every field of every section of a recipe of the project's task (its `Recipe` subclass),
with its type, default, bounds and meaning (the `Args:` of each dataclass's docstring). reference/commands.md: every
command of the command table and each of its subcommands, with the help `--help` prints. Nothing is written
into docs/: the pages exist only in the build, so they cannot go stale.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import sys
import types
import typing
from importlib import import_module
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

SOURCE = Path(__file__).resolve().parents[2] / "src"
PACKAGE = "{{ cookiecutter.package_name }}"
HELP_COLUMNS = "100"  # the width `--help` text is wrapped at, whatever the terminal building the site
DOC_ENTRY = re.compile(r"^ {4}(\w+): ?(.*)$")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    """Add the generated reference pages to the site's files."""
    if str(SOURCE) not in sys.path:
        sys.path.insert(0, str(SOURCE))  # the checkout's package, installed or not
    files.append(File.generated(config, "reference/recipe.md", content=recipe_page()))
    files.append(File.generated(config, "reference/commands.md", content=commands_page()))
    return files


def recipe_page() -> str:
    """Every field of the project's recipe, a section per dataclass, top-level fields first."""
    project = import_module(f"{PACKAGE}.project")
    recipe_type = import_module(f"{PACKAGE}.tasks").task_class(project.TASK).recipe_type
    lines = [
        "# Recipe fields",
        "",
        f"Every key a recipe of `task: {project.TASK}` may hold, read from the dataclasses that load it",
        "(`recipe/schema.py` and the task's `config.py`). Each is a field of a YAML recipe and an override on",
        "the command line with its dotted name (`--train.max_steps 20`).",
        "",
    ]
    lines += section(recipe_type, "", "Top-level fields")
    return "\n".join(lines) + "\n"


def section(cls: type, prefix: str, title: str) -> list[str]:
    """One dataclass's fields as a list, then the sections of the fields that are dataclasses themselves."""
    hints = typing.get_type_hints(cls)
    described = field_docs(cls)
    lines = [f"## {title}", ""]
    summary = first_paragraph(cls)
    if summary:
        lines += [markdown(summary), ""]
    nested = []
    for field in dataclasses.fields(cls):
        path = prefix + field.name
        kind = hints[field.name]
        inner = dataclass_in(kind)
        if inner is not None:
            nested.append((inner, path))
        meaning = described.get(field.name) or (first_paragraph(inner) if inner is not None else "")
        entry = f"- **`{path}`** (`{type_name(kind)}`, default `{default_of(field)}`{bounds_of(field)})"
        lines.append(f"{entry}: {markdown(meaning)}" if meaning else entry)
    lines.append("")
    for inner, path in nested:
        lines += section(inner, path + ".", f"`{path}`")
    return lines


def field_docs(cls: type) -> dict[str, str]:
    """A field's meaning from the `Args:` of the docstrings of the class and its bases (the nearest first)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        text = inspect.cleandoc(klass.__dict__.get("__doc__") or "")
        found: dict[str, str] = {}
        current = None
        in_args = False
        for line in text.splitlines():
            if line.strip() in ("Args:", "Attributes:"):
                in_args, current = True, None
            elif in_args and (entry := DOC_ENTRY.match(line)):
                current = entry.group(1)
                found[current] = entry.group(2).strip()
            elif in_args and current and line.startswith(" " * 8):
                found[current] += " " + line.strip()
            elif in_args and line and not line.startswith(" "):
                in_args, current = False, None
        docs.update(found)
    return docs


def first_paragraph(cls: type) -> str:
    """The class docstring's first paragraph (what the section is)."""
    text = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    return " ".join(text.split("\n\n", 1)[0].split())


def dataclass_in(kind: Any) -> type | None:
    """The dataclass a field holds (also when optional), or None."""
    if dataclasses.is_dataclass(kind) and isinstance(kind, type):
        return kind
    members = [arg for arg in typing.get_args(kind) if arg is not type(None)]
    if is_union(kind) and len(members) == 1:
        return dataclass_in(members[0])
    return None


def is_union(kind: Any) -> bool:
    """Whether a type is `A | B` (or `Optional[A]`)."""
    return typing.get_origin(kind) in (typing.Union, types.UnionType)


def type_name(kind: Any) -> str:
    """A type as it is written: `int`, `str | None`, `list[int]`, `"cosine" | "wsd"`."""
    if kind is type(None):
        return "None"
    if typing.get_origin(kind) is typing.Literal:
        return " | ".join(f'"{value}"' if isinstance(value, str) else repr(value) for value in typing.get_args(kind))
    if is_union(kind):
        return " | ".join(type_name(arg) for arg in typing.get_args(kind))
    if typing.get_origin(kind) is not None:
        origin = typing.get_origin(kind)
        arguments = ", ".join(type_name(arg) for arg in typing.get_args(kind))
        return f"{getattr(origin, '__name__', str(origin))}[{arguments}]"
    return getattr(kind, "__name__", str(kind).replace("typing.", ""))


def default_of(field: dataclasses.Field) -> str:
    """The default as YAML writes it; a section's default is its own fields' defaults."""
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        return "its fields' defaults"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value) if not isinstance(value, str) else f'"{value}"'


def bounds_of(field: dataclasses.Field) -> str:
    """The range the field declares (recipe/bounds.py), after a comma: `, at least 1`; empty when it declares none."""
    declared = import_module(f"{PACKAGE}.recipe.bounds").bounds_of(field)
    return f", {declared.words()}" if declared is not None else ""


def markdown(text: str) -> str:
    """Prose of a docstring, safe in Markdown: angle brackets and asterisks shown as they are."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def commands_page() -> str:
    """Every command and subcommand with its `--help`, in the order of the command table."""
    project = import_module(f"{PACKAGE}.project")
    cli = import_module(f"{PACKAGE}.cli")
    table = import_module(f"{PACKAGE}.commands").command_table()
    lines = [
        "# Commands",
        "",
        f"Every command of `{project.PROJECT}` and each of its subcommands, as `{project.PROJECT} COMMAND --help`",
        "prints it. `train`, `plan` and `submit` also take every recipe field as an override",
        "([the recipe fields](recipe.md)).",
        "",
    ]
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        for name, parser, summary in subcommands(cli.build_parser(table)):
            lines += command_section([name], parser, summary, 2)
    finally:  # `mkdocs serve` goes on in this process
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return "\n".join(lines) + "\n"


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """A parser's subcommands: name, parser and the one line it is listed with."""
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            listed = {choice.dest: choice.help or "" for choice in action._choices_actions}
            found += [(name, sub, listed.get(name, "")) for name, sub in action.choices.items()]
    return found


def command_section(words: list[str], parser: argparse.ArgumentParser, summary: str, level: int) -> list[str]:
    """A command's heading, its line and its help, then its subcommands one level down."""
    lines = [f"{'#' * level} `{' '.join(words)}`", ""]
    if summary:
        lines += [markdown(summary), ""]
    lines += ["```text", parser.format_help().rstrip(), "```", ""]
    for name, sub, line in subcommands(parser):
        lines += command_section([*words, name], sub, line, min(level + 1, 4))
    return lines
