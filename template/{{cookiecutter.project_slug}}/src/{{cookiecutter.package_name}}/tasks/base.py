"""The workload seam: what a run trains and how it is measured.

The machinery (the loop, the monitor, strategies, checkpoints, `plan`) asks a `Task` and never names
what it trains. A task is a package under tasks/ (found by its folder, tasks/__init__.py) holding its
recipe sections, its model families, its data and its optional commands.

One loss path: a task gives the pieces and the machinery composes them the same way for every strategy and
every pipeline schedule (`batch_loss`, `update_metrics_of`):
    inputs, targets = task.split_batch(batch)
    outputs = model(*inputs)                       # a pipeline: the first stage takes inputs, the last outputs
    loss = task.loss(outputs, targets)             # training; backward sees it plus the model's auxiliary loss
    task.update_metrics(outputs, targets, metrics) # validation

The model a task builds follows `TrainableModel`, checked right after `Task.build_model` (`checked_model`),
and keeps every parameter inside a submodule (none on the model itself): ZeRO-3's zero.Init partitions a
module's parameters when its constructor returns, so that its init draws the same random numbers as an
ordinary build's.

Importing this module does not import torch (recipes are checked before torch loads).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, TypeAlias, runtime_checkable

from ..data.samples import Samples
from ..errors import RecipeError
from ..recipe.schema import Recipe

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchmetrics import Metric

Inputs: TypeAlias = "torch.Tensor | tuple[torch.Tensor, ...]"  # what a model is called with: model(*inputs)


class TrainableModel(Protocol):
    """What strategies shard, checkpoint and compile: the model `Task.build_model` returns, checked right after
    (`checked_model`). A pipeline asks one more method, `pipeline_ends()` (strategies/pipeline.py).

    Optional, for a model whose forward records figures of its own (a mixture of experts' router): `init_buffers()`
    (buffers that are state, set after the parameters' init), `auxiliary_loss()` (a loss term of the forward just
    run, added to the task's loss for backward but not reported as the loss; called once after each training
    forward), `step_statistics()` (what the step's forwards recorded, one tensor the machinery sums over the ranks)
    and `end_step(summed, updated)` (after the optimizer step: its own updates and the figures to log, by name).
    """

    blocks: nn.ModuleList  # the repeated block: FSDP's unit, activation checkpointing's, torch.compile's

    def tensor_parallel_plan(self) -> dict[str, Any]:
        """{submodule path inside a block: ColwiseParallel() | RowwiseParallel()}; {} without tensor parallel."""

    def init_parameter(self, name: str, parameter: torch.Tensor) -> None:
        """Initialise one parameter in place: the machinery's one init loop (`init_parameters`) calls it for every
        parameter, in order, after a meta-device build and under ZeRO-3, and the model's constructor does too."""

    def __call__(self, *inputs: Any) -> Any: ...


@dataclass(frozen=True)
class Splits:
    """A task's training and validation samples."""

    train: Samples
    validation: Samples


@dataclass(frozen=True)
class Activations:
    """Activation bytes of one micro-batch on one device, without and with full activation checkpointing."""

    paper: float  # the published formula for the model's architecture, no recomputation
    paper_checkpointed: float  # the same with full recomputation
    held: float  # this project's model: what autograd holds for backward at the end of forward
    held_checkpointed: float  # the same with every block checkpointed
    recompute_peak: float  # one block's activations, rebuilt while backward recomputes it
    backward_transient: float  # what backward adds at its start, beside all that forward held: the loss's gradients
    output: float = 0.0  # the model's output (logits): a pipeline's last stage keeps it for the stage's backward

    @property
    def peak(self) -> float:
        """Activations at their peak without checkpointing: all that forward held, and the loss's gradients."""
        return self.held + self.backward_transient

    @property
    def checkpointed_peak(self) -> float:
        """Checkpointed activations at their peak: each block's input, and one block rebuilt or the loss's gradients."""
        return self.held_checkpointed + max(self.recompute_peak, self.backward_transient)


class ModelCost(Protocol):
    """What `plan` asks of a model's size, by formula and without torch (planner/plan.py uses nothing else).

    Sizes are per micro-batch of `micro_batch` samples; `tensor_parallel` is the number of ranks that split each layer.
    """

    @property
    def n_layer(self) -> int:
        """Repeated blocks: the unit a sharded runtime gathers."""

    def parameters(self, tensor_parallel: int = 1) -> int:
        """Parameters held by one tensor-parallel rank."""

    def layer_parameters(self, tensor_parallel: int = 1) -> int:
        """Parameters of one block on one tensor-parallel rank."""

    def tensor_parallel_problem(self, tensor_parallel: int) -> str | None:
        """What `tensor_parallel` fails to divide ("the heads"), or None when the model splits over that many ranks."""

    def describe(self) -> str:
        """The shape in one line, for plan's header."""

    def activations(
        self, micro_batch: int, precision: str, tensor_parallel: int = 1, sixteen_bit_module: bool = False
    ) -> Activations:
        """Activation bytes of one micro-batch under the run's `precision`; `sixteen_bit_module`: the blocks hold
        16-bit weights under mixed precision (fsdp2's gathered blocks), while autocast still runs the loss."""

    def layer_activations(self, micro_batch: int, precision: str) -> float:
        """Activation bytes one block holds for one micro-batch."""

    def tensor_parallel_elements(self, micro_batch: int) -> float:
        """Elements all-reduced per micro-batch by tensor parallel, times (t - 1) / t (0 when it has none)."""

    def tensor_parallel_all_reduces(self, checkpointed: bool) -> int:
        """All-reduces one block issues per micro-batch under tensor parallel: each row-parallel output in forward,
        each column-parallel layer's input gradient in backward, and what full checkpointing recomputes."""

    def hidden_elements(self, micro_batch: int) -> float:
        """Elements of one block's output for a micro-batch: what a pipeline stage sends the next."""

    def training_flops_per_sample(self) -> float:
        """Model FLOPs of one forward and backward pass of one sample."""


@dataclass(frozen=True)
class ExpertSizes:
    """A mixture of experts as `plan` weighs expert parallelism (`ExpertCost`): what it splits and what it moves."""

    layers: int  # blocks whose MLP is a mixture of experts
    experts: int  # routed experts in each: an expert-parallel degree divides them
    layer_parameters: int  # the routed experts' parameters in one such block: what expert parallel splits
    row_elements_per_sample: int  # a sample's rows to the experts (a unit's per expert it is routed to) x their width


@runtime_checkable
class ExpertCost(Protocol):
    def expert_sizes(self) -> ExpertSizes | None:
        """Optional beside `ModelCost`: the routed experts of a mixture of experts; None for a dense model."""


class Benchmarks(Protocol):
    """Downstream benchmarks a task scores its model on during training (`Task.benchmarks`)."""

    def due(self, step: int, max_steps: int) -> bool:
        """Whether they run after this optimizer step."""

    def run(self, fabric: Any, model: Any) -> dict[str, float]:
        """Their scores by name (logged as eval/<name>), on every rank alike; the model is Fabric's wrapper."""


class Task:
    """A workload behind the interface the machinery uses; subclasses implement it.

    Required: `name`, `recipe_type`, `build_model`, `datasets` and `loss`. Optional, with defaults that fit
    a batch of (inputs, targets) and a model without tensor parallel, pipeline or `plan` sizing: everything
    else (`split_batch`, `metrics` and `update_metrics` when validation measures more than the loss, the
    sizing for `plan` and MFU, `check`, its commands).

    Bound to a recipe, like a strategy: `self.recipe.model` and `self.recipe.data` are this task's
    own sections (the dataclasses of `recipe_type`).
    """

    name: ClassVar[str]  # `task:` in a recipe
    recipe_type: ClassVar[type[Recipe]]  # Recipe with this task's `model:` and `data:` sections
    unit: ClassVar[str] = "sample"  # what throughput counts, singular: "token", "image"
    commands: ClassVar[dict[str, str]] = {}  # its own commands: name -> module (HELP, add_arguments, run)
    # Packages whose versions a checkpoint records beside python, torch and lightning (those installed), so that a
    # resume after an upgrade of one says so: those that shape what it trains on and what it exports.
    key_packages: ClassVar[tuple[str, ...]] = ()

    def __init__(self, recipe: Recipe) -> None:
        self.recipe: Any = recipe

    # --- what a recipe may ask of it (no torch) -------------------------------------------------

    @classmethod
    def saved_recipe_overrides(cls, saved: dict[str, Any]) -> list[str]:
        """Overrides applied to a checkpoint's saved recipe (`saved`: its YAML) when it is read back: fields naming
        what may be gone since."""
        return []

    def check(self) -> None:
        """Refuse model and data settings that cannot run (raise RecipeError naming the field)."""

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        """Recipe fields that tensor parallel must divide ({"model.n_head": 8}); {} when it has no plan (refused)."""
        return {}

    def expert_parallel_dimensions(self) -> dict[str, int]:
        """Those expert parallel must divide ({"model.moe.num_experts": 8}); {} when it has no experts (refused)."""
        return {}

    def adapters(self) -> str | None:
        """The recipe field that trains adapters on a frozen model (`lora.rank=8`), or None when every parameter
        trains (strategies that cannot train a partly frozen model refuse it)."""
        return None

    def checkpointed_parameters(self) -> int | None:
        """Parameters a checkpoint holds (each with its optimizer state) when fewer than the model's (adapters on a
        frozen base), by formula without torch; None: all of them."""
        return None

    def units_per_sample(self) -> int:
        """Units (`unit`) in one sample: tokens in a sequence, 1 for an image."""
        return 1

    def model_cost(self) -> ModelCost | None:
        """The model's size formulas for `plan`; None when the task has none (plan then measures a rehearsed step)."""
        return None

    def trained_parameters(self) -> int | None:
        """How many parameters train when only some do (adapters on a frozen base), by formula for `plan`; None: all."""
        return None

    def describe(self) -> str | None:
        """One line on the recipe's data for `recipes validate` (checking what is cheap to check), or None."""
        return None

    @classmethod
    def verify_prepared(cls, folder: Path | str) -> str:
        """Check every byte of a folder (a URL: a string) this task's `prepare` wrote against its manifest (`data
        verify`, with progress); one line on what it holds. Raise RecipeError naming the first file that differs."""
        raise RecipeError(f"task {cls.name} has no prepared folders to verify")

    def reference_model(self, parameters: float) -> dict[str, Any] | None:
        """Recipe fields, dotted (`model.n_layer`; `data.*` where the data must fit that model), of a reference shape
        with about `parameters` parameters (`plan --parameters`), or None."""
        return None

    def pipeline_blocks(self) -> int:
        """The number of blocks a pipeline splits into stages; RecipeError when the model cannot be split."""
        raise RecipeError(f"task {self.name} has no pipeline split (set strategy.fsdp2.pipeline_parallel_size=1)")

    def resumable_model_changes(self) -> frozenset[str]:
        """model: fields a checkpoint may be resumed with changed (the rest must match the checkpoint)."""
        return frozenset()

    # --- what it does in a training process -----------------------------------------------------

    def build_model(self) -> nn.Module:
        """The model, on the current default device (the meta device when the strategy asks); a `TrainableModel`."""
        raise NotImplementedError

    def block_class(self) -> type[nn.Module]:
        """The class of the model's repeated block (FSDP1's wrap policy names it), read off a meta-device build."""
        import torch

        with torch.device("meta"):
            blocks: Any = self.build_model().blocks
        return type(blocks[0])

    def pretrained_from(self) -> str | None:
        """Where the weights a fresh run starts from come from (a folder, a hub name), or None for a random init."""
        return None

    def pretrained_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(parameter name, tensor) of those weights, one at a time (called only when `pretrained_from` names some)."""
        raise NotImplementedError

    def frozen_from_pretrained(self) -> bool:
        """Whether the model's frozen parameters (a base under adapters) come from `pretrained_tensors` at every
        start, resumed or not: its checkpoints then hold only the parameters that train, and their optimizer state."""
        return False

    def datasets(self) -> Splits:
        """The training and validation samples the recipe's data section describes."""
        raise NotImplementedError

    def example_batch(self, micro_batch_size: int) -> Any:
        """A micro-batch of the shapes and dtypes training sees, made without the data (`rehearse` runs a step on it
        under fake tensors); by default the first samples of the training split."""
        train = self.datasets().train
        return train.batch(list(range(min(micro_batch_size, len(train)))))

    def split_batch(self, batch: Any) -> tuple[Inputs, Any]:
        """(the model's inputs, the targets `loss` compares its outputs with) of a micro-batch. Inputs are a tensor or
        a tuple of tensors passed positionally (`model(*inputs)`); a pipeline hands them to its first stage and the
        targets to its last. Default: a batch that is the pair (inputs, targets)."""
        inputs, targets = batch
        return inputs, targets

    def loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The mean training loss of the model's outputs for a micro-batch (or a pipeline's piece of one): a scalar."""
        raise NotImplementedError

    def metrics(self) -> dict[str, Metric]:
        """Fresh torchmetrics for one validation pass, by name (logged as val/<name>; reduced across ranks).
        Default: the loss, averaged over samples."""
        from torchmetrics.aggregation import MeanMetric

        return {"loss": MeanMetric()}

    def update_metrics(self, outputs: Any, targets: Any, metrics: dict[str, Metric]) -> None:
        """Update the validation metrics with the outputs and targets of a micro-batch or a pipeline's piece (under
        torch.no_grad, in eval mode). Default: the loss, weighted by the targets' first dimension (samples)."""
        metrics["loss"].update(self.loss(outputs, targets), weight=targets.shape[0])

    def validation_results(self, computed: dict[str, float]) -> dict[str, float]:
        """The figures logged after a validation pass, from the computed metrics (add derived ones here)."""
        return computed

    def benchmarks(self) -> Benchmarks | None:
        """Downstream benchmarks the recipe asks for, loaded (or refused in one line) before the first step; or None."""
        return None

    def flops_per_unit(self) -> float | None:
        """Model FLOPs of one forward and backward pass per unit (MFU); None when unknown."""
        return None


def contract_problems(model: Any) -> list[str]:
    """What `model` lacks of the `TrainableModel` contract, one phrase each ([] when it has it all)."""
    from torch import nn

    problems = []
    if not isinstance(getattr(model, "blocks", None), nn.ModuleList):
        problems.append("no `blocks` nn.ModuleList (the repeated block strategies shard, checkpoint and compile)")
    for method, signature in (("tensor_parallel_plan", "()"), ("init_parameter", "(name, parameter)")):
        if not callable(getattr(model, method, None)):
            problems.append(f"no `{method}{signature}` method")
    if own := [name for name, _ in model.named_parameters(recurse=False)]:
        problems.append(f"parameter {own[0]!r} on the model itself (keep parameters in submodules: ZeRO-3's init)")
    return problems


def checked_model(task: Task) -> nn.Module:
    """`task.build_model()`, refused in one line when the model lacks part of the contract the machinery uses."""
    model = task.build_model()
    if problems := contract_problems(model):
        raise RecipeError(f"task {task.name}: its model ({type(model).__name__}) has {problems[0]} (tasks/base.py)")
    return model


def init_parameters(model: Any) -> None:
    """The one init loop: the model's `init_parameter` for every parameter, in order (a tied parameter once), then
    its `init_buffers()` when it has buffers that are state."""
    for name, parameter in model.named_parameters():
        model.init_parameter(name, parameter)
    if callable(init_buffers := getattr(model, "init_buffers", None)):
        init_buffers()


def own_model(model: Any) -> Any:
    """The task's model inside a strategy's wrappers (Fabric's module wrapper keeps it as `module`)."""
    return getattr(model, "module", model)


def run_model(model: Any, inputs: Inputs) -> Any:
    """The model's outputs for `split_batch`'s inputs: a tuple is passed positionally."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


class BatchLoss(NamedTuple):
    """A micro-batch's loss: what backward sees, and the task's own part of it (what is reported as the loss)."""

    objective: torch.Tensor  # the task's loss plus the model's auxiliary loss, when it has one
    task_loss: torch.Tensor  # train/loss: it compares with val/loss and with a model without the auxiliary term


def batch_loss(task: Task, model: Any, batch: Any) -> BatchLoss:
    """The loss of a micro-batch as every strategy composes it: split, forward, the task's loss, plus the model's
    auxiliary loss when it has one (the model logs that term itself: `end_model_step`)."""
    inputs, targets = task.split_batch(batch)
    loss = task.loss(run_model(model, inputs), targets)
    auxiliary = getattr(own_model(model), "auxiliary_loss", None)
    term = auxiliary() if callable(auxiliary) else None
    return BatchLoss(loss if term is None else loss + term, loss)


def end_model_step(
    model: Any, updated: bool, sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]
) -> dict[str, torch.Tensor]:
    """After an optimizer step (`updated`: it was applied, not skipped), on every rank: the model's step statistics
    summed over the ranks, handed back to it for its own updates; the figures it logs by name ({} when it records
    none)."""
    own = own_model(model)
    statistics = getattr(own, "step_statistics", None)
    summed = statistics() if callable(statistics) else None
    return {} if summed is None else own.end_step(sum_over_ranks(summed), updated)


def update_metrics_of(task: Task, model: Any, batch: Any, metrics: dict[str, Metric]) -> None:
    """One validation micro-batch as every strategy composes it: split, forward, the task's metrics update."""
    inputs, targets = task.split_batch(batch)
    task.update_metrics(run_model(model, inputs), targets, metrics)
