"""The package's shape: imports flow one way, only strategies/ knows strategies, modules stay small."""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import PACKAGE, PROJECT

from {{ cookiecutter.package_name }}.strategies import REGISTRY

SOURCE = PROJECT / "src" / PACKAGE
FABRIC_STRATEGY_CLASSES = {"DDPStrategy", "FSDPStrategy", "DeepSpeedStrategy", "ModelParallelStrategy", "ModelParallel"}


def module_name(path: Path) -> str:
    parts = path.relative_to(SOURCE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(SOURCE.rglob("*.py"))}


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """The package's modules that a file imports, at the top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in known}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(PACKAGE):
            for alias in node.names:  # `from pkg.recipe import schema` imports the module pkg.recipe.schema
                submodule = f"{node.module}.{alias.name}"
                found.add(submodule if submodule in known else node.module)
    return found


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


def test_only_strategies_and_the_schema_name_a_strategy_or_a_fabric_strategy_class() -> None:
    allowed = {SOURCE / "recipe" / "schema.py", *(SOURCE / "strategies").glob("*.py")}
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


def test_the_loop_reads_in_one_sitting_and_no_module_grows_past_400_lines() -> None:
    assert len((SOURCE / "train.py").read_text().splitlines()) <= 250
    too_long = {
        str(path.relative_to(SOURCE)): lines
        for path in SOURCE.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > 400
    }
    assert not too_long, too_long
