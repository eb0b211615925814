"""Recipe -> Fabric: accelerator, strategy object, precision, devices, nodes and loggers.

Every strategy is one of Fabric's own: DDPStrategy, ModelParallelStrategy (fsdp2, hsdp, tensor
parallel; its parallelize_fn is `parallel.parallelize`), FSDPStrategy (FSDP1) and DeepSpeedStrategy.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from functools import partial
from typing import Any, cast

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger
from lightning.fabric.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    ParallelStrategy,
    Strategy,
)

from {{ cookiecutter.package_name }}.config import Recipe, RecipeError
from {{ cookiecutter.package_name }}.launchers import check_launcher, join_restarted_torchrun_group
from {{ cookiecutter.package_name }}.model import GPT, Block
from {{ cookiecutter.package_name }}.parallel import clip_grad_norm, init_zero3_partitioned, parallelize, prepare_blocks
from {{ cookiecutter.package_name }}.strategy_config import GPU_ONLY_STRATEGIES, MODEL_PARALLEL

FLOAT8_CAPABILITY = (8, 9)  # Ada (L4, L40) and Hopper (H100, H200) and newer have float8 tensor cores


class ModelParallel(ModelParallelStrategy):
    """Fabric's ModelParallelStrategy, clipping gradients that live on several device meshes (tensor parallel)."""

    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """Clip the global gradient norm over all meshes."""
        self.precision.unscale_gradients(optimizer)
        return clip_grad_norm(self.precision.main_params(optimizer), max_norm, norm_type, error_if_nonfinite)


def resolve_accelerator(recipe: Recipe) -> str:
    """The accelerator this machine will use for the recipe; refuses cuda where no GPU is visible."""
    has_cuda = torch.cuda.is_available()
    if recipe.accelerator == "cuda" and not has_cuda:
        raise RecipeError("accelerator=cuda but no CUDA GPU is visible on this machine (use accelerator=cpu or auto)")
    if recipe.accelerator == "auto":
        return "cuda" if has_cuda else "cpu"
    return recipe.accelerator


def check_hardware(recipe: Recipe, accelerator: str, capability: tuple[int, int] | None) -> None:
    """Reject a recipe this machine cannot run; `capability` is the GPU's CUDA compute capability (None on CPU)."""
    name = recipe.strategy.name
    if accelerator == "cpu":
        if name in GPU_ONLY_STRATEGIES:
            raise RecipeError(
                f"strategy.name={name} needs CUDA GPUs and this machine has none (on CPU choose ddp, fsdp2 or hsdp)"
            )
        if recipe.strategy.float8:
            raise RecipeError("strategy.float8=true needs a GPU with compute capability 8.9+ and this machine has none")
        if recipe.precision in ("16-mixed", "16-true"):
            raise RecipeError(
                f"precision={recipe.precision} needs a GPU; on CPU choose 32-true, bf16-mixed or bf16-true"
            )
        return
    if capability is None:
        return
    version = ".".join(map(str, capability))
    if recipe.precision.startswith("bf16") and capability < (8, 0):
        raise RecipeError(
            f"precision={recipe.precision} needs a GPU with bf16 (compute capability 8.0+, A100 or newer);"
            f" this GPU has {version}: choose 16-mixed or 32-true"
        )
    if recipe.strategy.float8 and capability < FLOAT8_CAPABILITY:
        raise RecipeError(f"strategy.float8=true needs compute capability 8.9+ (H100, L4, ...); this GPU has {version}")
    if recipe.strategy.float8 and importlib.util.find_spec("torchao") is None:
        raise RecipeError("strategy.float8=true needs torchao: pip install torchao")


def deepspeed_config(recipe: Recipe) -> dict[str, Any]:
    """The DeepSpeed config a deepspeed recipe asks for (ZeRO stage, offload, clipping, bf16)."""
    strategy = recipe.strategy
    zero: dict[str, Any] = {
        "stage": strategy.deepspeed_stage,
        "overlap_comm": True,
        "contiguous_gradients": True,
    }
    for key, where in (
        ("offload_optimizer", strategy.offload_optimizer),
        ("offload_param", strategy.offload_parameters),
    ):
        if where == "cpu":
            zero[key] = {"device": "cpu", "pin_memory": True}
        elif where == "nvme":
            zero[key] = {"device": "nvme", "nvme_path": strategy.nvme_path, "pin_memory": True}
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
    if "nvme" in (strategy.offload_optimizer, strategy.offload_parameters):
        config["aio"] = {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}
    return config


def build_strategy(recipe: Recipe) -> Strategy:
    """The Fabric strategy object a recipe asks for."""
    strategy = recipe.strategy
    options: dict[str, Any] = {
        "process_group_backend": strategy.process_group_backend,
        "timeout": timedelta(minutes=strategy.timeout_minutes),
    }
    if strategy.name == "ddp":
        return DDPStrategy(**options)
    if strategy.name in MODEL_PARALLEL:
        return ModelParallel(
            parallelize_fn=partial(parallelize, config=strategy, num_nodes=recipe.num_nodes),
            data_parallel_size=recipe.world_size // strategy.tensor_parallel_size,
            tensor_parallel_size=strategy.tensor_parallel_size,
            **options,
        )
    if strategy.name == "fsdp":
        hybrid = strategy.fsdp_sharding == "HYBRID_SHARD"
        return FSDPStrategy(
            sharding_strategy=strategy.fsdp_sharding,
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block} if strategy.activation_checkpointing else None,
            cpu_offload=strategy.cpu_offload,
            state_dict_type="sharded",
            # HYBRID_SHARD: replicate across nodes, shard over the devices of a node.
            device_mesh=(recipe.num_nodes, recipe.devices) if hybrid else None,
            **options,
        )
    return DeepSpeedStrategy(config=deepspeed_config(recipe), **options)


def build_fabric(recipe: Recipe, loggers: list[Logger]) -> Fabric:
    """A Fabric object configured by the recipe (processes are launched by `fabric.launch()`)."""
    accelerator = resolve_accelerator(recipe)
    if accelerator == "cuda" and recipe.devices > torch.cuda.device_count():
        raise RecipeError(f"devices={recipe.devices} but this machine has {torch.cuda.device_count()} GPU(s)")
    check_hardware(recipe, accelerator, torch.cuda.get_device_capability() if accelerator == "cuda" else None)
    check_launcher(recipe, accelerator)  # fabric run / torchrun / srun must start the recipe's layout
    join_restarted_torchrun_group(recipe, accelerator)
    return Fabric(
        accelerator=accelerator,
        devices=recipe.devices,
        num_nodes=recipe.num_nodes,
        precision=recipe.precision,
        strategy=build_strategy(recipe),
        loggers=loggers,
    )


def zero_stage_3(recipe: Recipe) -> bool:
    return recipe.strategy.name == "deepspeed" and recipe.strategy.deepspeed_stage == 3


def build_model(fabric: Fabric, recipe: Recipe) -> GPT:
    """The GPT, built the way the strategy needs it.

    Every rank builds the full model from the same seed and the strategy then shards or replicates it;
    with strategy.meta_init it is built on the meta device and materialised sharded; under DeepSpeed
    ZeRO-3 each layer is partitioned as it is built (`deepspeed.zero.Init`, which Fabric enters only
    with empty_init), then given the GPT-2 init one gathered parameter at a time.
    """
    with fabric.init_module(empty_init=recipe.strategy.meta_init or zero_stage_3(recipe)):
        model = GPT(recipe.model)
    if zero_stage_3(recipe):
        init_zero3_partitioned(model)
    return model


def setup_model_and_optimizer(
    fabric: Fabric, model: torch.nn.Module, recipe: Recipe, make_optimizer: Callable[[torch.nn.Module], Any]
) -> tuple[Any, Any, torch.optim.Optimizer]:
    """The model and optimizer set up for the strategy, and the torch optimizer an LR scheduler drives.

    DeepSpeed needs both set up together from the unsharded model; the other strategies set the
    model up first (it is sharded then) and build the optimizer on its sharded parameters.
    """
    if recipe.strategy.name not in MODEL_PARALLEL:  # fsdp2/hsdp do this inside parallelize_fn
        # FSDPStrategy checkpoints blocks itself (activation_checkpointing_policy), inside its wrapping.
        fsdp = recipe.strategy.name == "fsdp"
        prepare_blocks(
            cast(GPT, model), replace(recipe.strategy, activation_checkpointing=False) if fsdp else recipe.strategy
        )
    if recipe.strategy.name == "deepspeed":
        optimizer = make_optimizer(model)
        model, wrapped = fabric.setup(model, optimizer)
        return model, wrapped, optimizer  # DeepSpeed's optimizer steps the same param_groups
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(make_optimizer(model))
    return model, optimizer, cast(torch.optim.Optimizer, optimizer)


@contextmanager
def no_backward_sync(fabric: Fabric, model: Any, enabled: bool) -> Iterator[None]:
    """Skip the gradient reduction of a micro-batch that is not the last of its step (gradient accumulation).

    DeepSpeed does not take Fabric's no_backward_sync (Fabric warns and the engine takes every backward
    as the end of a step: ZeRO's update then differs from ddp's from the first accumulated step, as
    tests/test_deepspeed.py shows). Its engine is told where the step's accumulation boundary is instead.
    """
    if isinstance(fabric.strategy, DeepSpeedStrategy):
        fabric.strategy.model.set_gradient_accumulation_boundary(not enabled)
        yield
        return
    with fabric.no_backward_sync(model, enabled=enabled):
        yield


def clip_and_step(fabric: Fabric, model: Any, optimizer: Any, max_norm: float) -> torch.Tensor | None:
    """Clip the global gradient norm to `max_norm` (0: no clipping), step; return the norm before clipping.

    DeepSpeed clips inside its own step (`gradient_clipping` in its config; Fabric cannot clip for it).
    Fabric steps the ZeRO optimizer itself (the engine is not an optimizer to Fabric), so the engine's
    get_global_grad_norm() is never filled; the optimizer keeps the norm in `_global_grad_norm`.
    """
    if isinstance(fabric.strategy, DeepSpeedStrategy):
        optimizer.step()
        return getattr(fabric.strategy.model.optimizer, "_global_grad_norm", None)
    grad_norm = fabric.clip_gradients(model, optimizer, max_norm=max_norm) if max_norm > 0 else None
    optimizer.step()
    return grad_norm


def discard_gradients(fabric: Fabric) -> None:
    """Drop what a skipped update (a non-finite loss) leaves behind besides the gradients `zero_grad` clears.

    Only DeepSpeed ZeRO-3 keeps more: reduced gradient partitions that its own step would consume.
    They are dropped the way DeepSpeed drops them when it skips a step itself (`_overflow_clean_up`,
    not public API); left in place, the next update goes wrong (tests/test_deepspeed.py).
    """
    if not isinstance(fabric.strategy, DeepSpeedStrategy):
        return
    zero_optimizer = fabric.strategy.model.optimizer
    if hasattr(zero_optimizer, "_overflow_clean_up"):  # ZeRO-3; ZeRO-1/2 need nothing beyond zero_grad
        zero_optimizer._overflow_clean_up(zero_optimizer.loss_scale)


def data_parallel_rank_and_size(fabric: Fabric) -> tuple[int, int]:
    """This process's data-parallel rank and their number; tensor-parallel peers share a rank and a batch."""
    sampler = cast(ParallelStrategy, fabric.strategy).distributed_sampler_kwargs or {}
    return sampler.get("rank", fabric.global_rank), sampler.get("num_replicas", fabric.world_size)
