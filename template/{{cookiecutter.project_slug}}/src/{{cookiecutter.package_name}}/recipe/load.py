"""Reading a recipe: a YAML file plus dotted command-line overrides (`--train.max_steps 20`) -> a checked `Recipe`.

The recipe's `task:` (from the overrides, else the file, else the default) selects the Recipe class:
the machinery's sections (recipe/schema.py) plus the task's `model:` and `data:`. jsonargparse fills
those dataclasses. Before it does, recipe/typecheck.py walks the files' data and the overrides through the
schema, so an unknown key or a value of the wrong type is refused in the project's own words, one line
that names the field and what is allowed, whatever jsonargparse's own messages say.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser

from ..errors import RecipeError
from ..project import TASK
from .checks import check_recipe
from .registry import STRATEGIES, TASKS
from .schema import Recipe
from .typecheck import PRINT_OPTION, check_document, check_overrides

# A recipe file is small: a bound on its size and on what its aliases expand to (nothing near either is a recipe).
MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_NODES = 100_000


def recipe_parser(prog: str = "train", recipe_type: type[Recipe] | None = None) -> ArgumentParser:
    """A parser for a recipe file plus dotted command-line overrides (of the default task's Recipe unless given)."""
    recipe_type = recipe_type or TASKS(TASK).recipe_type
    parser = ArgumentParser(prog=prog, exit_on_error=False, allow_abbrev=False, description="Train with a recipe.")
    parser.add_argument("--config", action=ActionConfigFile, help="Recipe YAML file.")
    parser.add_class_arguments(recipe_type, nested_key=None, fail_untyped=True)
    return parser


def parse_recipe(argv: list[str], prog: str = "train") -> Recipe:
    """Parse and check a recipe; raises RecipeError with a one-line message."""
    if printing := _print_words(argv):  # jsonargparse prints and exits as it parses: the checks run before that
        parse_recipe([word for index, word in enumerate(argv) if index not in printing], prog)
    source = _config_source(argv)
    files = _config_files(argv)
    for path in files:
        if path.is_dir():
            raise RecipeError(f"{source}: '{path}' is a folder, not a recipe file")
        if not path.is_file():
            raise RecipeError(f"{source}: file does not exist: '{path}'")
    documents = [read_recipe_file(path, source) for path in files]
    try:
        recipe_type = TASKS(_task_name(argv, documents)).recipe_type
        for document in documents:
            check_document(document or {}, recipe_type)
        check_overrides(argv, recipe_type)
    except RecipeError as error:
        raise RecipeError(f"{source}: {error}") from None
    parser = recipe_parser(prog, recipe_type)
    try:
        namespace = parser.parse_args(argv)
    except ArgumentError as error:  # what the checks above let through and jsonargparse refused: its first line
        raise RecipeError(f"{source}: {str(error).strip().splitlines()[0]}") from None
    values = parser.instantiate(namespace).as_dict()
    values.pop("config", None)
    recipe = recipe_type(**{f.name: values[f.name] for f in dataclasses.fields(recipe_type)})
    try:
        check_recipe(recipe)
    except RecipeError as error:
        raise RecipeError(f"{source}: {error}") from None
    # The strategy's own options section, filled with its defaults: the resolved recipe shows every option used.
    strategy = STRATEGIES(recipe.strategy.name)
    if strategy.options_key and strategy.options_type and getattr(recipe.strategy, strategy.options_key) is None:
        setattr(recipe.strategy, strategy.options_key, strategy.options_type())
    return recipe


def split_command_line(
    argv: list[str], value_options: tuple[str, ...], switches: tuple[str, ...] = ()
) -> tuple[str | None, list[str], list[str]]:
    """(recipe or None, the command's own options, recipe overrides) of `COMMAND [RECIPE] [options] [overrides]`.

    `plan`, `k8s` and `ray` take every recipe field as an override besides their own options; an option of
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
    name = TASK
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
    """A recipe file's mapping (None when there is no such file); refuses a file that is too big, not YAML, empty
    or not a mapping, naming the line and column of a YAML syntax error. Its keys and values are checked
    against the task's schema by the caller (recipe/typecheck.py).
    """
    if not path.is_file():
        return None
    if path.stat().st_size > MAX_RECIPE_BYTES:
        raise RecipeError(f"{source}: {path.stat().st_size:,} bytes; a recipe is at most {MAX_RECIPE_BYTES:,}")
    try:
        text = path.read_text()
        _check_expansion(yaml.compose(text), source)
        data = yaml.load(text, Loader=_RecipeLoader)  # a SafeLoader that also refuses duplicate keys
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


def _print_words(argv: list[str]) -> set[int]:
    """The positions of `--print_config` and of its value (`--print_config skip_null`, `--print_config=...`)."""
    positions = set()
    for index, word in enumerate(argv):
        if word == PRINT_OPTION or word.startswith(PRINT_OPTION + "="):
            positions.add(index)
            following = argv[index + 1] if index + 1 < len(argv) else ""
            if word == PRINT_OPTION and following and not following.startswith("-"):
                positions.add(index + 1)
    return positions


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: YAML keeps the last silently, and a recipe
    that says `lr` twice means one of them by mistake. Keys merged in with `<<` may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
                seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the constructor below refuses it
                continue
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (first on line {first}; give each key once)",
                    key_node.start_mark,
                )
        return super().construct_mapping(node, deep=deep)


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


def _config_source(argv: list[str]) -> str:
    """Name of the recipe file in argv, for error messages."""
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            return f"recipe {Path(argv[index + 1]).name!r}"
        if arg.startswith("--config="):
            return f"recipe {Path(arg.split('=', 1)[1]).name!r}"
    return "recipe"
