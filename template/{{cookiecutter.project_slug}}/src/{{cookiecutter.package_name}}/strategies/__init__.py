"""The strategy families by name: `strategy.name` in a recipe selects one of these.

A new family is one module implementing `TrainingStrategy` (strategies/base.py), a line below (or a
`register` call), and, if it has options, a section in recipe/strategy_schema.py's StrategyConfig.
"""

from __future__ import annotations

from typing import Any, cast

from ..errors import RecipeError
from ..recipe.registry import STRATEGIES
from ..recipe.schema import Recipe
from .base import GpuRequirement, TrainingStrategy
from .ddp import DDP
from .deepspeed import DeepSpeed
from .fsdp import FSDP1
from .fsdp2 import FSDP2, HSDP

__all__ = ["GpuRequirement", "TrainingStrategy", "register", "strategy_class", "strategy_for"]

REGISTRY: dict[str, type[TrainingStrategy]] = {family.name: family for family in (DDP, FSDP2, HSDP, FSDP1, DeepSpeed)}
# One table: the recipe and checkpoint layers, below this one, look families up in it (recipe/registry.py).
STRATEGIES.classes = cast(Any, REGISTRY)


def register(family: type[TrainingStrategy]) -> type[TrainingStrategy]:
    """Add a strategy family under its `name` (usable as a class decorator)."""
    REGISTRY[family.name] = family
    return family


def strategy_class(name: str) -> type[TrainingStrategy]:
    """The family registered as `name`; a RecipeError naming the registered ones otherwise."""
    if name not in REGISTRY:
        raise RecipeError(f"strategy.name={name!r} is not one of: {', '.join(REGISTRY)}")
    return REGISTRY[name]


def strategy_for(recipe: Recipe) -> TrainingStrategy:
    """The strategy the recipe asks for, bound to the recipe."""
    return strategy_class(recipe.strategy.name)(recipe)
