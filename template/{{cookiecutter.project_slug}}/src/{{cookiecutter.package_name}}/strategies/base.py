"""The one interface every strategy family implements, and the defaults most of them share.

A `TrainingStrategy` is asked everything that differs between strategies: which recipes it accepts
(`check`, `gpu_requirement`), which Fabric strategy object it is, how the model is built and set up
with its optimizer, how a micro-batch skips gradient sync, how a step clips and steps, what a skipped
update must drop, how ranks map to data-parallel replicas, how its checkpoints are laid out, and what
`plan` needs to know about what it shards. The loop, checkpoints, plan and the command line ask it;
none of them knows a strategy by name.

Importing this package does not import torch (the command line checks recipes before loading torch):
torch and Lightning are imported inside the methods that run in a training process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any, ClassVar

from ..planner.options import PlanOption, PlanSizes, PlanTerm, RankStep
from ..recipe.schema import Recipe
from ..tasks import Task, task_for
from ..tasks.base import batch_loss, checked_model, update_metrics_of

if TYPE_CHECKING:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import Strategy
    from torch import nn

MakeOptimizer = Callable[["nn.Module"], "torch.optim.Optimizer"]


@dataclass(frozen=True)
class GpuRequirement:
    """Why a recipe can only run on GPUs: the field that asks for it and what it needs."""

    field: str  # "strategy.name=deepspeed"
    needs: str  # "CUDA GPUs"
    why: str  # "Fabric runs strategy deepspeed only on GPUs"
    remedy: str  # "choose ddp, fsdp2 or hsdp"
    capability: tuple[int, int] | None = None  # minimum CUDA compute capability
    package: str | None = None  # a module that must be importable on the GPU machine
    extra: str | None = None  # the project's extra that installs it (pip install -e '.[extra]')


class TrainingStrategy:
    """A strategy family behind the interface the loop uses; subclasses override what differs."""

    name: ClassVar[str]  # strategy.name in a recipe
    options_key: ClassVar[str | None] = None  # the strategy.<section> of this family's options
    options_type: ClassVar[type | None] = None
    checkpoint_layout: ClassVar[str] = "replicated"  # replicated | sharded (torch.distributed.checkpoint) | own
    supports_meta_init: ClassVar[bool] = False
    # Trains a model whose parameters are mostly frozen (adapters): the optimizer holds the trained ones only
    # (training/optim.py), frozen ones are replicated or sharded beside them, checkpoints keep the trained ones.
    trains_adapters: ClassVar[bool] = False
    not_rehearsed: ClassVar[str] = ""  # why `rehearse` cannot build it on the CPU's fake tensors, if it cannot

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.config = recipe.strategy

    @cached_property
    def task(self) -> Task:
        """What the recipe trains: it builds the model (and its blocks) that this strategy shards or replicates."""
        return task_for(self.recipe)

    @property
    def options(self) -> Any:
        """This family's options section (its defaults where the recipe has none)."""
        if self.options_key is None or self.options_type is None:
            return None
        return getattr(self.config, self.options_key) or self.options_type()

    # --- what a recipe may ask of it (no torch) -------------------------------------------------

    def check(self) -> None:
        """Refuse settings this family cannot run (raise RecipeError naming the field); rules of every
        strategy (options sections, meta_init, hardware) are in recipe/checks.py."""

    def gpu_requirement(self) -> GpuRequirement | None:
        """What of this recipe needs GPUs, or None when it runs on CPU too."""
        return None

    def data_parallel_size(self) -> int:
        """Replicas that each see their own batches (tensor-parallel peers share one)."""
        return self.recipe.world_size

    def plan_options(self) -> list[PlanOption]:
        """The ways of holding the training state that `plan` compares for this family."""
        return []

    def rehearsal_problem(self) -> str | None:
        """Why `rehearse` cannot build this recipe's run on fake tensors (one line naming the field), or None."""
        return f"strategy.name={self.name}: not rehearsed: {self.not_rehearsed}" if self.not_rehearsed else None

    def recipe_plan_option(self) -> PlanOption | None:
        """The plan option that is this recipe's own layout (what `rehearse` compares with); None: plan has none."""
        options = self.plan_options()
        return options[0] if options else None

    def plan_runtime_terms(self, option: PlanOption, sizes: PlanSizes) -> list[PlanTerm]:
        """What this runtime holds per device beyond the paper's model states (buffers, extra copies)."""
        return []

    def plan_collectives(self, option: PlanOption, sizes: PlanSizes, step: RankStep) -> dict[str, int] | None:
        """The collectives of one rank's optimizer step (`step`) as plan's communication model counts them, by name
        (planner/collectives.py; `rehearse` counts the same names), but for the step decision's and those of the
        task's layers (tensor parallel, experts, context); None: the model gives no count. `sizes`: the
        data-parallel ranks and the trained share (adapters in the blocks leave the modules outside them frozen)."""
        return None

    def plan_section(self, option: PlanOption, base: dict[str, Any]) -> dict[str, Any]:
        """The keys of a recipe's `strategy:` section that select `option` (`base`: the library recipe's section)."""
        return {"name": self.name}

    def describe(self) -> str:
        """The strategy in a few words, for `recipes validate`."""
        return f"strategy {self.name}"

    # --- what it does in a training process -----------------------------------------------------

    def fabric_strategy(self) -> Strategy:
        """The Fabric strategy object."""
        raise NotImplementedError

    def build_model(self, fabric: Fabric, pretrained: bool = False) -> nn.Module:
        """The model, built on every rank from the same seed (the strategy shards or replicates it in `setup`).

        `pretrained`: the run starts from model.init_from's weights; most strategies load them after
        `setup` (`load_pretrained`), a strategy whose setup copies the weights (DeepSpeed) loads them here.
        """
        with fabric.init_module(empty_init=self.config.meta_init):
            return checked_model(self.task)

    def load_pretrained(self, fabric: Fabric, model: Any) -> None:
        """Copy the task's pretrained weights (model.init_from) into the set-up (sharded or replicated) model.

        Rank 0 reads the weights into host memory and torch.distributed.checkpoint broadcasts them,
        each rank keeping its own shards (FSDP2, tensor parallel), its stages (pipeline parallel) or the whole
        (ddp). Under adapters the weights are the frozen base's: the adapters, which train, keep their own init.
        """
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.nn import Parameter

        module = model.module  # without Fabric's wrapper
        current = module.state_dict(keep_vars=True)
        frozen = {name for name, value in current.items() if isinstance(value, Parameter) and not value.requires_grad}
        weights: dict[str, Any] = {}
        if fabric.global_rank == 0:
            tensors = self.task.pretrained_tensors()
            weights = {
                name: value.to(current[name].dtype if name in current else value.dtype) for name, value in tensors
            }
        # Every rank checks its own part of the model (all of it, or its frozen part) against the names rank 0 read:
        # under pipeline parallel a rank holds only its stages, and the weights broadcast to it name the others' too.
        names: list[Any] = [sorted(weights)]
        if dist.is_initialized():
            dist.broadcast_object_list(names, src=0)
        if missing := sorted((frozen or current.keys()) - set(names[0])):
            raise RuntimeError(
                f"the pretrained weights have no {missing[0]}, a {'frozen ' if frozen else ''}tensor of the model"
            )
        if not dist.is_initialized():
            module.load_state_dict(weights, strict=not frozen)
            return
        # Not strict: what is missing was refused above; what this rank does not hold (other stages) is left out.
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        set_model_state_dict(module, weights, options=options)

    def setup(self, fabric: Fabric, model: nn.Module, make_optimizer: MakeOptimizer) -> tuple[Any, Any, Any]:
        """(model, optimizer, the torch optimizer an LR scheduler drives), set up for this strategy."""
        prepare_blocks(model, self.config)
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model))
        return model, optimizer, optimizer

    @contextmanager
    def no_backward_sync(self, fabric: Fabric, model: Any, enabled: bool) -> Iterator[None]:
        """Skip the gradient reduction of a micro-batch that is not the last of its step."""
        with fabric.no_backward_sync(model, enabled=enabled):
            yield

    def forward_backward(
        self,
        fabric: Fabric,
        model: Any,
        batch: Any,
        accumulate: int,
        adjust_loss: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Forward and backward of one of a step's `accumulate` micro-batches (its loss with the model's auxiliary
        loss, `adjust_loss`-ed, divided by `accumulate`); the task's loss, detached. A pipeline runs both through its schedule (fsdp2's pipeline options)."""
        objective, loss = batch_loss(self.task, model, batch)
        fabric.backward(adjust_loss(objective) / accumulate)
        return adjust_loss(loss).detach()

    def validation_step(self, fabric: Fabric, model: Any, batch: Any, metrics: dict[str, Any]) -> None:
        """Update the task's validation metrics with one micro-batch (under torch.no_grad, the model in eval mode).
        A pipeline runs the forward through its schedule and only its last stage updates them."""
        update_metrics_of(self.task, model, batch, metrics)

    def clip_and_step(self, fabric: Fabric, model: Any, optimizer: Any, max_norm: float) -> torch.Tensor | None:
        """Clip the global gradient norm to `max_norm` (0: no clipping), step; return the norm before clipping."""
        grad_norm = self.clip(fabric, model, optimizer, max_norm)
        optimizer.step()
        return grad_norm

    def clip(self, fabric: Fabric, model: Any, optimizer: Any, max_norm: float) -> torch.Tensor | None:
        """Clip the global gradient norm to `max_norm` (0: no clipping); the norm before clipping."""
        # error_if_nonfinite would read the norm on the host: a second sync per step. A non-finite
        # gradient comes from a non-finite loss, which step_decision.decide has already caught.
        if max_norm <= 0:
            return None
        return fabric.clip_gradients(model, optimizer, max_norm=max_norm, error_if_nonfinite=False)

    def discard_gradients(self, fabric: Fabric) -> None:
        """Drop what a skipped update leaves behind besides the gradients `zero_grad` clears (usually nothing)."""

    def data_parallel_rank_and_size(self, fabric: Fabric) -> tuple[int, int]:
        """This process's data-parallel rank and their number; tensor-parallel peers share a rank and a batch."""
        sampler = getattr(fabric.strategy, "distributed_sampler_kwargs", None) or {}
        return sampler.get("rank", fabric.global_rank), sampler.get("num_replicas", fabric.world_size)


def prepare_blocks(model: Any, config: Any) -> Any:
    """Activation checkpointing (every k-th block, full or selective) and torch.compile per block, in place.

    `model.blocks` is the repeated block every task's model exposes (tasks/base.py): the unit that is
    sharded, checkpointed and compiled.
    """
    from .checkpointing import checkpoint_block

    for index, block in enumerate(model.blocks):
        if config.activation_checkpointing and index % config.activation_checkpointing_every == 0:
            block = checkpoint_block(block, config.activation_checkpointing_policy)
        if config.compile:
            block.compile()  # in place: parameter names, and so checkpoints, stay the same
        model.blocks[index] = block
    return model


def one_device_strategy() -> Strategy:
    """Fabric's SingleDeviceStrategy, for a run of one process: nothing to replicate, so no wrapper around
    the model, no process group and no gradient all_reduce (a DDP wrapper on one device costs time each
    step and splits a compiled graph at its buckets). Its checkpoints are DDP's: one file, the same keys.
    """
    import torch
    from lightning.fabric.accelerators import CUDAAccelerator
    from lightning.fabric.strategies import SingleDeviceStrategy

    class OneDevice(SingleDeviceStrategy):
        """On cuda:0 or the CPU, whichever accelerator Fabric chose for the recipe."""

        @property
        def root_device(self) -> torch.device:
            return torch.device("cuda", 0) if isinstance(self.accelerator, CUDAAccelerator) else torch.device("cpu")

    return OneDevice()


def gpu_only(name: str, package: str | None = None) -> GpuRequirement:
    """What a strategy that Fabric runs only on CUDA GPUs requires."""
    return GpuRequirement(
        field=f"strategy.name={name}",
        needs="CUDA GPUs",
        why=f"Fabric runs strategy {name} only on GPUs",
        remedy="choose ddp, fsdp2 or hsdp",
        package=package,
        extra=package,
    )


def process_group_options(recipe: Recipe) -> dict[str, Any]:
    """The collective backend and timeout every Fabric strategy takes."""
    from datetime import timedelta

    return {
        "process_group_backend": recipe.strategy.process_group_backend,
        "timeout": timedelta(minutes=recipe.strategy.timeout_minutes),
    }


def divisors(number: int) -> str:
    """'1, 2, 4 or 8': the values that divide `number`, for error messages."""
    values = [str(d) for d in range(1, number + 1) if number % d == 0]
    return values[0] if len(values) == 1 else f"{', '.join(values[:-1])} or {values[-1]}"
