"""Reading a recipe: a YAML file plus dotted command-line overrides (`--train.max_steps 20`) -> a checked `Recipe`.

The recipe's `task:` (from the overrides, else the file, else the default) selects the Recipe class:
the machinery's sections (recipe/schema.py) plus the task's `model:` and `data:`. jsonargparse fills
those dataclasses and rejects unknown keys and values of the wrong type; its multi-line errors are
condensed here into one line that names the field.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.checks import check_recipe
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.strategies import strategy_class
from {{ cookiecutter.package_name }}.tasks import task_class

# A recipe file is small: a bound on its size and on what its aliases expand to (nothing near either is a recipe).
MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_NODES = 100_000


def recipe_parser(prog: str = "train", recipe_type: type[Recipe] | None = None) -> ArgumentParser:
    """A parser for a recipe file plus dotted command-line overrides (of the default task's Recipe unless given)."""
    recipe_type = recipe_type or task_class(Recipe.task).recipe_type
    parser = ArgumentParser(prog=prog, exit_on_error=False, allow_abbrev=False, description="Train with a recipe.")
    parser.add_argument("--config", action=ActionConfigFile, help="Recipe YAML file.")
    parser.add_class_arguments(recipe_type, nested_key=None, fail_untyped=True)
    return parser


def parse_recipe(argv: list[str], prog: str = "train") -> Recipe:
    """Parse and check a recipe; raises RecipeError with a one-line message."""
    source = _config_source(argv)
    files = _config_files(argv)
    documents = [read_recipe_file(path, source) for path in files]
    try:
        recipe_type = task_class(_task_name(argv, documents)).recipe_type
    except RecipeError as error:
        raise RecipeError(f"{source}: {error}") from None
    for document in documents:
        if document is not None:
            _check_keys(document, recipe_type, "", source)
    parser = recipe_parser(prog, recipe_type)
    try:
        namespace = parser.parse_args(argv)
    except Exception as error:  # jsonargparse raises ArgumentError; its text spans lines
        raise RecipeError(_one_line(str(error), source, recipe_type)) from None
    values = parser.instantiate(namespace).as_dict()
    values.pop("config", None)
    recipe = recipe_type(**{f.name: values[f.name] for f in dataclasses.fields(recipe_type)})
    try:
        check_recipe(recipe)
    except RecipeError as error:
        raise RecipeError(f"{source}: {error}") from None
    # The strategy's own options section, filled with its defaults: the resolved recipe shows every option used.
    strategy = strategy_class(recipe.strategy.name)
    if strategy.options_key and strategy.options_type and getattr(recipe.strategy, strategy.options_key) is None:
        setattr(recipe.strategy, strategy.options_key, strategy.options_type())
    return recipe


def split_command_line(
    argv: list[str], value_options: tuple[str, ...], switches: tuple[str, ...] = ()
) -> tuple[str | None, list[str], list[str]]:
    """(recipe or None, the command's own options, recipe overrides) of `COMMAND [RECIPE] [options] [overrides]`.

    `plan` and `submit` take every recipe field as an override besides their own options; an option of
    `value_options` takes the next word as its value (or `--option=value`), a switch takes none.
    """
    name = argv[0] if argv and not argv[0].startswith("-") else None
    own: list[str] = []
    overrides: list[str] = []
    rest = argv[1:] if name else argv
    while rest:
        word, rest = rest[0], rest[1:]
        if word.split("=")[0] in value_options and "=" not in word and rest:
            own, rest = [*own, word, rest[0]], rest[1:]
        elif word.split("=")[0] in (*value_options, *switches, "-h", "--help"):
            own.append(word)
        else:
            overrides.append(word)
    return name, own, overrides


def load_recipe(path: str | Path) -> Recipe:
    """Parse and check one recipe file."""
    return parse_recipe(["--config", str(path)])


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML that `load_recipe` reads back."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def _config_files(argv: list[str]) -> list[Path]:
    """The recipe files named in argv (`--config FILE` or `--config=FILE`)."""
    files = [Path(argv[index + 1]) for index, arg in enumerate(argv[:-1]) if arg == "--config"]
    return files + [Path(arg.split("=", 1)[1]) for arg in argv if arg.startswith("--config=")]


def _task_name(argv: list[str], documents: list[dict[str, Any] | None]) -> str:
    """The recipe's task: the last `--task` override, else the last file that names one, else the default."""
    name = Recipe.task
    for document in documents:
        if document is not None and isinstance(document.get("task"), str):
            name = document["task"]
    for index, arg in enumerate(argv):
        if arg == "--task" and index + 1 < len(argv):
            name = argv[index + 1]
        elif arg.startswith("--task="):
            name = arg.split("=", 1)[1]
    return name


def read_recipe_file(path: Path, source: str) -> dict[str, Any] | None:
    """A recipe file's mapping (None when the file is missing: jsonargparse names it); refuses a file that is
    not YAML, is empty or is not a mapping (its keys are checked against the task's schema by the caller).

    Done here rather than left to jsonargparse, which accepts an unknown key whose value is an empty
    mapping (`optimiser: {}`), says "Unexpected config" for an empty file or a list, and drops the line
    and column of a YAML syntax error.
    """
    if not path.is_file():
        return None  # jsonargparse names the missing file
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: {path.stat().st_size:,} bytes; a recipe is at most {MAX_RECIPE_BYTES:,}")
    try:
        text = path.read_text()
        _check_expansion(yaml.compose(text), source)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        raise RecipeError(f"{source}: {where}{error.problem or error}") from None
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise RecipeError(f"{source}: not a YAML file ({str(error).splitlines()[0]})") from None
    except RecursionError:
        raise RecipeError(f"{source}: nested too deeply to be a recipe") from None
    if data is None:
        raise RecipeError(f"{source}: the file is empty (a recipe is a mapping of keys: devices, strategy, train, ...)")
    if not isinstance(data, dict):
        raise RecipeError(
            f"{source}: must be a mapping of keys (devices: 2, strategy: ..., train: ...), not a {type(data).__name__}"
        )
    return data


def _check_expansion(root: yaml.Node | None, source: str) -> None:
    """Refuse a document whose aliases expand it beyond MAX_RECIPE_NODES nodes (nested aliases make a few
    hundred bytes into gigabytes: "billion laughs"), counted on the composed graph before anything is built."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) not in sizes:
            sizes[id(node)] = 0  # a node that contains itself counts once
            children: list[yaml.Node] = []
            if isinstance(node, yaml.SequenceNode):
                children = list(node.value)
            elif isinstance(node, yaml.MappingNode):
                children = [item for pair in node.value for item in pair]
            total = 1
            for child in children:
                total += size(child)
                if total > MAX_RECIPE_NODES:
                    break
            sizes[id(node)] = total
        return sizes[id(node)]

    if root is not None and size(root) > MAX_RECIPE_NODES:
        raise RecipeError(
            f"{source}: its aliases expand it beyond {MAX_RECIPE_NODES:,} values; a recipe is not that big"
        )


def _check_keys(data: dict[Any, Any], cls: Any, prefix: str, source: str) -> None:
    """Every key of `data` is a field of the dataclass `cls` (recursively through sections)."""
    types = typing.get_type_hints(cls)
    for key, value in data.items():
        if key not in types:
            where = f" in {prefix.rstrip('.')}" if prefix else ""
            raise RecipeError(f"{source}: unknown key '{prefix}{key}' (allowed{where}: {_fields_of(cls)})")
        section = _dataclass_in(types[key])
        if dataclasses.is_dataclass(section) and isinstance(value, dict):
            _check_keys(value, section, f"{prefix}{key}.", source)


def _config_source(argv: list[str]) -> str:
    """Name of the recipe file in argv, for error messages."""
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            return f"recipe {Path(argv[index + 1]).name!r}"
        if arg.startswith("--config="):
            return f"recipe {Path(arg.split('=', 1)[1]).name!r}"
    return "recipe"


def _one_line(message: str, source: str, recipe_type: Any) -> str:
    """Condense a jsonargparse error (often several lines) into one line that names the field."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or [message]
    text = lines[0]
    if key := re.match(r'Parser key "([^"]+)":\s*', text):
        rest = text[key.end() :] or (lines[1] if len(lines) > 1 else "")
        if key.group(1) == "config":  # the recipe file itself: missing or not YAML
            return f"{source}: {rest[:1].lower()}{rest[1:]}"
        if inner := _union_member_error(lines):  # an options section (`X | None`): its dataclass's own error
            if unknown := re.match(r"Option '([^']+)' is not accepted", inner[0]):
                group = key.group(1)
                allowed = _fields_of(_group_class(group, recipe_type))
                return f"{source}: unknown key '{group}.{unknown.group(1)}' (allowed in {group}: {allowed})"
            if nested := re.match(r'Parser key "([^"]+)":\s*', inner[0]):
                inner[0] = f'Parser key "{key.group(1)}.{nested.group(1)}": {inner[0][nested.end() :]}'
                return _one_line("\n".join(inner), source, recipe_type)
        detail = lines[1] if len(lines) > 1 else rest
        if literal := re.search(r"Literal\[(.*)\]\. Got value: (.*)", detail):
            detail = f"{literal.group(2)!r} is not allowed (choose one of {literal.group(1)})"
        elif expected := re.search(r"Expected a <class '(\w+)'>\. Got value: (.*)", detail):
            detail = f"expected {expected.group(1)}, got {expected.group(2)!r}"
        return f"{source}: {key.group(1)}: {detail}"
    if unrecognized := re.match(r"unrecognized arguments: --([\w.]+)", text):  # a misspelt or abbreviated flag
        flag = unrecognized.group(1)
        group, _, _ = flag.rpartition(".")
        cls = _group_class(group, recipe_type) if group else recipe_type
        if not dataclasses.is_dataclass(cls):
            return f"{source}: unknown option '--{flag}' (no section {group!r}; sections and keys: {_fields_of(recipe_type)})"
        where = f" in {group}" if group else ""
        return (
            f"{source}: unknown option '--{flag}' (allowed{where}: {_fields_of(cls)}; abbreviations are not accepted)"
        )
    if unknown := re.match(r"Option '([^']+)' is not accepted", text):
        return f"{source}: unknown key {unknown.group(1)!r} (allowed: {_fields_of(recipe_type)})"
    if nested := re.match(r"Group '([^']+)' does not accept option '([^']+)'", text):
        group, option = nested.groups()
        allowed = _fields_of(_group_class(group, recipe_type))
        return f"{source}: unknown key '{group}.{option}' (allowed in {group}: {allowed})"
    return f"{source}: {text}"


def _union_member_error(lines: list[str]) -> list[str]:
    """The error lines of the dataclass member of an `X | None` field that did not validate, or []."""
    for index, line in enumerate(lines):
        if line.startswith("- Problem with given class_path"):
            inner = []
            for following in lines[index + 1 :]:
                if following.startswith("- "):
                    break
                inner.append(following)
            return inner
    return []


def _group_class(group: str, recipe_type: Any) -> Any:
    """The dataclass behind a dotted group name such as 'strategy'."""
    cls: Any = recipe_type
    for part in group.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        cls = _dataclass_in(typing.get_type_hints(cls).get(part))
    return cls


def _fields_of(cls: Any) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _dataclass_in(annotation: Any) -> Any:
    """The dataclass of a field's type (`StrategyConfig`, or the member of `DeepSpeedOptions | None`), else the type."""
    for member in typing.get_args(annotation):
        if dataclasses.is_dataclass(member):
            return member
    return annotation
