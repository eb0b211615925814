"""The optimizer (AdamW, decay on matrices only) and the learning-rate schedule (linear warmup, cosine decay)."""

from __future__ import annotations

import math
from functools import partial

import torch

from {{ cookiecutter.package_name }}.recipe.schema import TrainConfig


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms and biases)."""
    # Under DeepSpeed ZeRO-3 a parameter is an empty placeholder between uses; ds_shape is its real shape.
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in trained if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2))


def learning_rate_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup to the peak, then cosine decay to min_learning_rate at max_steps (a factor of the peak)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    floor = config.min_learning_rate / config.learning_rate
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule, stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(learning_rate_factor, config=config))
