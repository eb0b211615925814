"""The tasks by name: `task:` in a recipe selects one.

A new task is a package here implementing `Task` (tasks/base.py), with a `Recipe` subclass holding
its `model:` and `data:` sections, and a line below (or a `register` call).
"""

from __future__ import annotations

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.tasks.base import ModelCost, Samples, Splits, Task
from {{ cookiecutter.package_name }}.tasks.language_model.task import LanguageModel

__all__ = ["ModelCost", "Samples", "Splits", "Task", "register", "task_class", "task_for"]

REGISTRY: dict[str, type[Task]] = {task.name: task for task in (LanguageModel,)}


def register(task: type[Task]) -> type[Task]:
    """Add a task under its `name` (usable as a class decorator)."""
    REGISTRY[task.name] = task
    return task


def task_class(name: str) -> type[Task]:
    """The task registered as `name`; a RecipeError naming the registered ones otherwise."""
    if name not in REGISTRY:
        raise RecipeError(f"task={name!r} is not one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def task_for(recipe: Recipe) -> Task:
    """The task the recipe trains, bound to the recipe."""
    return task_class(recipe.task)(recipe)
