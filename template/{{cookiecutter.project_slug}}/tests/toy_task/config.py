"""The toy task's recipe sections: `model:` (a residual MLP) and `data:` (random vectors). `VectorRecipe` is the
Recipe of `task: vector_regression`. No torch import, not even for type checkers: the recipe's parser reads this
module's annotations, and what a type-checking block imports it imports too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from {{ cookiecutter.package_name }}.recipe.schema import Recipe


@dataclass
class MlpConfig:
    """A residual MLP: an input layer, `depth` blocks of width `width`, a linear head."""

    inputs: int = 8
    outputs: int = 4
    width: int = 32
    depth: int = 3


@dataclass
class VectorData:
    """Random vectors x and targets y = W x + noise, W fixed by `seed`."""

    samples: int = 512
    noise: float = 0.01
    seed: int = 0


@dataclass
class VectorRecipe(Recipe):
    """A recipe of `task: vector_regression`."""

    model: MlpConfig = field(default_factory=MlpConfig)
    data: VectorData = field(default_factory=VectorData)
