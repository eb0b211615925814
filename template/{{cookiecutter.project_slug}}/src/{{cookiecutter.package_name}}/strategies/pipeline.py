"""Pipeline parallel inside fsdp2: the model's blocks split into stages, each stage on its own group of ranks,
micro-batches fed through by a torch.distributed.pipelining schedule (GPipe, 1F1B, interleaved 1F1B, and the
zero-bubble schedules, which split each backward into its input and weight halves).

As torchtitan does it, each stage is the whole model's structure with the other stages' parts removed: a
stage keeps its parameters' names (`blocks.5.attn.q.weight` stays that on whichever stage holds block 5),
so a checkpoint written under pipeline parallel is the whole model's, and loads under another layout.
The stages a rank holds are gathered under one module (`PipelineRank`) for the optimizer and checkpoints;
the schedule runs the stages themselves.

The model contract (tasks/base.py) adds `model.pipeline_ends()`: the names of the top-level modules before
the blocks (on the first stage) and after them (on the last stage); a model whose forward skips a missing
one (None) runs as any stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..errors import RecipeError
from .pipeline_checks import EXACT_STAGES_PER_RANK, V_SCHEDULES, balanced_split


class StageBlocks(nn.ModuleList):
    """Some of the model's blocks, kept under their indices in the whole model (`blocks.5`, not `blocks.0`).

    Positions (`blocks[0]`, `enumerate(blocks)`) count the blocks held, as in a ModuleList.
    """

    def __init__(self, blocks: dict[int, nn.Module]) -> None:
        super().__init__()
        for index, block in blocks.items():
            self.add_module(str(index), block)

    def __getitem__(self, position: Any) -> Any:
        return self._modules[list(self._modules)[position]]

    def __setitem__(self, position: Any, module: Any) -> None:
        self._modules[list(self._modules)[position]] = module

    def indices(self) -> list[int]:
        """The indices in the whole model of the blocks held."""
        return [int(key) for key in self._modules]


class PipelineRank(nn.Module):
    """The stages one rank holds, as one module with the whole model's parameter names (optimizer, checkpoints).

    Its children are the stages' own modules (shared, not copied); the schedule calls the stages.
    """

    stages: list[Any]  # the stage modules, each the whole model's structure with the other stages' parts removed

    def __init__(self, stages: list[nn.Module]) -> None:
        super().__init__()
        object.__setattr__(self, "stages", stages)  # not registered: their modules are registered below
        self.gather()

    def gather(self) -> None:
        """Register the stages' modules under their names, in the whole model's order (again after wrapping)."""
        self._modules.clear()
        blocks: dict[int, nn.Module] = {}
        for name in self.stages[0]._modules:
            if name == "blocks":
                for stage in self.stages:
                    blocks.update(zip(stage.blocks.indices(), stage.blocks, strict=True))
                self.add_module("blocks", StageBlocks(dict(sorted(blocks.items()))))
                continue
            held = [stage._modules[name] for stage in self.stages if stage._modules[name] is not None]
            if held:
                self.add_module(name, held[0])

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a pipeline-parallel model runs through its schedule (strategy.forward_backward)")

    def step_statistics(self) -> torch.Tensor | None:
        """The stages' step statistics (the model contract's, tasks/base.py), summed: each fills the rows of its own
        layers, so summed over the ranks they hold every stage's."""
        held = [
            statistics
            for stage in self.stages
            if callable(own := getattr(stage, "step_statistics", None)) and (statistics := own()) is not None
        ]
        return torch.stack(held).sum(dim=0) if held else None

    def end_step(self, summed: torch.Tensor, updated: bool) -> dict[str, torch.Tensor]:
        """Each stage's own end of the step (its layers' updates) from the statistics summed over the ranks; the
        figures they log, the same from every stage (they come from `summed`)."""
        figures: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            figures = stage.end_step(summed, updated)
        return figures


class AuxiliaryGradient(torch.autograd.Function):
    """A stage's auxiliary loss, joined to the loss backward sees where the stage's output leaves it: forward returns
    the output's values; backward passes its gradient on and gives the term a gradient of 1 (as Megatron's
    MoEAuxLossAutoScaler does). The last stage's loss function never sees the other stages' terms. A copy, not the
    output itself, which autograd would make a view of it (the zero-bubble schedules detach a stage's outputs in
    place); the output is then freed, so a piece in flight holds one of them."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, term: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(term)
        return output.clone()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        (term,) = ctx.saved_tensors
        return gradient, torch.ones_like(term)


def block_ranges(split: Sequence[int]) -> list[range]:
    """The block indices of each stage, from blocks per stage."""
    starts = [sum(split[:stage]) for stage in range(len(split))]
    return [range(start, start + size) for start, size in zip(starts, split, strict=True)]


def pipeline_ends(model: Any) -> tuple[list[str], list[str]]:
    """The names of the model's top-level modules before its blocks and after them (the contract's pipeline part)."""
    if not callable(getattr(model, "pipeline_ends", None)):
        raise RecipeError(
            f"{type(model).__name__} has no `pipeline_ends()` (the modules before and after its blocks), which"
            " pipeline parallel needs (set strategy.fsdp2.pipeline_parallel_size=1)"
        )
    return model.pipeline_ends()


def stage_split(build: Callable[[], nn.Module], stages: int, explicit: Sequence[int]) -> list[int]:
    """The recipe's split, or one balanced by parameter count (sizes read off a meta-device build)."""
    if explicit:
        return list(explicit)
    with torch.device("meta"):
        model: Any = build()
    first_names, last_names = pipeline_ends(model)
    sizes = [sum(p.numel() for p in block.parameters()) for block in model.blocks]

    def outside(names: Sequence[str]) -> int:
        return sum(p.numel() for name in names if (m := getattr(model, name)) is not None for p in m.parameters())

    return balanced_split(sizes, outside(first_names), outside(last_names), stages)


def build_stages(
    build: Callable[[], nn.Module], split: Sequence[int], indices: Sequence[int], on_meta: bool
) -> list[nn.Module]:
    """The stages `indices` of the model: its whole structure with the other stages' parts removed.

    On the meta device (meta_init) nothing else is allocated; otherwise each stage is cut from an ordinary
    build drawn from the same random state, so its weights are those the whole model would have.
    """
    ranges = block_ranges(split)
    state = torch.get_rng_state()
    stages = []
    for index in indices:
        torch.set_rng_state(state)
        with torch.device("meta") if on_meta else nullcontext():
            model: Any = build()
        first_names, last_names = pipeline_ends(model)
        model.blocks = StageBlocks({i: model.blocks[i] for i in ranges[index]})
        removed = ([] if index == 0 else first_names) + ([] if index == len(split) - 1 else last_names)
        for name in removed:
            setattr(model, name, None)
        stages.append(model)
    return stages


# A stage's inputs and outputs for one piece of a micro-batch, as meta tensors (their shapes, dtypes and strides).
StageShapes = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]


def stage_boundaries(
    build: Callable[[], nn.Module], split: Sequence[int], inputs: tuple[torch.Tensor, ...], dtype: torch.dtype
) -> list[StageShapes]:
    """What crosses into and out of each stage for one piece (`inputs`: the first stage's), without a peer.

    Read off the whole model built on the meta device and run on the piece, its floating parameters and inputs in
    `dtype` (what fully_shard's mixed-precision policy computes in), at the last block of each stage but the last:
    a stage's output is its last block's, and the next stage's input. Meta tensors carry the shapes alone, so this
    runs past any dispatch mode (under a rehearsal's fake tensors the same forward costs several times as much).
    """
    from torch.utils._python_dispatch import _disable_current_modes

    crossing: list[tuple[torch.Tensor, ...]] = []
    with _disable_current_modes(), torch.device("meta"), torch.no_grad():
        model: Any = build()
        for param in model.parameters():  # not the buffers: fully_shard's policy leaves them (rotary tables) as built
            if param.is_floating_point():
                param.data = param.data.to(dtype)
        for end in [indices[-1] for indices in block_ranges(split)][:-1]:
            model.blocks[end].register_forward_hook(lambda module, args, output: crossing.append(as_arguments(output)))
        pieces = tuple(torch.empty(x.shape, dtype=x.dtype) for x in inputs)
        crossing.append(as_arguments(model(*(x.to(dtype) if x.is_floating_point() else x for x in pieces))))
        # What crosses is an activation, which backward flows through.
        crossing = [tuple(t.detach().requires_grad_(t.is_floating_point()) for t in ts) for ts in crossing]
    return [(pieces if stage == 0 else crossing[stage - 1], crossing[stage]) for stage in range(len(split))]


class Schedule:
    """The pipeline schedule of a rank's stages: one call runs forward and backward of every piece of a micro-batch."""

    def __init__(
        self,
        stages: list[nn.Module],
        indices: list[int],
        num_stages: int,
        mesh: DeviceMesh,
        device: torch.device,
        schedule: str,
        microbatches: int,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        shapes: Sequence[StageShapes] | None = None,
    ) -> None:
        """`shapes`: every stage's inputs and outputs (`stage_boundaries`); without them torch's stages learn their
        neighbours' at the first step, by exchanging them."""
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        self.group = mesh.get_group("pipeline")
        self.holds_first, self.holds_last = 0 in indices, num_stages - 1 in indices
        self.microbatches = microbatches
        self.loss = loss
        self.scale = 1.0
        self.adjust: Callable[[torch.Tensor], torch.Tensor] = lambda value: value
        self.measure: Callable[[torch.Tensor, torch.Tensor], None] | None = None  # set while validating
        self.inferring = False  # while torch runs a stage on stand-in inputs to learn its outputs' shapes
        pipeline_stages = []
        for stage, index in zip(stages, indices, strict=True):
            inputs, outputs = shapes[index] if shapes else (None, None)
            pipeline_stages.append(PipelineStage(stage, index, num_stages, device, inputs, outputs, group=self.group))
            # torch 2.13 runs every stage once before its first piece, on the first stage's real inputs and empty
            # tensors elsewhere: not a training forward (its figures and auxiliary loss are not the step's).
            if callable(inference := getattr(pipeline_stages[-1], "_forward_metadata_inference", None)):
                pipeline_stages[-1]._forward_metadata_inference = self.inferring_while(inference)  # type: ignore[method-assign]
        schedule_class = get_schedule_class(schedule)
        # The loss below is already divided by the number of pieces: gradients are not scaled again.
        self.schedule = schedule_class(
            pipeline_stages[0] if EXACT_STAGES_PER_RANK.get(schedule) == 1 else pipeline_stages,  # GPipe, 1F1B
            n_microbatches=microbatches,
            loss_fn=self.piece_loss,
            scale_grads=False,
        )
        self.forward_only = forward_only_actions(self.schedule) if schedule in V_SCHEDULES else None
        for stage in stages:  # a model with an auxiliary loss (tasks/base.py) adds its stages' terms where they run
            if callable(getattr(stage, "auxiliary_loss", None)):
                stage.register_forward_hook(self.add_auxiliary_loss)
        if shapes:
            # Before its first step each stage votes, over P2P, whether it was given its shapes; every stage was, so
            # the vote can only come out "static": set that, and the schedule runs with no exchange but the pieces'.
            self.schedule._warmup_p2p = skip_shape_vote  # type: ignore[method-assign]

    def piece_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The loss of one piece as backward sees it: its share of the step's mean. While validating, the
        piece's outputs go to the validation metrics instead (no backward reads the zero returned). The outputs in
        fp32, as Fabric hands a model's outputs to the loss without a pipeline: a 16-bit last stage's logits would
        give a log-softmax, a loss and its gradients in bf16."""
        if outputs.is_floating_point():
            outputs = outputs.to(torch.get_default_dtype())
        if self.measure is not None:
            self.measure(outputs, targets)
            return outputs.new_zeros(())
        return self.adjust(self.loss(outputs, targets)) * self.scale

    def inferring_while(self, run: Callable[..., Any]) -> Callable[..., Any]:
        """`run` with `inferring` set while it runs."""

        def inferring(*args: Any, **kwargs: Any) -> Any:
            self.inferring = True
            try:
                return run(*args, **kwargs)
            finally:
                self.inferring = False

        return inferring

    def add_auxiliary_loss(self, stage: nn.Module, args: Any, output: Any) -> Any:
        """After a stage's training forward of a piece: its auxiliary loss (the model's, which also records the
        forward's figures), scaled as the piece's loss is, joined to the output's backward; nothing while
        validating or while torch infers the stages' shapes."""
        if self.measure is not None or self.inferring:
            return None
        term = stage.auxiliary_loss()  # type: ignore[operator]
        if term is None:
            return None
        if isinstance(output, torch.Tensor):
            return AuxiliaryGradient.apply(output, term * self.scale)
        first = next(i for i, x in enumerate(output) if isinstance(x, torch.Tensor) and x.is_floating_point())
        return (*output[:first], AuxiliaryGradient.apply(output[first], term * self.scale), *output[first + 1 :])

    def forward_backward(
        self, inputs: Any, targets: Any, accumulate: int, adjust: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """Run the schedule on one of a step's `accumulate` micro-batches; its mean loss on every rank of the
        pipeline (detached)."""
        self.scale, self.adjust = 1 / (accumulate * self.microbatches), adjust
        losses: list[torch.Tensor] = []
        self.schedule.step(
            *(as_arguments(inputs) if self.holds_first else ()),
            target=targets if self.holds_last else None,
            losses=losses,
            return_outputs=False,
        )
        # The last stage computed the loss; the other stages learn it from the one sum below.
        loss = torch.stack(losses).detach().sum() * accumulate if losses else torch.zeros((), device=targets.device)
        dist.all_reduce(loss, group=self.group)
        return loss

    def evaluate(self, inputs: Any, targets: Any, measure: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """Forward only, one micro-batch: the last stage hands each piece's outputs and targets to `measure`
        (the validation metrics); the other stages only pass activations on."""
        self.measure, schedule = measure, self.schedule
        if self.forward_only is not None:
            trained, schedule.pipeline_order_with_comms = schedule.pipeline_order_with_comms, self.forward_only
        try:
            schedule.eval(
                *(as_arguments(inputs) if self.holds_first else ()),
                target=targets if self.holds_last else None,
                return_outputs=False,
            )
        finally:
            self.measure = None
            if self.forward_only is not None:
                schedule.pipeline_order_with_comms = trained


def skip_shape_vote(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
    """The outcome of torch's warm-up vote when every stage was given its shapes: each runs on them."""
    from torch.distributed.pipelining._utils import InferenceMode

    for stage in stages:
        stage._inference_mode = InferenceMode.STATIC


def as_arguments(inputs: Any) -> tuple[Any, ...]:
    """`split_batch`'s inputs as the first stage's positional arguments (the schedule splits each into pieces)."""
    return inputs if isinstance(inputs, tuple) else (inputs,)


def forward_only_actions(schedule: Any) -> dict[int, list[Any]]:
    """A V schedule's actions, with their sends and receives, less the backward ones: its order for evaluation.

    torch's `eval()` runs a schedule's whole order with backward switched off, but a V schedule hands each backward
    input to the stage below on the same rank, which then has none and fails. The forwards and their sends and
    receives keep the order the schedule gave them (tests/e2e/test_pipeline.py: ZB-V validates as ddp does).
    """
    from torch.distributed.pipelining.schedules import _ComputationType as Action

    kept = (Action.FORWARD, Action.SEND_F, Action.RECV_F, Action.UNSHARD, Action.RESHARD)
    return {
        rank: [action for action in actions if action.computation_type in kept]
        for rank, actions in schedule.pipeline_order_with_comms.items()
    }
