"""FSDP2, HSDP and tensor parallel: torch's fully_shard per block (and DTensor tensor parallel inside a node)
through Fabric's ModelParallelStrategy. FSDP2 is the default sharded strategy; it runs on CPU (gloo) too.
With `fsdp2.pipeline_parallel_size` > 1 the blocks are split into pipeline stages on a (pipeline, data parallel,
context parallel, tensor parallel) mesh, each stage sharded as a model of its own, run by a schedule.

The in-process half (the parallelize_fn, device meshes, clipping across meshes) is `fully_shard.py`; the
pipeline's stages and schedule are `pipeline.py`, its recipe rules `pipeline_checks.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from ..planner.options import PlanOption, PlanSizes, PlanTerm, RankStep
from ..precision import MIXED, torch_model_states
from ..recipe.schema import Fsdp2Options
from ..tasks.base import checked_model
from .base import GpuRequirement, MakeOptimizer, TrainingStrategy, divisors, process_group_options
from .context_parallel import SequenceShard, check_context_parallel, split_sequences
from .expert_checks import check_expert_parallel
from .pipeline_checks import check_pipeline, pipeline_rehearsal_problem, stage_indices

if TYPE_CHECKING:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import Strategy
    from torch import nn

SHARDED_PRECISIONS = ("32-true", "bf16-mixed", "bf16-true", "16-true")
FLOAT8_CAPABILITY = (8, 9)  # Ada (L4, L40) and Hopper (H100, H200) and newer have float8 tensor cores
# Under bf16-mixed fully_shard's MixedPrecisionPolicy (fully_shard.mixed_precision_policy) makes the module
# 16-bit (activations, all-gathers) and reduces gradients in fp32: how plan counts every fsdp2/hsdp option.
BF16_POLICY: dict[str, Any] = dict(sixteen_bit_module=True, fp32_gradient_reduce=True)


class FSDP2(TrainingStrategy):
    """Parameters, gradients and optimizer state sharded per transformer block over all ranks (ZeRO-3-like)."""

    name = "fsdp2"
    options_key = "fsdp2"
    options_type = Fsdp2Options
    checkpoint_layout = "sharded"
    supports_meta_init = True
    trains_adapters = True  # fully_shard shards frozen and trained parameters of a block together
    hybrid = False  # hsdp: shard inside a node, replicate across nodes
    shapes_batch: Any = None  # whose shapes `setup` gives pipeline stages (else they exchange them at step 1)

    @property
    def tensor_parallel_size(self) -> int:
        return self.options.tensor_parallel_size

    @property
    def pipeline_parallel_size(self) -> int:
        return self.options.pipeline_parallel_size

    @property
    def context_parallel_size(self) -> int:
        return self.options.context_parallel_size

    def check(self) -> None:
        recipe, tensor_parallel = self.recipe, self.tensor_parallel_size
        if recipe.devices % tensor_parallel:
            raise RecipeError(
                f"strategy.fsdp2.tensor_parallel_size={tensor_parallel} does not divide devices={recipe.devices}"
                f" (tensor parallel stays inside a node: choose {divisors(recipe.devices)})"
            )
        dimensions = self.task.tensor_parallel_dimensions()
        if tensor_parallel > 1 and not dimensions:
            raise RecipeError(
                f"strategy.fsdp2.tensor_parallel_size={tensor_parallel}: task={recipe.task} has no tensor-parallel"
                " plan (set it to 1)"
            )
        for key, size in dimensions.items():
            if size % tensor_parallel:
                raise RecipeError(
                    f"strategy.fsdp2.tensor_parallel_size={tensor_parallel} does not divide {key}={size}"
                    " (each tensor-parallel rank holds an equal share of heads and width)"
                )
        if (adapters := self.task.adapters()) and (tensor_parallel > 1 or self.options.float8):
            field = f"tensor_parallel_size={tensor_parallel}" if tensor_parallel > 1 else "float8=true"
            raise RecipeError(
                f"{adapters} does not compose with strategy.fsdp2.{field} (the adapter layers have no tensor-parallel or float8"
                " form here): turn it off"
            )
        if self.options.float8 and tensor_parallel > 1:
            raise RecipeError(
                "strategy.fsdp2.float8=true works with strategy.fsdp2.tensor_parallel_size=1 only (float8 + FSDP2)"
            )
        if self.hybrid and recipe.num_nodes < 2:
            raise RecipeError(
                f"strategy.name={self.name} needs num_nodes >= 2 (it shards inside a node and replicates across"
                " nodes); on one node choose fsdp2"
            )
        sizes = (self.pipeline_parallel_size, self.context_parallel_size, self.options.expert_parallel_size)
        for size, check in zip(sizes, (check_pipeline, check_context_parallel, check_expert_parallel), strict=True):
            if size != 1:  # each mesh dimension's own rules
                check(self)
        if recipe.precision not in SHARDED_PRECISIONS:
            raise RecipeError(
                f"precision={recipe.precision} is not supported with strategy.name={self.name}"
                f" (choose {', '.join(SHARDED_PRECISIONS)})"
            )

    def gpu_requirement(self) -> GpuRequirement | None:
        if self.options.cpu_offload and not self.options.float8:
            return GpuRequirement(
                field="strategy.fsdp2.cpu_offload=true",
                needs="CUDA GPUs",
                why="it moves the training state between GPU and host memory",
                remedy="set it false",
            )
        if not self.options.float8:
            return None
        return GpuRequirement(
            field="strategy.fsdp2.float8=true",
            needs="GPUs",
            why="float8 needs compute capability 8.9+",
            remedy="set it false",
            capability=FLOAT8_CAPABILITY,
            package="torchao",
            extra="float8",
        )

    def data_parallel_size(self) -> int:
        # Tensor- and context-parallel peers share their samples; each pipeline stage sees every sample.
        sharing = self.tensor_parallel_size * self.pipeline_parallel_size * self.context_parallel_size
        return self.recipe.world_size // sharing

    def describe(self) -> str:
        text, options = f"strategy {self.name}", self.options
        if self.pipeline_parallel_size > 1:
            text = (
                f"pipeline parallel {self.pipeline_parallel_size} ({options.pipeline_schedule},"
                f" {options.pipeline_microbatches} micro-batches) x {text}"
            )
        for dimension, size in (("context", self.context_parallel_size), ("expert", self.options.expert_parallel_size)):
            text += f" x {dimension} parallel {size}" if size > 1 else ""
        return text + f" x tensor parallel {self.tensor_parallel_size}" if self.tensor_parallel_size > 1 else text

    def plan_options(self) -> list[PlanOption]:
        tensor_parallel = [
            PlanOption(
                f"{self.name}_tp{size}",
                stage=3,
                why="one layer's activations ({layer_activations}) do not fit beside the sharded states;"
                " splitting each layer over {tensor_parallel} {device_plural} does",
                comm_vs_ddp=1.5,
                tensor_parallel=size,
                splits_experts=True,  # over the data x tensor-parallel ranks (token_split.py)
                **BF16_POLICY,
            )
            for size in (2, 4, 8)
        ]
        sharded = PlanOption(
            self.name,
            stage=3,
            why=f"the parameters must be sharded too (1.5x ddp's communication); {self.name} is the default for that",
            comm_vs_ddp=1.5,
            splits_experts=True,  # plan offers it here; a recipe may add a pipeline (expert_checks.py)
            **BF16_POLICY,
        )
        # Blocks split into stages across nodes (activations cross the slow links, not parameters), each stage
        # sharded inside its group; with tensor parallel inside a node for the largest models.
        # 1F1B, or ZB-V: two stages per rank in a V, the weight halves of backward run in the bubble.
        pipeline = [
            PlanOption(
                f"{self.name}_pp{stages}" + (f"_tp{size}" if size > 1 else "") + suffix,
                stage=3,
                why="{pipeline_parallel} pipeline stages each hold 1/{pipeline_parallel} of the blocks and the"
                " activations of the pieces in flight ({bubble} of a step idles in {schedule}'s bubble); only"
                " activations cross between stages",
                comm_vs_ddp=1.5,
                tensor_parallel=size,
                pipeline_parallel=stages,
                pipeline_schedule=schedule,
                pipeline_stages_per_rank=per_rank,
                **BF16_POLICY,
            )
            for suffix, schedule, per_rank in (("", "1F1B", 1), ("_zbv", "ZBVZeroBubble", 2))
            for size in (1, 8)
            for stages in (2, 4, 8)
        ]
        return [sharded, *tensor_parallel, *pipeline]

    def rehearsal_problem(self) -> str | None:
        if self.pipeline_parallel_size > 1 and (problem := pipeline_rehearsal_problem(self)):
            return problem
        return super().rehearsal_problem()

    def recipe_plan_option(self) -> PlanOption | None:
        """The recipe's own layout: its tensor-parallel size, pipeline stages and schedule, expert-parallel degree."""
        import dataclasses

        options, stages, size = self.options, self.pipeline_parallel_size, self.tensor_parallel_size
        experts = options.expert_parallel_size
        parts = (("pp", stages), ("tp", size), ("ep", experts))
        return dataclasses.replace(
            self.plan_options()[0],
            name=self.name + "".join(f"_{key}{n}" for key, n in parts if n > 1),
            tensor_parallel=size,
            expert_parallel=experts,
            pipeline_parallel=stages,
            pipeline_schedule=options.pipeline_schedule if stages > 1 else "1F1B",
            pipeline_stages_per_rank=options.pipeline_stages_per_rank if stages > 1 else 1,
        )

    def plan_runtime_terms(self, option: PlanOption, sizes: PlanSizes) -> list[PlanTerm]:
        # Under bf16-mixed the sharded parameters stay fp32 and fully_shard's MixedPrecisionPolicy gathers them in
        # bf16; a layer's bf16 gradient is cast to fp32 for the reduce-scatter (reduce_dtype), so both are held.
        sixteen_bit = sizes.precision in MIXED
        weight = 2 if sixteen_bit else torch_model_states(1, sizes.precision, 0, 1).parameters
        gradient = 2 + 4 if sixteen_bit else weight
        if option.pipeline_parallel > 1:
            # torch's pipeline stages keep each block gathered after its backward and accumulate its gradient
            # unsharded (in fp32 under bf16-mixed, fully_shard's reduce dtype) until the step's last piece, when the
            # schedule reduces them: at the peak the stage holds all of its blocks so, and its root's fp32 sum beside
            # each piece's own gradient (rehearsed: Llama-70B's embedding, 5.9 GiB on the first stage) and its gathered
            # copy, whole beside its shard at any degree. With one micro-batch a step no gradient shard exists yet.
            blocks, summed, ends = sizes.gathered_blocks, 4 if sixteen_bit else weight, sizes.root
            terms = [
                PlanTerm("the stage's blocks, gathered until the step's last backward", weight * blocks),
                PlanTerm("their unsharded gradients, summed over the pieces", summed * blocks * sizes.trained),
                PlanTerm("root (embeddings, head) gathered for the step", weight * ends),
                PlanTerm("the root's gradients: their fp32 sum, a piece's own", (4 + weight) * ends * sizes.trained),
            ]
            if sizes.micro_batches == 1:  # the schedule reduce-scatters them after its last backward
                shards = torch_model_states(sizes.parameters, sizes.precision, 3, sizes.data_parallel, sizes.trained)
                terms.append(PlanTerm("gradient shards, made after the schedule", -shards.gradients))
            return terms
        root = PlanTerm(
            "root (embeddings, head) gathered for the step", weight * sizes.root * (1 - 1 / sizes.data_parallel)
        )
        return [
            PlanTerm("gathered layer, current and prefetched", 2 * weight * sizes.layer),
            PlanTerm("its unsharded gradient", gradient * sizes.layer * sizes.trained),
            root,
        ]

    def plan_collectives(self, option: PlanOption, sizes: PlanSizes, step: RankStep) -> dict[str, int] | None:
        from ..planner.collectives import sharded_collectives

        return sharded_collectives(option, sizes, step)

    def plan_section(self, option: PlanOption, base: dict[str, Any]) -> dict[str, Any]:
        section: dict[str, Any] = {"tensor_parallel_size": option.tensor_parallel, "float8": False}
        if option.expert_parallel > 1:
            section["expert_parallel_size"] = option.expert_parallel
        if option.pipeline_parallel > 1:  # pipeline_microbatches: the plan's micro batch, one sample a piece
            section |= {
                "pipeline_parallel_size": option.pipeline_parallel,
                "pipeline_schedule": option.pipeline_schedule,
                "pipeline_stages_per_rank": option.pipeline_stages_per_rank,
            }
        return {"name": self.name, "fsdp2": section}

    def fabric_strategy(self) -> Strategy:
        from .fully_shard import ModelParallel, parallelize, parallelize_pipeline

        # hsdp: one replica group per node, or under pipeline parallel per node of the nodes each stage spans.
        replicas = self.recipe.num_nodes // self.pipeline_parallel_size if self.hybrid else 1
        shard = parallelize_pipeline if self.pipeline_parallel_size > 1 else parallelize
        parallelize_fn = partial(shard, config=self.config, precision=self.recipe.precision, replicas=replicas)
        return ModelParallel(
            parallelize_fn=parallelize_fn,
            data_parallel_size=self.data_parallel_size(),
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            context_parallel_size=self.context_parallel_size,
            **process_group_options(self.recipe),
        )

    def build_model(self, fabric: Fabric, pretrained: bool = False) -> nn.Module:
        if self.pipeline_parallel_size == 1:
            return super().build_model(fabric, pretrained)
        from .pipeline import PipelineRank, build_stages, stage_split

        options = self.options
        mesh = fabric.strategy.device_mesh  # type: ignore[attr-defined]
        stages = self.pipeline_parallel_size * options.pipeline_stages_per_rank
        build = partial(checked_model, self.task)
        self.stage_split = stage_split(build, stages, options.pipeline_split)
        self.stage_indices = stage_indices(
            mesh.get_local_rank("pipeline"),
            self.pipeline_parallel_size,
            options.pipeline_stages_per_rank,
            options.pipeline_schedule,
        )
        with fabric.init_module(empty_init=self.config.meta_init):
            parts = build_stages(build, self.stage_split, self.stage_indices, self.config.meta_init)
        return PipelineRank(parts)

    def give_stages_shapes_of(self, batch: Any) -> None:
        """Have `setup` give each pipeline stage what crosses into and out of it for the pieces of `batch` (a
        micro-batch), worked out here, so the stages exchange nothing but activations and gradients: as `rehearse`
        needs, whose fake process group carries no objects."""
        self.shapes_batch = batch

    def setup(self, fabric: Fabric, model: nn.Module, make_optimizer: MakeOptimizer) -> tuple[Any, Any, Any]:
        from .pipeline import PipelineRank, Schedule

        # Checkpointing and compile are applied inside the parallelize_fn, between tensor parallel and sharding.
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(make_optimizer(model))
        if isinstance(model.module, PipelineRank):
            options = self.options
            self.schedule = Schedule(
                model.module.stages,
                self.stage_indices,
                len(self.stage_split),
                fabric.strategy.device_mesh,  # type: ignore[attr-defined]
                fabric.device,
                options.pipeline_schedule,
                options.pipeline_microbatches,
                self.task.loss,
                shapes=self.stage_shapes(model.module) if self.shapes_batch is not None else None,
            )
        return model, optimizer, optimizer

    def stage_shapes(self, model: nn.Module) -> list[Any]:
        """Each stage's inputs and outputs for one piece of `shapes_batch`, in the dtype the stages compute in."""
        from ..precision import mixed_precision_policy
        from .pipeline import as_arguments, stage_boundaries

        whole = as_arguments(self.task.split_batch(self.shapes_batch)[0])
        inputs = SequenceShard(None, 0, self.context_parallel_size).split_all(whole)  # every rank's part: one shape
        piece = self.recipe.train.micro_batch_size // self.options.pipeline_microbatches
        held = next(model.parameters()).dtype
        dtype = mixed_precision_policy(self.recipe.precision).param_dtype or held
        build = partial(checked_model, self.task)
        return stage_boundaries(build, self.stage_split, tuple(x[:piece] for x in inputs), dtype)

    @contextmanager
    def no_backward_sync(self, fabric: Fabric, model: Any, enabled: bool) -> Iterator[None]:
        """Every micro-batch's gradients are reduce-scattered into the shards: skipping it (Fabric's no_backward_sync)
        would keep every layer's unsharded fp32 gradient until the step's last micro-batch, a whole unsharded copy
        of the model per rank. Across hsdp's replicas the all-reduce of the shards waits for the last micro-batch.
        A pipeline's schedule reduces the gradients after its last piece."""
        from torch.distributed.fsdp import FSDPModule

        replicated = [m for m in model.modules() if isinstance(m, FSDPModule)] if self.hybrid else []
        if not enabled or self.pipeline_parallel_size > 1 or not replicated:
            yield
            return
        for module in replicated:
            module.set_requires_all_reduce(False, recurse=False)
        try:
            yield
        finally:
            for module in replicated:
                module.set_requires_all_reduce(True, recurse=False)

    def forward_backward(
        self,
        fabric: Fabric,
        model: Any,
        batch: Any,
        accumulate: int,
        adjust_loss: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        with split_sequences(fabric, batch, self.context_parallel_size) as part:
            if self.pipeline_parallel_size == 1:
                return super().forward_backward(fabric, model, part, accumulate, adjust_loss)
            inputs, targets = self.task.split_batch(part)
            return self.schedule.forward_backward(inputs, targets, accumulate, adjust_loss)

    def validation_step(self, fabric: Fabric, model: Any, batch: Any, metrics: dict[str, Any]) -> None:
        with split_sequences(fabric, batch, self.context_parallel_size) as part:
            if self.pipeline_parallel_size == 1:
                return super().validation_step(fabric, model, part, metrics)
            inputs, targets = self.task.split_batch(part)
            self.schedule.evaluate(inputs, targets, partial(self.task.update_metrics, metrics=metrics))
        return None


class HSDP(FSDP2):
    """FSDP2 on a (replicate, shard) mesh: sharded inside a node, replicated across nodes."""

    name = "hsdp"
    hybrid = True

    def plan_options(self) -> list[PlanOption]:
        return [
            PlanOption(
                self.name,
                stage=3,
                why="sharding inside a node is enough, so only 1/{devices} of the gradients crosses the links between nodes",
                comm_vs_ddp=1.5,
                hybrid=True,
                splits_experts=True,  # inside a node (expert_checks.py)
                **BF16_POLICY,
            )
        ]
