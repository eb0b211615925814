"""The training loop: one loop for every recipe, from a laptop CPU to many GPU nodes.

Run it through the CLI (`<project> train --config recipes/cpu-debug.yaml`) or as a script under a
launcher (`fabric run ... src/<package>/train.py --config mine.yaml`, `torchrun ...`, `srun ...`).
`run.setup` builds what the loop trains. The loop does not know what that is: the strategy (strategies/)
composes the task's pieces (tasks/base.py: split_batch, the model, loss, update_metrics) in forward_backward and
validation_step, the same way for every strategy (a pipeline runs them through its schedule), and differs at
no_backward_sync, clip_and_step and discard_gradients.
"""

from __future__ import annotations

import sys
import time
import warnings
from functools import partial
from typing import cast

import torch
from lightning.fabric import Fabric

from ..checkpoint.io import Checkpointer
from ..checkpoint.layout import checkpoint_root
from ..cluster.lifecycle import end_with_launcher
from ..cluster.preemption import Preemption
from ..data.sampler import Batch
from ..errors import RecipeError, TrainingStopped, refuse_dashed_options, run_command
from ..planner.interval import young_interval
from ..recipe.load import parse_recipe
from ..recipe.schema import Recipe
from ..strategies import TrainingStrategy
from ..tasks import Task
from ..tasks.base import end_model_step
from .faults import fault_point, poison_loss
from .fingerprint import Fingerprints
from .loggers import finish_loggers, log_config, logger_location, upload_final_weights
from .monitor import Monitor
from .profiling import StepProfiler
from .run import setup
from .step_decision import Update, decide, nonfinite_loss_stop


def train(recipe: Recipe, preemption: Preemption | None = None) -> None:
    """Train the model the recipe describes; resumes when the recipe says so.

    `preemption`: the stop-signal catcher, when the caller installed it earlier (a job's entry point); else one from
    here on, handed back when the run ends.
    """
    # SIGUSR1/SIGUSR2/SIGTERM: save at the next step boundary, requeue, exit. Caught before the set-up, so that
    # a signal during it (loading a checkpoint can take minutes) stops the run at its first step.
    if preemption is None:
        with Preemption() as own:
            return train(recipe, own)
    preemption.deadline_seconds = recipe.checkpoint.stop_deadline_seconds
    run = setup(recipe)  # refuses a bad recipe, path or checkpoint before any process starts
    fabric, task, strategy, model, optimizer = run.fabric, run.task, run.strategy, run.model, run.optimizer
    state = run.state
    log_config(fabric.loggers, recipe, run.provenance)

    max_steps, accumulate = recipe.train.max_steps, recipe.train.grad_accum_steps
    units_per_sample = task.units_per_sample()  # tokens, images, ...: what throughput counts
    units_per_step = run.batches.global_batch_size * units_per_sample
    monitor = Monitor(
        fabric,
        recipe,
        state["step"],
        run.batches.global_batch_size,
        task.unit,
        units_per_sample,
        task.flops_per_unit(),
        startup=run.startup,
    )
    checkpointer = Checkpointer(fabric, recipe, run.provenance, interval_rule=young_interval)
    profiler = StepProfiler(fabric, recipe)  # only in the steps of profile.steps
    fingerprints = Fingerprints(fabric, recipe.out_dir, state["step"]) if recipe.logger.fingerprint else None
    decision = None
    watchdog = preemption.watch_for_hangs(recipe.checkpoint.hang_timeout_minutes, fabric.global_rank)
    model.train()

    def sum_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, fabric.all_reduce(tensor, reduce_op="sum"))

    while state["step"] < max_steps:
        profiler.step_begins(state["step"] + 1)
        loss_sum = torch.zeros((), device=fabric.device)
        poison = partial(poison_loss, step=state["step"] + 1)
        watchdog.beat(state["step"] + 1, "data")  # the hang watchdog times each phase from its heartbeat
        for micro_step, batch in enumerate(monitor.timed(run.batches.iter_step())):
            watchdog.beat(state["step"] + 1, "forward-backward")
            batch = fabric.to_device(batch)
            # Gradients are synchronised only on the last micro-batch of the step.
            with strategy.no_backward_sync(fabric, model, enabled=micro_step < accumulate - 1):
                # The task's loss (poisoned only under TRAIN_FAULT=nan-at-step), backpropagated over `accumulate`.
                loss = strategy.forward_backward(fabric, model, batch, accumulate, poison)
            loss_sum += loss
            watchdog.beat(state["step"] + 1, "data")
        # One all_reduce for what every rank decides together: a NaN/inf loss on some rank (every rank skips
        # this update, or the run stops, as the recipe says), a stop signal, a time-based checkpoint.
        fault_point("before-sync", state["step"] + 1)  # only under TRAIN_FAULT (tests)
        watchdog.beat(state["step"] + 1, "step-decision")
        with monitor.rank_times.waiting_for_ranks():  # the rank that waits least here holds the others back
            decision = decide(
                fabric, loss_sum, recipe.train.on_nonfinite_loss, preemption.received, checkpointer.time_is_up()
            )
        if decision.update is Update.STOP:
            break
        if decision.preempted:
            preemption.reached_boundary()  # the save below is not cut short by the stop deadline
        watchdog.beat(state["step"] + 1, "optimizer")
        grad_norm = None
        if decision.update is Update.APPLY:
            grad_norm = strategy.clip_and_step(fabric, model, optimizer, max_norm=recipe.train.grad_clip)
        else:  # skip: this step's gradients are dropped (zero_grad below, and what the strategy keeps besides)
            strategy.discard_gradients(fabric)
            state["skipped_updates"] += 1
            monitor.log_skipped_update(state["step"] + 1, state["skipped_updates"])
        # What the model recorded in the step (a router's loads), summed over the ranks: its own update (every rank
        # alike, so the model stays identical on all) and its figures. The world is the data-parallel group here:
        # a model with step statistics runs without tensor or pipeline parallel.
        updated = decision.update is Update.APPLY
        model_figures = end_model_step(model, updated, sum_over_ranks)
        run.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] += 1
        state["units_seen"] += units_per_step
        step = state["step"]
        learning_rate = float(run.scheduler.get_last_lr()[0])
        if fingerprints is not None:  # logger.fingerprint: this step's loss, gradient norm and parameter hash
            fingerprints.record(step, loss_sum / accumulate, grad_norm, model)
        monitor.step_end(
            step, loss_sum / accumulate, grad_norm, learning_rate, state["units_seen"], run.batches.epoch, model_figures
        )
        monitor.exclude(seconds=profiler.step_ends(step))  # writing a trace is not training time

        every_eval = recipe.eval.every_steps
        if every_eval and (step % every_eval == 0 or step == max_steps):
            watchdog.beat(step, "validation")
            started = time.perf_counter()
            results = validate(fabric, task, strategy, model, run.val_batches)
            monitor.log_validation(step, results, seconds=time.perf_counter() - started)
        if run.benchmarks is not None and run.benchmarks.due(step, max_steps):  # eval.tasks: every rank runs them
            watchdog.beat(step, "eval-benchmarks")
            started = time.perf_counter()
            scores = run.benchmarks.run(fabric, model)
            monitor.log_validation(step, scores, seconds=time.perf_counter() - started, prefix="eval")
        watchdog.beat(step, "checkpoint-save")
        checkpointer.poll()
        if checkpointer.due(step, decision.save_due) or decision.preempted:
            seconds = checkpointer.save(state)
            monitor.log_checkpoint(step, checkpointer.root / f"step-{step:08d}", seconds, checkpointer.chosen)
        fault_point("step-end", step, recipe.out_dir)  # only under TRAIN_FAULT (tests)
        if decision.preempted:
            break
    watchdog.stop_watching()  # what follows (the last async save, an upload) takes as long as it takes

    checkpointer.wait()
    monitor.close()
    profiler.log_traces(fabric.loggers)
    stopped_early = decision is not None and (decision.update is Update.STOP or decision.preempted)
    fabric.print(
        f"{'Stopped' if stopped_early else 'Done'} at step {state['step']}. Checkpoints: {checkpoint_root(recipe)}"
    )
    if fabric.global_rank == 0:
        fabric.print(f"Logs: {logger_location(recipe, fabric.loggers)}")
        if recipe.logger.upload_final_weights and not stopped_early:
            upload_final_weights(fabric.loggers, checkpoint_root(recipe))
    finish_loggers(fabric.loggers)
    if decision is not None and decision.update is Update.STOP:
        raise nonfinite_loss_stop(state["step"] + 1, report=fabric.global_rank == 0)
    if decision is not None and decision.preempted:
        raise preemption.requeue(state["step"], decision.stop_signal, fabric.global_rank)


def train_to_the_end(recipe: Recipe, preemption: Preemption) -> None:
    """`train`, where a collective broken by a stop (a peer rank that ended at the stop deadline, or by its hang
    watchdog) ends this rank the same way, exit 75, instead of with a traceback."""
    try:
        train(recipe, preemption)
    except (RecipeError, TrainingStopped):  # refusals and planned stops (a preemption's save among them)
        raise
    except Exception as error:
        stop = preemption.explains_failure()
        if stop is None:
            raise
        preemption.stop_now(f"{stop}, then {type(error).__name__} (a rank stopped)")
    finally:
        preemption.stop_watching()  # a run that failed in this process must not be ended as hung later


@torch.no_grad()
def validate(
    fabric: Fabric, task: Task, strategy: TrainingStrategy, model: torch.nn.Module, batches: list[Batch]
) -> dict[str, float]:
    """The task's validation metrics over all ranks' batches (val/loss, and what else the task measures)."""
    model.eval()
    metrics = {name: metric.to(fabric.device) for name, metric in task.metrics().items()}
    for batch in batches:
        strategy.validation_step(fabric, model, fabric.to_device(batch), metrics)
    model.train()
    with warnings.catch_warnings():
        # Under pipeline parallel only the last stage's ranks update the metrics; the others' zero sums are summed in.
        warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric", category=UserWarning)
        computed = {name: float(metric.compute()) for name, metric in metrics.items()}  # reduced over all ranks
    return task.validation_results(computed)


def main(argv: list[str] | None = None) -> None:
    """Script entry point for launchers: `train.py --config recipe.yaml [--key.sub value ...]`."""
    end_with_launcher()  # a rank started by another rank dies with it
    arguments = sys.argv[1:] if argv is None else argv
    with Preemption() as preemption:  # before anything else: a stop signal during start-up is a preemption

        def parse_and_train() -> None:
            refuse_dashed_options(arguments)
            train_to_the_end(parse_recipe(arguments, "train.py"), preemption)

        run_command(parse_and_train)


if __name__ == "__main__":
    main()
