"""The optimizer (AdamW, decay on matrices only) and the learning-rate schedule (linear warmup, then a cosine
decay or warmup-stable-decay)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import torch

from ..recipe.schema import TrainConfig

FUSED_ADAMW_DEVICES = {"cuda", "cpu"}  # torch's fused AdamW kernels (torch >= 2.4 on CPU)


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms and biases), in its fastest kernel for the device."""
    # Under DeepSpeed ZeRO-3 a parameter is an empty placeholder between uses; ds_shape is its real shape.
    trained = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trained if len(getattr(p, "ds_shape", p.shape)) >= 2]
    no_decay = [p for p in trained if len(getattr(p, "ds_shape", p.shape)) < 2]
    groups = [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    betas = (config.beta1, config.beta2)
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=betas, **adamw_kernel(trained))


def adamw_kernel(parameters: Sequence[torch.Tensor]) -> dict[str, bool]:
    """fused=True where torch has a fused AdamW for the parameters' device (CUDA, CPU), foreach=True otherwise.

    The fused kernel updates every parameter in one pass per tensor instead of a chain of elementwise ops:
    on CUDA it is the fastest (torch's own default there is foreach), and on CPU, where torch's default is one
    tensor at a time, foreach is slower still (benchmarks/run.py: adamw_vs_previous_default). It steps DTensor
    parameters (fsdp2, tensor parallel) and DeepSpeed ZeRO's flat partitions as well (the tests run both on CPU),
    and takes the gradient scaler's inputs (16-mixed). No strategy here needs the foreach fallback.
    """
    devices = {p.device.type for p in parameters}
    if devices and devices <= FUSED_ADAMW_DEVICES:
        return {"fused": True}
    return {"foreach": True}


def learning_rate_factor(step: int, config: TrainConfig) -> float:
    """The learning rate at `step` as a factor of the peak: linear warmup, then the schedule's decay to
    min_learning_rate at max_steps (cosine: all the way; wsd: constant, then linear over the last decay_fraction)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    floor = config.min_learning_rate / config.learning_rate
    if config.schedule == "wsd":
        decay_steps = config.wsd_decay_steps
        progress = min(1.0, max(0, step - (config.max_steps - decay_steps)) / decay_steps)
        return 1.0 - (1.0 - floor) * progress
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.max_steps - config.warmup_steps))
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule, stepped once per optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, partial(learning_rate_factor, config=config))
