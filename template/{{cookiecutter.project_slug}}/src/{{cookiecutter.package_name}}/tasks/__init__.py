"""The tasks by name: `task:` in a recipe selects one.

A task is a package here, found by its folder: tasks/<name>/task.py defines the `Task` subclass
(tasks/base.py) whose `name` is <name>, with a `Recipe` subclass holding its `model:` and `data:`
sections. Nothing outside the package names it. A task's module is imported when a recipe asks for
it, so a task that imports torch at the top costs nothing to the commands that check recipes of
other tasks without torch. `register` adds a task defined elsewhere (a plugin, a test).
"""

from __future__ import annotations

from importlib import import_module
from pkgutil import iter_modules
from typing import Any, cast

from ..errors import RecipeError
from ..recipe.registry import TASKS
from ..recipe.schema import Recipe
from .base import ModelCost, Samples, Splits, Task

__all__ = ["ModelCost", "Samples", "Splits", "Task", "register", "task_class", "task_for", "task_names"]

# Tasks registered by `register`, and those found under tasks/ once imported.
REGISTRY: dict[str, type[Task]] = {}


def task_names() -> list[str]:
    """Every task there is: the packages under tasks/ (found without importing them) and the registered ones."""
    found = [module.name for module in iter_modules(__path__) if module.ispkg]
    return sorted({*found, *REGISTRY})


def register(task: type[Task]) -> type[Task]:
    """Add a task under its `name` (usable as a class decorator)."""
    REGISTRY[task.name] = task
    return task


def task_class(name: str) -> type[Task]:
    """The task named `name`; a RecipeError naming the tasks there are otherwise."""
    if name in REGISTRY:
        return REGISTRY[name]
    if name not in task_names():
        raise RecipeError(f"task={name!r} is not one of: {', '.join(task_names())}")
    module = import_module(f"{__name__}.{name}.task")
    classes = [
        value
        for value in vars(module).values()
        if isinstance(value, type) and issubclass(value, Task) and getattr(value, "name", None) == name
    ]
    if len(classes) != 1:
        raise RecipeError(
            f"task={name!r}: tasks/{name}/task.py must define one Task subclass with name = {name!r}"
            f" (it defines {len(classes)})"
        )
    REGISTRY[name] = classes[0]
    return classes[0]


# The recipe and checkpoint layers, below this one, look tasks up through recipe/registry.py: the same table, and
# the folders found the same way.
TASKS.classes = cast(Any, REGISTRY)
TASKS.find_with(task_class)


def task_for(recipe: Recipe) -> Task:
    """The task the recipe trains, bound to the recipe."""
    return task_class(recipe.task)(recipe)
