"""The package's shape: imports run down its layers, only strategies/ knows strategies and no library recipe, only
tasks/ knows the workload, only the schema spells a recipe field's path, the layout drawings (the README's and
docs/layout.md's) list every top-level module, modules stay small."""

from __future__ import annotations

import ast
import dataclasses
import re
import types
import typing
from pathlib import Path

import torch
from helpers import PACKAGE, PROJECT

from {{ cookiecutter.package_name }}.strategies import REGISTRY
from {{ cookiecutter.package_name }}.tasks import task_class

SOURCE = PROJECT / "src" / PACKAGE
FABRIC_STRATEGY_CLASSES = {"DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "ModelParallel"}
# Names of one workload: what the machinery must ask a task for instead of naming it.
WORKLOAD_NAMES = re.compile(r"token|vocab|block_size|perplexity", re.IGNORECASE)
LOSS_FUNCTIONS = {
    name for name in dir(torch.nn.functional) if name.endswith(("_loss", "cross_entropy", "kl_div"))
} | set(torch.nn.modules.loss.__all__)


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def imported_from(path: Path, node: ast.ImportFrom) -> str | None:
    """The absolute name of the module a `from ... import` names (`from ..recipe import schema` in
    pkg/checkpoint/io.py: pkg.recipe); None for a module outside the package."""
    if node.level == 0:
        return node.module if node.module and node.module.split(".")[0] == PACKAGE else None
    here = module_name(path).split(".")
    base = here if path.name == "__init__.py" else here[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(path: Path, known: set[str]) -> list[tuple[int, str]]:
    """(line, module) of each of the package's modules that a file imports, at the top or inside functions."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names if alias.name in known]
        elif isinstance(node, ast.ImportFrom) and (module := imported_from(path, node)) is not None:
            for alias in node.names:  # `from pkg.recipe import schema` imports the module pkg.recipe.schema
                submodule = f"{module}.{alias.name}"
                found.append((node.lineno, submodule if submodule in known else module))
    return found


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that a file imports, at the top or inside functions."""
    return {module for _, module in imports(path, known)}


def test_the_package_has_no_import_cycle() -> None:
    graph = {name: imported_modules(path, set(modules())) - {name} for name, path in modules().items()}
    done: set[str] = set()

    def visit(name: str, trail: list[str]) -> None:
        if name in trail:
            raise AssertionError("import cycle: " + " -> ".join([*trail[trail.index(name) :], name]))
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, [*trail, name])
        done.add(name)

    for name in graph:
        visit(name, [])
    assert graph[f"{PACKAGE}.errors"] == set()  # the bottom: everything may raise its errors


# The layers, top first: a module imports only from its own layer and those below it. A task's own commands
# (tasks/<task>/commands/) are commands that live with their task, so that a task is one folder.
LAYERS = [
    {"cli", "__main__", "train", ""},  # "": the package's __init__, which fills the registries below
    {"commands", "tasks.*.commands"},
    {"training"},
    {"tasks", "strategies", "cluster", "planner"},
    {"checkpoint", "data"},
    {"recipe", "precision", "progress"},
    {"errors", "project"},
]


def layer(module: str) -> int:
    """The index in LAYERS of a module of the package (0 is the top)."""
    parts = module.split(".")[1:]
    top = parts[0] if parts else ""
    if top == "tasks" and len(parts) > 2 and parts[2] == "commands":
        top = "tasks.*.commands"
    return next(index for index, names in enumerate(LAYERS) if top in names)


def upward_imports() -> list[str]:
    """`file:line importer -> imported` for every import from a lower layer into a higher one."""
    return [
        f"{path.relative_to(SOURCE)}:{line} {module_name(path)} -> {imported}"
        for name, path in modules().items()
        for line, imported in imports(path, set(modules()))
        if layer(imported) < layer(name)
    ]


def test_every_module_is_in_a_layer() -> None:
    unplaced = []
    for name in modules():
        try:
            layer(name)
        except StopIteration:
            unplaced.append(name)
    assert not unplaced, "add these to LAYERS: " + ", ".join(unplaced)


def test_imports_run_down_the_layers_only() -> None:
    offenders = upward_imports()
    assert not offenders, "imports into a higher layer: " + ", ".join(offenders)


def test_the_layer_check_finds_an_upward_import_inside_a_function() -> None:
    recipe = SOURCE / "recipe" / "checks.py"
    tree = ast.parse("def check():\n    from ..strategies import REGISTRY\n")
    module = imported_from(recipe, next(node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)))
    assert module == f"{PACKAGE}.strategies" and layer(module) < layer(module_name(recipe))


def test_strategies_name_no_library_recipe() -> None:
    names = {path.stem for path in (PROJECT / "recipes").glob("*.yaml")}
    assert names, "no recipes/*.yaml to look for"
    offenders = [
        f"{path.relative_to(SOURCE)}:{node.lineno} {name!r}"
        for path in sorted((SOURCE / "strategies").glob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
        for name in names
        if re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", node.value)
    ]
    assert not offenders, "strategies/ names library recipes (the planner or the recipe decides): " + ", ".join(
        offenders
    )


def test_only_strategies_and_the_schema_name_a_strategy_or_a_fabric_strategy_class() -> None:
    allowed = {
        SOURCE / "recipe" / "schema.py",
        SOURCE / "recipe" / "strategy_schema.py",
        *(SOURCE / "strategies").glob("*.py"),
    }
    names = set(REGISTRY)
    offenders = []
    for path in sorted(set(SOURCE.rglob("*.py")) - allowed):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                offenders.append(f"{path.relative_to(SOURCE)}:{node.lineno} {node.value!r}")
            identifier = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""
            if isinstance(node, ast.alias):
                identifier = node.name.rsplit(".", 1)[-1]
            if identifier in FABRIC_STRATEGY_CLASSES:
                offenders.append(f"{path.relative_to(SOURCE)}:{getattr(node, 'lineno', '?')} {identifier}")
    assert not offenders, "a strategy is decided outside strategies/: " + ", ".join(offenders)


def field_paths(cls: type, prefix: str = "") -> set[str]:
    """The dotted path of every field of a recipe dataclass, its sections (optional ones too) walked."""
    paths = set()
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        paths.add(prefix + field.name)
        kind = hints[field.name]
        members = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
        for member in members:
            if isinstance(member, type) and dataclasses.is_dataclass(member):
                paths |= field_paths(member, f"{prefix}{field.name}.")
    return paths


def recipe_field_paths() -> set[str]:
    """The paths of the Recipe of every task under tasks/ that name a field of a section ("train.max_steps").

    A top-level field ("devices", "task") is a plain word that the package uses in other senses too: left out."""
    tasks = [path.parent.name for path in sorted((SOURCE / "tasks").glob("*/task.py"))]
    assert tasks, "no task under tasks/"
    return {path for task in tasks for path in field_paths(task_class(task).recipe_type) if "." in path}


def spelt_field_paths(path: Path, paths: set[str]) -> list[tuple[int, str]]:
    """(line, string) of every string constant of a file that is a recipe field path or its override (`--path`)."""
    return [
        (node.lineno, node.value)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.removeprefix("--") in paths
    ]


def test_only_the_schema_spells_a_recipe_field_path() -> None:
    # The schema and each task's config.py declare the fields; everywhere else asks recipe.schema.field_path, so a
    # renamed field or section fails where it is used instead of leaving a message or an override that names nothing.
    allowed = {
        SOURCE / "recipe" / "schema.py",
        SOURCE / "recipe" / "strategy_schema.py",
        *(SOURCE / "tasks").glob("*/config.py"),
    }
    paths = recipe_field_paths()
    offenders = [
        f"{path.relative_to(SOURCE)}:{line} {value!r}"
        for path in sorted(set(SOURCE.rglob("*.py")) - allowed)
        for line, value in spelt_field_paths(path, paths)
    ]
    assert not offenders, "recipe field paths spelt outside the schema (use field_path): " + ", ".join(offenders)


def test_the_field_path_check_finds_a_path_and_an_override_but_not_prose(tmp_path: Path) -> None:
    sample = tmp_path / "module.py"
    sample.write_text(
        'field = "train.max_steps"\nargv = ["--train.max_steps", "5"]\n'
        'message = "train.max_steps must be >= 1"\nweights = "model.safetensors"\n'
    )
    assert spelt_field_paths(sample, recipe_field_paths()) == [(1, "train.max_steps"), (2, "--train.max_steps")]


def identifiers(path: Path) -> list[tuple[int, str]]:
    """(line, name) of every name a file defines, reads, imports or passes as a keyword (not its strings)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str | None] = []
        if isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.arg):
            names = [node.arg]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names = [node.name]
        elif isinstance(node, ast.keyword):
            names = [node.arg]
        elif isinstance(node, ast.alias):
            names = [node.name.rsplit(".", 1)[-1], node.asname]
        found += [(getattr(node, "lineno", 0), name) for name in names if name]
    return found


def test_only_tasks_name_a_workload_or_a_loss() -> None:
    offenders = [
        f"{path.relative_to(SOURCE)}:{line} {name}"
        for path in sorted(SOURCE.rglob("*.py"))
        if path.relative_to(SOURCE).parts[0] != "tasks"
        for line, name in identifiers(path)
        if WORKLOAD_NAMES.search(name) or name in LOSS_FUNCTIONS
    ]
    assert not offenders, "the workload is named outside tasks/: " + ", ".join(offenders)


def test_the_workload_check_finds_a_loss_and_a_token_name(tmp_path: Path) -> None:
    sample = tmp_path / "loop.py"
    sample.write_text("import torch.nn.functional as F\nloss = F.cross_entropy(logits, targets)\nblock_size = 4\n")
    named = {name for _, name in identifiers(sample)}
    assert "cross_entropy" in named & LOSS_FUNCTIONS and any(WORKLOAD_NAMES.search(name) for name in named)


def readme_layout(document: str = "README.md") -> set[str]:
    """The top-level entries of the package a layout drawing lists (`  name.py` or `  name/`): the README's short
    one, or docs/layout.md's in full."""
    readme = (PROJECT / document).read_text()
    drawing = readme.split("src/{{ cookiecutter.package_name }}/\n", 1)[1].split("```", 1)[0]
    return {match.rstrip("/") for match in re.findall(r"^  ([\w.]+/?)", drawing, flags=re.MULTILINE)}


def test_every_top_level_module_of_the_package_is_in_the_readmes_layout() -> None:
    top_level = {path.name for path in SOURCE.iterdir() if path.suffix == ".py" and path.name != "__init__.py"}
    top_level |= {path.name for path in SOURCE.iterdir() if (path / "__init__.py").is_file()}
    for document in ("README.md", "docs/layout.md"):
        listed = readme_layout(document)
        assert top_level - listed == set(), f"not in the layout of {document}"
        assert listed - top_level == set(), f"in the layout of {document} but not in the package"


def test_the_loop_reads_in_one_sitting_and_no_module_grows_past_400_lines() -> None:
    assert len((SOURCE / "training" / "loop.py").read_text().splitlines()) <= 250
    too_long = {
        str(path.relative_to(SOURCE)): lines
        for path in SOURCE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 400
    }
    assert not too_long, too_long
