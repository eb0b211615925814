"""Recipe -> Fabric: accelerator, strategy object, precision, devices, nodes and loggers."""

from __future__ import annotations

from datetime import timedelta
from functools import partial

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, Strategy

from {{ cookiecutter.package_name }}.config import Recipe, RecipeError
from {{ cookiecutter.package_name }}.parallel import parallelize


def resolve_accelerator(recipe: Recipe) -> str:
    """The accelerator this machine will use for the recipe; refuses cuda where no GPU is visible."""
    has_cuda = torch.cuda.is_available()
    if recipe.accelerator == "cuda" and not has_cuda:
        raise RecipeError("accelerator=cuda but no CUDA GPU is visible on this machine (use accelerator=cpu or auto)")
    if recipe.accelerator == "auto":
        return "cuda" if has_cuda else "cpu"
    return recipe.accelerator


def build_strategy(recipe: Recipe) -> Strategy:
    """The Fabric strategy object a recipe asks for."""
    options = {
        "process_group_backend": recipe.strategy.process_group_backend,
        "timeout": timedelta(minutes=recipe.strategy.timeout_minutes),
    }
    if recipe.strategy.name == "ddp":
        return DDPStrategy(**options)
    return ModelParallelStrategy(
        parallelize_fn=partial(parallelize, config=recipe.strategy),
        data_parallel_size=recipe.world_size,
        tensor_parallel_size=1,
        **options,
    )


def build_fabric(recipe: Recipe, loggers: list[Logger]) -> Fabric:
    """A Fabric object configured by the recipe (processes are launched by `fabric.launch()`)."""
    accelerator = resolve_accelerator(recipe)
    if accelerator == "cuda" and recipe.devices > torch.cuda.device_count():
        raise RecipeError(f"devices={recipe.devices} but this machine has {torch.cuda.device_count()} GPU(s)")
    if accelerator == "cpu" and recipe.precision in ("16-mixed", "16-true"):
        raise RecipeError(f"precision={recipe.precision} needs a GPU; on CPU choose 32-true, bf16-mixed or bf16-true")
    return Fabric(
        accelerator=accelerator,
        devices=recipe.devices,
        num_nodes=recipe.num_nodes,
        precision=recipe.precision,
        strategy=build_strategy(recipe),
        loggers=loggers,
    )
