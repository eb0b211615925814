"""A recipe checked against the schema: its keys and value types before jsonargparse reads it, its values' choices
and bounds once it is read.

The data of a recipe file and the command line's `--section.key value` overrides are walked through the
task's Recipe dataclass (recipe/schema.py and the task's config.py): an unknown key is named with the keys
allowed beside it (and the nearest one, when one is near), a value of the wrong type with the type expected,
a choice that is not offered with the choices. The types come from the dataclasses' annotations, so a new
field or section is checked with no change here, and every message is the project's own: jsonargparse then
reads data that already fits the schema. The parsed Recipe, defaults included, is walked the same way
(`check_values`) for the bounds its fields declare (recipe/bounds.py), named by the path walked.

A value is read as jsonargparse reads it: where a number, a boolean, a list or a section is expected, a
string is read as YAML (`'2'` in a file; `1e-3`, `yes`, `[a, b]`, `{max_steps: 20}` on the command line).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from typing import Any, Literal

import yaml

from ..errors import RecipeError
from .bounds import bounds_of
from .schema import section_path

# The words of a recipe's command line that jsonargparse handles itself; `--print_config` may take a value.
FILE_OPTION = "--config"
PRINT_OPTION = "--print_config"
HELP_WORDS = ("-h", "--help")
EXAMPLE = "--train.max_steps 20"


class _ValueLoader(yaml.SafeLoader):
    """YAML as jsonargparse reads a value: `1e-3` is a float too (PyYAML alone wants `1.0e-3`)."""


_ValueLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def check_document(data: dict[Any, Any], recipe_type: type) -> None:
    """Every key of a recipe file's mapping is a field of `recipe_type` (through its sections), every value
    of its field's type; raises RecipeError naming the first that is not."""
    _check_section(data, recipe_type, [], flag=False)


def check_overrides(argv: list[str], recipe_type: type) -> None:
    """Every `--key value` (or `--key=value`) of a recipe's command line names a field of `recipe_type`, with a
    value of its type; raises RecipeError naming the first that does not.

    `--config FILE` and `--print_config` are jsonargparse's; a command line that asks for help is left to it whole.
    """
    if any(word in HELP_WORDS or word.split("=")[0].endswith(".help") for word in argv):
        return
    for flag, given in _flags(argv):
        if flag == FILE_OPTION and given is None:
            raise RecipeError(f"{FILE_OPTION}: expected a recipe file, got no value")
        if flag not in (FILE_OPTION, PRINT_OPTION):
            _check_override(flag, given, recipe_type)


def check_values(section: Any) -> None:
    """Every value of a parsed recipe (a Recipe instance, defaults included), or of one section of it, is one of its
    field's choices and within its field's bounds; raises RecipeError naming the first that is not by its path in
    the recipe (`train.max_steps=0 must be >= 1`)."""
    prefix = section_path(section)
    _check_instance(section, prefix.split(".") if prefix else [])


def load_value(text: str) -> Any:
    """A value written as text (on the command line, or quoted in a file), read as YAML; the text if it is not YAML."""
    try:
        return yaml.load(text, Loader=_ValueLoader)  # a SafeLoader: plain data, nothing constructed or run
    except yaml.YAMLError:
        return text


def _flags(argv: list[str]) -> list[tuple[str, str | None]]:
    """argv as (flag, its value or None) pairs, paired as argparse pairs them; refuses a word that is neither."""
    pairs: list[tuple[str, str | None]] = []
    rest = list(argv)
    while rest:
        word, rest = rest[0], rest[1:]
        if not word.startswith("--") or word == "--":
            raise RecipeError(f"unexpected {word!r} (an override is --key value, as {EXAMPLE})")
        flag, equals, value = word.partition("=")
        given: str | None = value if equals else None
        if not equals and rest and not _looks_like_an_option(rest[0]):
            given, rest = rest[0], rest[1:]
        pairs.append((flag, given))
    return pairs


def _check_override(flag: str, given: str | None, recipe_type: type) -> None:
    """One override: `--strategy.fsdp2.float8 true`, or `--logger.tags+ x` (jsonargparse appends x to the list)."""
    parts = flag[2:].removesuffix("+").split(".")
    annotation = _field_at(parts, recipe_type)
    if flag.endswith("+"):
        if typing.get_origin(annotation) is not list:
            raise RecipeError(f"unknown option '{flag}' (+ appends to a list; {'.'.join(parts)} is not one)")
        annotation = annotation | typing.get_args(annotation)[0]  # one item, or a list of them
    if given is None:
        raise RecipeError(f"{flag}: expected {_describe(annotation)}, got no value")
    _check_value(given, annotation, parts, flag=True)


def _check_section(data: dict[Any, Any], section: type, parts: list[str], flag: bool) -> None:
    """Every key of `data` is a field of the dataclass `section` (at dotted path `parts`), every value of its type."""
    fields = _fields(section)
    for key, value in data.items():
        if key not in fields:
            raise RecipeError(_unknown([*parts, str(key)], len(parts), section, flag))
        _check_value(value, fields[key], [*parts, key], flag)


def _check_value(value: Any, annotation: Any, parts: list[str], flag: bool) -> None:
    """`value` fits `annotation`: a section is walked key by key, anything else compared with the type."""
    name = ("--" if flag else "") + ".".join(parts)
    section = _section_in(annotation)
    if section is not None:
        if isinstance(value, str):
            value = load_value(value)
        if isinstance(value, dict):
            _check_section(value, section, parts, flag)
        elif not (value is None and _accepts(None, annotation)):
            raise RecipeError(f"{name}: expected {_describe(annotation)}, got {_shown(value)}")
        return
    if _accepts(value, annotation):
        return
    if isinstance(value, str):
        loaded = load_value(value)
        if _accepts(loaded, annotation):
            return
        value = loaded if value.strip() else value
    if choices := _choices(annotation):
        raise RecipeError(_not_allowed(name, value, choices))
    raise RecipeError(f"{name}: expected {_describe(annotation)}, got {_shown(value)}")


def _check_instance(section: Any, parts: list[str]) -> None:
    """The values of the dataclass instance `section` (at dotted path `parts`) in their choices and bounds."""
    annotations = _fields(type(section))
    for member in dataclasses.fields(section):
        value, path = getattr(section, member.name), [*parts, member.name]
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            _check_instance(value, path)
            continue
        name, annotation = ".".join(path), annotations[member.name]
        if (choices := _choices(annotation)) and not _accepts(value, annotation):
            raise RecipeError(_not_allowed(name, value, choices))
        bounds = bounds_of(member)
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if bounds is not None and is_number and (refusal := bounds.refusal(value)) is not None:
            raise RecipeError(f"{name}={value} {refusal}")


def _not_allowed(name: str, value: Any, choices: tuple[Any, ...]) -> str:
    """`precision: 'fp8' is not allowed (choose one of '32-true', ...)`."""
    allowed = ", ".join(_shown(choice) for choice in choices)
    return f"{name}: {_shown(value)} is not allowed (choose one of {allowed})"


def _field_at(parts: list[str], recipe_type: type) -> Any:
    """The annotation of the field a dotted override names (`strategy.fsdp2.float8`); RecipeError if none."""
    annotation: Any = recipe_type
    for index, part in enumerate(parts):
        section = _section_in(annotation)
        if section is None:
            shown = ".".join(parts)
            raise RecipeError(f"unknown option '--{shown}' ({'.'.join(parts[:index])} takes a value, not keys)")
        fields = _fields(section)
        if part not in fields:
            raise RecipeError(_unknown(parts, index, section, flag=True))
        annotation = fields[part]
    return annotation


def _unknown(parts: list[str], index: int, section: type, flag: bool) -> str:
    """`unknown key 'train.max_step': did you mean 'train.max_steps'? (allowed in train: ...)`: parts[index] is unknown."""
    dash, what = ("--", "option") if flag else ("", "key")
    names = list(_fields(section))
    where = f" in {'.'.join(parts[:index])}" if index else ""
    line = f"unknown {what} '{dash}{'.'.join(parts)}'"
    if close := difflib.get_close_matches(parts[index], names, n=1):
        line += f": did you mean '{dash}{'.'.join([*parts[:index], close[0], *parts[index + 1 :]])}'?"
    return f"{line} (allowed{where}: {', '.join(names)})"


def _fields(section: type) -> dict[str, Any]:
    """A dataclass's fields and their annotations, in order."""
    hints = typing.get_type_hints(section)
    return {field.name: hints[field.name] for field in dataclasses.fields(section)}


def _members(annotation: Any) -> tuple[Any, ...]:
    """The types of a union (`int | None`), or the type itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _section_in(annotation: Any) -> type | None:
    """The dataclass of a section's annotation (`TrainConfig`, or the one in `DeepSpeedOptions | None`), else None."""
    for member in _members(annotation):
        if isinstance(member, type) and dataclasses.is_dataclass(member):
            return member
    return None


def _accepts(value: Any, annotation: Any) -> bool:
    """Whether `value` is of the type `annotation` (bool is no int; an int is a float)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return True
    if annotation is type(None):
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is str:
        return isinstance(value, str)
    if origin is Literal:
        return any(value == choice and type(value) is type(choice) for choice in args)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(value, member) for member in args)
    if origin is list:
        return isinstance(value, list) and all(_accepts(item, args[0]) for item in value)
    if origin is dict:
        return isinstance(value, dict) and all(_accepts(k, args[0]) and _accepts(v, args[1]) for k, v in value.items())
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return isinstance(value, dict)
    return True  # a kind of type the schema does not use yet: jsonargparse checks it


def _choices(annotation: Any) -> tuple[Any, ...]:
    """The values a Literal (or a Literal or null) allows, in order; () for any other type."""
    choices: list[Any] = []
    for member in _members(annotation):
        if typing.get_origin(member) is Literal:
            choices += typing.get_args(member)
        elif member is type(None):
            choices.append(None)
        else:
            return ()
    return tuple(choices)


def _describe(annotation: Any) -> str:
    """A type in words: `int`, `a list of str`, `a mapping of its keys (stage, ...) or null`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(member) for member in args)
    if origin is Literal:
        return f"one of {', '.join(_shown(choice) for choice in args)}"
    if origin is list:
        return f"a list of {_describe(args[0])}"
    if origin is dict:
        return f"a mapping of {_describe(args[0])} to {_describe(args[1])}"
    if isinstance(annotation, type) and dataclasses.is_dataclass(annotation):
        return f"a mapping of its keys ({', '.join(_fields(annotation))})"
    return getattr(annotation, "__name__", str(annotation))


def _shown(value: Any) -> str:
    """A value as a message quotes it: a string in quotes, anything else as YAML/JSON writes it, cut short."""
    text = repr(value) if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def _looks_like_an_option(word: str) -> bool:
    """Whether argparse reads `word` as an option rather than a value (a negative number is a value)."""
    return word.startswith("-") and not re.fullmatch(r"-\d+|-\d*\.\d+", word)
