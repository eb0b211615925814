"""What the writers of cluster jobs (Kubernetes' manifests, and SLURM's job scripts where the project has them)
ask of a recipe, and how they show a value they refuse."""

from __future__ import annotations

from ..recipe.checks import needs_gpu
from ..recipe.schema import Recipe


def gpus_per_node(recipe: Recipe) -> int:
    """GPUs a node of the job asks for: one per task, unless the recipe runs on CPUs."""
    return recipe.devices if recipe.accelerator != "cpu" or needs_gpu(recipe) else 0


def shown(value: str) -> str:
    """A value as an error message shows it: repr (control characters visible), at most 60 characters."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
