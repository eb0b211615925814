"""The training loop: one loop for every recipe, from a laptop CPU to many GPU nodes.

Run it through the CLI (`<project> train --config recipes/cpu-debug.yaml`) or as a script under a
launcher (`fabric run ... src/<package>/train.py --config mine.yaml`, `torchrun ...`, `srun ...`).
Strategies differ only in `fabric_setup.py` / `parallel.py` and in the recipe.
"""

from __future__ import annotations

import math
import sys
import time
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
from lightning.fabric.utilities.rank_zero import rank_zero_only
from torchmetrics.aggregation import MeanMetric

from {{ cookiecutter.package_name }}.checkpoint import (
    Checkpointer,
    checkpoint_root,
    load_checkpoint,
    read_meta,
    resolve_resume,
)
from {{ cookiecutter.package_name }}.config import Recipe, TrainConfig, dump_recipe
from {{ cookiecutter.package_name }}.data import Batch, TrainBatches, load_splits, validation_batches
from {{ cookiecutter.package_name }}.errors import TrainingStopped
from {{ cookiecutter.package_name }}.fabric_setup import (
    build_fabric,
    build_model,
    clip_and_step,
    data_parallel_rank_and_size,
    discard_gradients,
    no_backward_sync,
    setup_model_and_optimizer,
)
from {{ cookiecutter.package_name }}.faults import fault_point, poison_loss
from {{ cookiecutter.package_name }}.launchers import start_processes
from {{ cookiecutter.package_name }}.loss_guard import LossGuard
from {{ cookiecutter.package_name }}.model import training_flops_per_token
from {{ cookiecutter.package_name }}.observe import Monitor, build_loggers, finish_loggers, log_config, logger_location, new_run_id
from {{ cookiecutter.package_name }}.preemption import Preemption
from {{ cookiecutter.package_name }}.step_sync import agree


def train(recipe: Recipe) -> None:
    """Train the model the recipe describes; resumes when the recipe says so."""
    # Everything that can reject the recipe runs before any process is launched or file written.
    train_tokens, val_tokens = load_splits(recipe.data, recipe.model)
    resume_from = resolve_resume(recipe)
    # A resumed or requeued job appends to the W&B run of its checkpoint instead of starting a new one.
    run_id = (read_meta(resume_from).get("wandb_run_id") if resume_from else None) or new_run_id()
    fabric = build_fabric(recipe, build_loggers(recipe, run_id))

    start_processes(fabric)  # unless `fabric run` already did
    fabric.seed_everything(recipe.train.seed)
    fabric.print(f"Recipe:\n{dump_recipe(recipe)}")

    model = build_model(fabric, recipe)  # whole on every rank, or sharded as it is built (meta_init, ZeRO-3)
    make_optimizer = partial(build_optimizer, config=recipe.train)
    model, optimizer, base_optimizer = setup_model_and_optimizer(fabric, model, recipe, make_optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(base_optimizer, partial(learning_rate_factor, config=recipe.train))
    dp_rank, dp_size = data_parallel_rank_and_size(fabric)  # tensor-parallel peers see the same batches

    batches = TrainBatches(
        train_tokens,
        block_size=recipe.model.block_size,
        micro_batch_size=recipe.train.micro_batch_size,
        grad_accum_steps=recipe.train.grad_accum_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=recipe.train.seed,
    )
    val_batches = validation_batches(
        val_tokens,
        recipe.model.block_size,
        recipe.train.micro_batch_size,
        recipe.eval.batches,
        dp_rank=dp_rank,
        dp_size=dp_size,
    )
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "data": batches,
        "step": 0,
        "tokens_seen": 0,
        "skipped_updates": 0,  # non-finite loss, on_nonfinite_loss=skip ("skipped_steps" is DeepSpeed's own key)
        "wandb_run_id": fabric.broadcast(run_id),  # rank 0's id: the one its logger writes to
    }
    if resume_from is not None:
        load_checkpoint(fabric, resume_from, state, recipe)
        fabric.print(f"Resumed from {resume_from} at step {state['step']}")
    elif recipe.checkpoint.resume == "auto":
        fabric.print(f"No checkpoint under {checkpoint_root(recipe)}: starting from step 0")
    log_config(fabric.loggers, recipe)

    max_steps, accumulate = recipe.train.max_steps, recipe.train.grad_accum_steps
    tokens_per_step = batches.global_batch_size * recipe.model.block_size
    flops_per_token = training_flops_per_token(recipe.model)
    monitor = Monitor(fabric, recipe, flops_per_token, state["step"], batches.global_batch_size)
    checkpointer = Checkpointer(fabric, recipe)
    preemption = Preemption(fabric)  # SIGUSR1/SIGTERM: save at the next step boundary, requeue, exit
    loss_guard = LossGuard(fabric, recipe.train.on_nonfinite_loss)
    preempted, verdict = False, "update"
    model.train()
    while state["step"] < max_steps:
        loss_sum = torch.zeros((), device=fabric.device)
        for micro_step, (inputs, targets) in enumerate(monitor.timed(batches.iter_step())):
            inputs, targets = fabric.to_device((inputs, targets))
            # Gradients are synchronised only on the last micro-batch of the step.
            with no_backward_sync(fabric, model, enabled=micro_step < accumulate - 1):
                loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
                loss = poison_loss(loss, state["step"] + 1)  # NaN only under TRAIN_FAULT=nan-at-step
                fabric.backward(loss / accumulate)
            loss_sum += loss.detach()
        grad_norm = None
        # One all_reduce for what every rank decides together: a NaN/inf loss on some rank (every rank skips
        # this update, or the run stops, as the recipe says), a stop signal, a time-based checkpoint.
        agreed = agree(fabric, loss_sum, preemption.received, checkpointer.time_is_up())
        verdict = loss_guard.verdict(state["step"] + 1, agreed.nonfinite_loss, state["skipped_updates"])
        preempted = preemption.requested(agreed.stop_signal)  # SIGUSR1/SIGTERM on some rank: save this step, stop
        if verdict == "stop":
            break
        if verdict == "update":
            grad_norm = clip_and_step(fabric, model, optimizer, max_norm=recipe.train.grad_clip)
        else:  # skip: this step's gradients are dropped (zero_grad below, and what DeepSpeed keeps besides)
            discard_gradients(fabric)
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["tokens_seen"] += tokens_per_step
        state["skipped_updates"] += verdict == "skip"
        step = state["step"]
        learning_rate = scheduler.get_last_lr()[0]
        monitor.step_end(step, loss_sum / accumulate, grad_norm, learning_rate, state["tokens_seen"], batches.epoch)

        every_eval = recipe.eval.every_steps
        if every_eval and (step % every_eval == 0 or step == max_steps):
            started = time.perf_counter()
            val_loss = validate(fabric, model, val_batches)
            monitor.log_validation(step, val_loss, seconds=time.perf_counter() - started)
        checkpointer.poll()
        if checkpointer.due(step, agreed.save_due) or preempted:
            seconds = checkpointer.save(state)
            monitor.log_checkpoint(step, checkpointer.root / f"step-{step:08d}", seconds=seconds)
        fault_point("step-end", step, recipe.out_dir)  # only under TRAIN_FAULT (tests)
        if preempted:
            break

    checkpointer.wait()
    monitor.close()
    outcome = "Stopped" if preempted or verdict == "stop" else "Done"
    fabric.print(f"{outcome} at step {state['step']}. Checkpoints: {checkpoint_root(recipe)}")
    if fabric.global_rank == 0:
        fabric.print(f"Logs: {logger_location(recipe, fabric.loggers)}")
    finish_loggers(fabric.loggers)
    if verdict == "stop":
        raise loss_guard.stopped(state["step"] + 1)
    if preempted:
        raise preemption.requeue(state["step"])


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


@torch.no_grad()
def validate(fabric: Fabric, model: torch.nn.Module, batches: list[Batch]) -> float:
    """Mean validation loss per token over all ranks' batches."""
    model.eval()
    mean_loss = MeanMetric().to(fabric.device)
    for inputs, targets in batches:
        inputs, targets = fabric.to_device((inputs, targets))
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        mean_loss.update(loss, weight=targets.numel())
    model.train()
    return float(mean_loss.compute())  # compute() reduces across ranks


def main(argv: list[str] | None = None) -> None:
    """Script entry point for launchers: `train.py --config recipe.yaml [--key.sub value ...]`."""
    from {{ cookiecutter.package_name }}.cli import main as cli_main

    cli_main(["train", *(sys.argv[1:] if argv is None else argv)])


def report_stop(stopped: TrainingStopped) -> int:
    """Print why training stopped early (rank 0; every rank stops for the same reason); return its exit code."""
    if rank_zero_only.rank == 0:
        print(f"stopped: {stopped}", file=sys.stderr, flush=True)
    return stopped.exit_code


if __name__ == "__main__":
    main()
