"""The tasks and the strategy families by name, kept where the recipe and checkpoint layers look them up.

Those layers sit below tasks/ and strategies/ and import neither: tasks/__init__.py and strategies/__init__.py
fill these tables (and tasks/ adds how a task is found by its folder). The package's __init__ imports both, so
whoever imports any module of the package finds them filled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from ..errors import RecipeError
from .schema import Recipe, StrategyConfig, field_path


class RecipeTask(Protocol):
    """What checking a recipe and reading a checkpoint ask of a task (tasks/base.py's Task)."""

    name: ClassVar[str]
    recipe_type: ClassVar[type[Recipe]]

    def __init__(self, recipe: Recipe) -> None: ...

    @classmethod
    def saved_recipe_overrides(cls, saved: dict[str, Any]) -> list[str]: ...

    def check(self) -> None: ...

    def adapters(self) -> str | None: ...

    def resumable_model_changes(self) -> frozenset[str]: ...

    def checkpointed_parameters(self) -> int | None: ...

    def model_cost(self) -> Any: ...

    def build_model(self) -> Any: ...

    def pretrained_tensors(self) -> Iterator[tuple[str, Any]]: ...

    def frozen_from_pretrained(self) -> bool: ...


class RecipeStrategy(Protocol):
    """What checking a recipe and reading a checkpoint ask of a strategy family (strategies/base.py)."""

    name: ClassVar[str]
    options_key: ClassVar[str | None]
    options_type: ClassVar[type | None]
    checkpoint_layout: ClassVar[str]
    supports_meta_init: ClassVar[bool]
    trains_adapters: ClassVar[bool]

    def __init__(self, recipe: Recipe) -> None: ...

    def check(self) -> None: ...

    def gpu_requirement(self) -> Any: ...


Kind = TypeVar("Kind")


class Registry(Generic[Kind]):
    """Names -> classes of one kind: those added, then whatever the finder the upper layer installed finds."""

    def __init__(self, field: str) -> None:
        self.field = field  # the recipe field that names one, for the error
        self.classes: dict[str, Kind] = {}
        self._find: Callable[[str], Kind] | None = None

    def find_with(self, find: Callable[[str], Kind]) -> None:
        """Look names that were not added up with `find` (which raises RecipeError for an unknown name)."""
        self._find = find

    def __call__(self, name: str) -> Kind:
        """The class registered as `name`; a RecipeError naming those there are otherwise."""
        if name in self.classes:
            return self.classes[name]
        if self._find is not None:
            return self._find(name)
        raise RecipeError(f"{self.field}={name!r} is not one of: {', '.join(self.classes)}")


TASKS: Registry[type[RecipeTask]] = Registry(field_path(Recipe, "task"))
STRATEGIES: Registry[type[RecipeStrategy]] = Registry(field_path(StrategyConfig, "name"))


def task_for(recipe: Recipe) -> RecipeTask:
    """The task the recipe trains, bound to the recipe."""
    return TASKS(recipe.task)(recipe)


def strategy_for(recipe: Recipe) -> RecipeStrategy:
    """The strategy the recipe asks for, bound to the recipe."""
    return STRATEGIES(recipe.strategy.name)(recipe)
