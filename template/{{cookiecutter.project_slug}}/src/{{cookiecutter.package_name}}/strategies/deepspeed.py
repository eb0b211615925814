"""DeepSpeed ZeRO 1/2/3 with CPU or NVMe offload through Fabric's DeepSpeedStrategy. GPUs only (the tests
run it on CPU through tests/deepspeed_on_cpu.py). Choose it when FSDP2 still does not fit.

DeepSpeed differs from the other strategies in four places the loop asks about: it clips inside its
own step, it takes the end of gradient accumulation from its engine rather than from Fabric's
no_backward_sync, ZeRO-3 keeps reduced gradients that a skipped update must drop, and ZeRO-3 builds
the model partitioned.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from ..errors import RecipeError
from ..planner.options import PlanOption, PlanSizes, PlanTerm
from ..precision import MIXED
from ..recipe.schema import DeepSpeedOptions
from ..tasks.base import checked_model
from .base import (
    GpuRequirement,
    MakeOptimizer,
    TrainingStrategy,
    gpu_only,
    prepare_blocks,
    process_group_options,
)

DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce / all-gather bucket, in elements

if TYPE_CHECKING:
    import torch
    from lightning.fabric import Fabric
    from lightning.fabric.strategies import Strategy
    from torch import nn


class DeepSpeed(TrainingStrategy):
    """Fabric's DeepSpeedStrategy with the config the recipe's `strategy.deepspeed` section asks for."""

    name = "deepspeed"
    options_key = "deepspeed"
    options_type = DeepSpeedOptions
    checkpoint_layout = "own"
    supports_meta_init = True
    not_rehearsed = "DeepSpeed builds its engine on CUDA devices only; plan's ZeRO figures follow its memory estimator"

    @property
    def zero_stage_3(self) -> bool:
        return self.options.stage == 3

    def check(self) -> None:
        options = self.options
        for key in ("offload_optimizer", "offload_parameters"):
            where = getattr(options, key)
            if where == "nvme" and not options.nvme_path:
                raise RecipeError(
                    f"strategy.deepspeed.{key}=nvme needs strategy.deepspeed.nvme_path (a folder on a local NVMe drive)"
                )
            if where != "none" and options.stage != 3 and (key == "offload_parameters" or where == "nvme"):
                raise RecipeError(
                    f"strategy.deepspeed.{key}={where} needs strategy.deepspeed.stage=3"
                    " (stages 1 and 2 offload only the optimizer, and only to cpu)"
                )
        if self.config.meta_init and not self.zero_stage_3:
            raise RecipeError(
                "strategy.meta_init=true needs strategy.deepspeed.stage=3 (stages 1 and 2 keep every parameter whole"
                " on every rank; stage 3 always builds the model partitioned)"
            )

    def gpu_requirement(self) -> GpuRequirement:
        return gpu_only(self.name, package="deepspeed")

    def describe(self) -> str:
        offload = {key: getattr(self.options, key) for key in ("offload_optimizer", "offload_parameters")}
        where = ", ".join(
            f"{key.removeprefix('offload_')} on {value}" for key, value in offload.items() if value != "none"
        )
        return f"strategy {self.name} (ZeRO-{self.options.stage}{', ' + where if where else ''})"

    def plan_options(self) -> list[PlanOption]:
        # DeepSpeed keeps 16-bit parameters and gradients beside its fp32 master weights under mixed
        # precision, runs the module in 16 bits, and communicates 16-bit values. Fabric runs it on GPUs only.
        def option(stage: int, why: str, offload: str = "none") -> PlanOption:
            name = f"zero{stage}" + {"none": "", "cpu": "_offload", "nvme": "_nvme"}[offload]
            return PlanOption(
                name,
                stage=stage,
                why=why,
                comm_vs_ddp=1.5 if stage == 3 else 1.0,
                offload=offload,
                runs_on_cpu=False,
                sixteen_bit_module=True,
            )

        return [
            option(1, "sharding the optimizer state alone makes it fit, at ddp's communication volume"),
            option(2, "sharding the optimizer state and gradients makes it fit, at ddp's communication volume"),
            option(3, "the parameters must be sharded too (1.5x ddp's communication)"),
            option(3, "only with parameters and optimizer state in host RAM ({offloaded} per node) does it fit", "cpu"),
            option(3, "only with parameters and optimizer state on NVMe ({offloaded} per node) does it fit", "nvme"),
        ]

    def plan_runtime_terms(self, option: PlanOption, sizes: PlanSizes) -> list[PlanTerm]:
        local, precision = sizes.parameters, sizes.precision
        grad = 4 if precision == "32-true" else 2  # bytes of its 16-bit (or fp32) gradients and buckets
        bucket = min(DEEPSPEED_BUCKET, local) * grad
        terms = []
        if precision in MIXED and option.stage == 1:  # the bf16 optimizer accumulates gradients in fp32
            terms.append(PlanTerm("fp32 gradient accumulation (bf16 optimizer)", 4 * local))
        elif precision in MIXED:  # offloaded, the partition lives with the optimizer state
            terms.append(PlanTerm("fp32 gradient partition", 4 * local / sizes.data_parallel, with_optimizer=True))
        if option.stage < 3:
            return [*terms, PlanTerm("overlap_comm buckets", 4.5 * 2 * bucket)]  # reduce + all-gather bucket
        return [
            *terms,
            PlanTerm("gathered layers, current and prefetched", 2 * grad * sizes.layer),
            PlanTerm("reduce bucket", bucket),
        ]

    def plan_section(self, option: PlanOption, base: dict[str, Any]) -> dict[str, Any]:
        nvme_path = (base.get("deepspeed") or {}).get("nvme_path") or "/local_nvme"
        options = {
            "stage": option.stage,
            "offload_optimizer": option.offload,
            "offload_parameters": option.offload,
            "nvme_path": nvme_path if option.offload == "nvme" else None,
        }
        return {"name": self.name, "meta_init": False, "deepspeed": options}

    def config_dict(self) -> dict[str, Any]:
        """The DeepSpeed config the recipe asks for (ZeRO stage, offload, clipping, bf16)."""
        options, recipe = self.options, self.recipe
        zero: dict[str, Any] = {"stage": options.stage, "overlap_comm": True, "contiguous_gradients": True}
        for key, where in (
            ("offload_optimizer", options.offload_optimizer),
            ("offload_param", options.offload_parameters),
        ):
            if where == "cpu":
                zero[key] = {"device": "cpu", "pin_memory": True}
            elif where == "nvme":
                zero[key] = {"device": "nvme", "nvme_path": options.nvme_path, "pin_memory": True}
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": recipe.train.micro_batch_size,
            # The loop accumulates itself and calls optimizer.step() once per step, so DeepSpeed must not.
            "gradient_accumulation_steps": 1,
            # Fabric cannot clip under DeepSpeed: the engine clips the global norm itself.
            "gradient_clipping": recipe.train.grad_clip,
            "zero_optimization": zero,
            # The loop's torch AdamW also runs on offloaded (CPU) state.
            "zero_force_ds_cpu_optimizer": False,
            "zero_allow_untested_optimizer": True,
        }
        if recipe.precision.startswith("bf16"):
            config["bf16"] = {"enabled": True}
        if "nvme" in (options.offload_optimizer, options.offload_parameters):
            config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
        return config

    def fabric_strategy(self) -> Strategy:
        from lightning.fabric.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(config=self.config_dict(), **process_group_options(self.recipe))

    def build_model(self, fabric: Fabric, pretrained: bool = False) -> nn.Module:
        """ZeRO-3 builds each layer partitioned (`deepspeed.zero.Init`, which Fabric enters only with
        empty_init), then gives it the model's init one gathered parameter at a time.

        Pretrained weights are copied in here, before `setup`: DeepSpeed's optimizer takes its (fp32 master)
        copies of the parameters when it is set up, and would not see weights loaded later."""
        with fabric.init_module(empty_init=self.config.meta_init or self.zero_stage_3):
            model = checked_model(self.task)
        if self.zero_stage_3:
            init_zero3_partitioned(model)
        if pretrained:
            load_zero_pretrained(model, self.task.pretrained_tensors())
        return model

    def load_pretrained(self, fabric: Fabric, model: Any) -> None:
        """Nothing: `build_model` loaded the weights before DeepSpeed took its copies."""

    def setup(self, fabric: Fabric, model: nn.Module, make_optimizer: MakeOptimizer) -> tuple[Any, Any, Any]:
        # DeepSpeed sets model and optimizer up together from the unsharded model.
        prepare_blocks(model, self.config)
        optimizer = make_optimizer(model)
        model, wrapped = fabric.setup(model, optimizer)
        return model, wrapped, optimizer  # DeepSpeed's optimizer steps the same param_groups

    @contextmanager
    def no_backward_sync(self, fabric: Fabric, model: Any, enabled: bool) -> Iterator[None]:
        """DeepSpeed does not take Fabric's no_backward_sync (Fabric warns and the engine takes every backward
        as the end of a step: ZeRO's update then differs from ddp's from the first accumulated step, as
        tests/e2e/test_deepspeed.py shows). Its engine is told where the step's accumulation boundary is instead."""
        engine(fabric).set_gradient_accumulation_boundary(not enabled)
        yield

    def clip_and_step(self, fabric: Fabric, model: Any, optimizer: Any, max_norm: float) -> torch.Tensor | None:
        """DeepSpeed clips inside its own step (`gradient_clipping` in its config; Fabric cannot clip for it).
        Fabric steps the ZeRO optimizer itself (the engine is not an optimizer to Fabric), so the engine's
        get_global_grad_norm() is never filled; the optimizer keeps the norm in `_global_grad_norm`."""
        optimizer.step()
        return getattr(engine(fabric).optimizer, "_global_grad_norm", None)

    def discard_gradients(self, fabric: Fabric) -> None:
        """ZeRO-3 keeps reduced gradient partitions that its own step would consume. They are dropped the
        way DeepSpeed drops them when it skips a step itself (`_overflow_clean_up`, not public API); left in
        place, the next update goes wrong (tests/e2e/test_deepspeed.py)."""
        zero_optimizer = engine(fabric).optimizer
        if hasattr(zero_optimizer, "_overflow_clean_up"):  # ZeRO-3; ZeRO-1/2 need nothing beyond zero_grad
            zero_optimizer._overflow_clean_up(zero_optimizer.loss_scale)


def engine(fabric: Fabric) -> Any:
    """DeepSpeed's engine (what Fabric's DeepSpeedStrategy keeps as `.model`)."""
    strategy: Any = fabric.strategy
    return strategy.model


def init_zero3_partitioned(model: Any) -> None:
    """The model's init under DeepSpeed ZeRO-3's `deepspeed.zero.Init`, one parameter gathered at a time.

    zero.Init partitions each layer's parameters as soon as the layer is built, so the init at the end of
    the model's constructor only sees empty placeholders. Each parameter is gathered whole, initialised,
    and partitioned again (rank 0's values are kept); every rank draws the same numbers, so the random
    streams stay equal on all ranks and the weights equal an unsharded build's with the same seed.
    """
    import deepspeed  # GPU-strategy extra: imported only for deepspeed recipes
    import torch

    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            model.init_parameter(name, param)


def load_zero_pretrained(model: Any, weights: Iterable[tuple[str, Any]]) -> None:
    """Copy the task's pretrained weights in, one tensor at a time; under ZeRO-3 each parameter is gathered whole,
    written on rank 0 and partitioned again (elsewhere the gather is a no-op and every rank copies)."""
    import deepspeed  # GPU-strategy extra: imported only for deepspeed recipes
    import torch

    parameters = dict(model.named_parameters(remove_duplicate=False))
    for name, value in weights:
        param = parameters[name]
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0), torch.no_grad():
            param.copy_(value)
