"""Which of `plan`'s candidates a recipe's task can run: each candidate's `strategy:` section put in the recipe and the
recipe checks asked, as `train` asks them. They refuse what the size formulas cannot see: a task without a
tensor-parallel plan or a pipeline split, a model dimension tensor parallel does not divide, adapters a family cannot
train, a precision or a checkpoint layout a family does not have."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

from ..errors import RecipeError
from ..recipe.checks import check_strategy
from ..recipe.schema import STRATEGY_SECTIONS, Recipe, StrategyConfig
from .plan import Candidate
from .report import strategy_section


def candidate_strategy(recipe: Recipe, candidate: Candidate) -> StrategyConfig:
    """The recipe's `strategy:` section as it selects `candidate` (without activation checkpointing)."""
    cpu, micro_batch = recipe.accelerator == "cpu", recipe.train.micro_batch_size
    base = dataclasses.asdict(recipe.strategy)
    section = strategy_section(candidate, base, checkpointing=False, cpu=cpu, micro_batch=micro_batch)
    family = candidate.strategy
    sections: dict[str, Any] = dict.fromkeys(STRATEGY_SECTIONS)
    if family.options_key and family.options_type:
        sections[family.options_key] = family.options_type(**section[family.options_key])
    plain = {key: value for key, value in section.items() if key not in STRATEGY_SECTIONS}
    return dataclasses.replace(recipe.strategy, **plain, **sections)


def refused_candidates(recipe: Recipe, candidates: Iterable[Candidate]) -> dict[str, str]:
    """Candidate name -> the recipe checks' one line, for each candidate whose strategy the recipe cannot run."""
    refused = {}
    for candidate in candidates:
        try:
            check_strategy(dataclasses.replace(recipe, strategy=candidate_strategy(recipe, candidate)))
        except RecipeError as error:
            refused[candidate.name] = str(error)
    return refused
