"""What the machinery needs of a task, checked on one process without training (`<project> check RECIPE`).

It builds the recipe's model on the meta device (any size), then, where the model is small enough to hold
here, on the CPU: draws one micro-batch, composes the loss and a validation step the way every strategy does
(tasks/base.py: split_batch, the model, loss, update_metrics), and names in one line each what it does not find.

The validation rule it checks: each validation pass reads `eval.batches` micro-batches of `micro_batch_size`
on each of the data-parallel ranks; when `eval.batches x micro_batch_size x data-parallel ranks` exceeds the
validation split, the ranks wrap around it and count some samples twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..recipe.schema import Recipe
from ..strategies import strategy_for
from ..tasks import Task, task_for
from ..tasks.base import contract_problems, run_model

# The model is also built on the CPU, and the loss and a validation step run on it, up to this many parameters
# (fp32: 0.8 GB); above, only the meta-device checks run.
CPU_PARAMETERS = 200_000_000

Check = tuple[str, str | None]  # (what was checked, the problem found or None)


def task_checks(recipe: Recipe, cpu_parameters: int = CPU_PARAMETERS) -> Iterator[Check]:
    """Each check of the recipe's task, in order, with the problem it found (None: fine)."""
    task, strategy = task_for(recipe), strategy_for(recipe)
    with torch.device("meta"):
        model = task.build_model()
    problems = contract_problems(model)
    yield "the model follows the contract (blocks, tensor_parallel_plan, init_parameter)", "; ".join(problems) or None
    if problems:
        return
    yield from layout_checks(
        model, getattr(strategy, "tensor_parallel_size", 1), getattr(strategy, "pipeline_parallel_size", 1)
    )
    splits = task.datasets()
    yield from validation_size_checks(recipe, len(splits.validation), strategy.data_parallel_size())
    parameters = sum(p.numel() for p in model.parameters())
    if parameters > cpu_parameters:
        yield f"the loss and a validation step on the CPU (skipped: {parameters:,} parameters)", None
        return
    torch.manual_seed(recipe.train.seed)
    model = task.build_model()
    size = min(recipe.train.micro_batch_size, len(splits.train))
    yield from step_checks(task, model, splits.train.batch(list(range(size))))


def layout_checks(model: Any, tensor_parallel: int, pipeline_parallel: int) -> Iterator[Check]:
    """The parts of the contract the recipe's layout uses: a tensor-parallel plan that names modules of a block, a
    pipeline's ends."""
    if tensor_parallel > 1:
        plan, block = model.tensor_parallel_plan(), model.blocks[0]
        missing = [path for path in plan if not _has_module(block, path)]
        problem = (
            "tensor_parallel_plan() is empty"
            if not plan
            else f"tensor_parallel_plan() names {missing[0]!r}, which a block does not have"
            if missing
            else None
        )
        yield f"tensor parallel over {tensor_parallel}: the plan names modules of a block", problem
    if pipeline_parallel > 1:
        ends = getattr(model, "pipeline_ends", None)
        problem = (
            None if callable(ends) else "the model has no pipeline_ends() (the modules before and after its blocks)"
        )
        yield f"pipeline over {pipeline_parallel} stages: the model names its ends", problem


def validation_size_checks(recipe: Recipe, validation_samples: int, data_parallel: int) -> Iterator[Check]:
    """Validation reads each sample at most once: eval.batches x micro_batch_size x data-parallel ranks fit the split."""
    if not recipe.eval.every_steps:
        return
    read = recipe.eval.batches * recipe.train.micro_batch_size * data_parallel
    problem = None
    if read > validation_samples:
        fitting = max(0, validation_samples // (recipe.train.micro_batch_size * data_parallel))
        problem = (
            f"eval.batches={recipe.eval.batches} x train.micro_batch_size={recipe.train.micro_batch_size} x"
            f" {data_parallel} data-parallel rank(s) = {read} samples, but the validation split holds"
            f" {validation_samples}: some are counted twice (choose eval.batches <= {fitting})"
        )
    yield f"validation reads each of its {validation_samples} samples at most once", problem


def step_checks(task: Task, model: Any, batch: Any) -> Iterator[Check]:
    """One micro-batch through the pieces every strategy composes: split_batch, forward, loss and backward,
    then a validation step (no_grad, eval mode) and the metrics' values."""
    split = task.split_batch(batch)
    shape_problem = _split_problem(split)
    yield "split_batch returns (inputs, targets)", shape_problem
    if shape_problem:
        return
    inputs, targets = split
    outputs = run_model(model, inputs)
    view = isinstance(outputs, torch.Tensor) and outputs._is_view()
    yield (
        "the model's forward returns a tensor of its own",
        "forward returns a view of another tensor (.squeeze(), .view(), indexing): FSDP2 warns at every step;"
        " reshape in `loss` instead, or return .clone()"
        if view
        else None,
    )
    yield from _attempt(
        "loss is a finite scalar that backward runs through", lambda: _loss_problem(task, outputs, targets)
    )
    yield from _attempt(
        "a validation step updates every metric", lambda: _validation_problem(task, model, inputs, targets)
    )


def _attempt(what: str, check: Callable[[], str | None]) -> Iterator[Check]:
    try:
        problem = check()
    except Exception as error:  # the task's own code failed: that is the finding, named in one line
        problem = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    yield what, problem


def _split_problem(split: Any) -> str | None:
    if not (isinstance(split, tuple) and len(split) == 2):
        return f"split_batch returned {type(split).__name__}, not the pair (inputs, targets)"
    inputs = split[0]
    tensors = inputs if isinstance(inputs, tuple) else (inputs,)
    if not all(isinstance(part, torch.Tensor) for part in tensors):
        return "split_batch's inputs are not a tensor or a tuple of tensors (what a pipeline's first stage takes)"
    return None


def _loss_problem(task: Task, outputs: Any, targets: Any) -> str | None:
    loss = task.loss(outputs, targets)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        return f"loss returned {tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__}, not a scalar"
    if not loss.requires_grad:
        return "loss does not depend on the model's parameters (no gradient flows back)"
    if not math.isfinite(loss.item()):
        return f"loss is {loss.item()} on the first micro-batch"
    loss.backward()
    return None


def _validation_problem(task: Task, model: Any, inputs: Any, targets: Any) -> str | None:
    metrics = task.metrics()
    model.eval()
    with torch.no_grad():
        task.update_metrics(run_model(model, inputs), targets, metrics)
    values = {name: float(metric.compute()) for name, metric in metrics.items()}
    model.train()
    if not values:
        return "metrics() returned no metric"
    if bad := [name for name, value in values.items() if not math.isfinite(value)]:
        return f"metric {bad[0]!r} is {values[bad[0]]} after one validation step"
    return None


def _has_module(block: Any, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True
