"""The tasks by name: `task:` in a recipe selects one.

A new task is a package here implementing `Task` (tasks/base.py), with a `Recipe` subclass holding
its `model:` and `data:` sections, and a line below (or a `register` call). A task's module is
imported when a recipe asks for it, so a task that imports torch at the top costs nothing to the
commands that check recipes of other tasks without torch.
"""

from __future__ import annotations

from importlib import import_module

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.tasks.base import ModelCost, Samples, Splits, Task

__all__ = ["ModelCost", "Samples", "Splits", "Task", "register", "task_class", "task_for"]

# name -> the task class, or "module:Class" to import it on first use
REGISTRY: dict[str, type[Task] | str] = {
{%- if cookiecutter.task == "language_model" %}
    "language_model": "{{ cookiecutter.package_name }}.tasks.language_model.task:LanguageModel",
{%- else %}
    "image_classification": "{{ cookiecutter.package_name }}.tasks.image_classification.task:ImageClassification",
{%- endif %}
}


def register(task: type[Task]) -> type[Task]:
    """Add a task under its `name` (usable as a class decorator)."""
    REGISTRY[task.name] = task
    return task


def task_class(name: str) -> type[Task]:
    """The task registered as `name`; a RecipeError naming the registered ones otherwise."""
    entry = REGISTRY.get(name)
    if entry is None:
        raise RecipeError(f"task={name!r} is not one of: {', '.join(REGISTRY)}")
    if isinstance(entry, str):
        module, _, attribute = entry.partition(":")
        entry = REGISTRY[name] = getattr(import_module(module), attribute)
    return entry


def task_for(recipe: Recipe) -> Task:
    """The task the recipe trains, bound to the recipe."""
    return task_class(recipe.task)(recipe)
