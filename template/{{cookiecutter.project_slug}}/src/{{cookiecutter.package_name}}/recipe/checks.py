"""Every rule a recipe must satisfy: field bounds, the task's and the strategy's own rules, and the hardware rules.

`check_recipe` runs when a recipe is parsed, before torch is imported and before any process starts
or file is written. `check_hardware` is the one function for what the machine must have; it runs at
parse time with the recipe's accelerator and again at launch with the device actually found.
"""

from __future__ import annotations

import importlib.util
import netrc
import os
from pathlib import Path
from typing import Any

from ..errors import RecipeError
from ..precision import BF16_CAPABILITY, GPU_ONLY
from .registry import STRATEGIES, strategy_for, task_for
from .schema import STRATEGY_SECTIONS, CheckpointConfig, Recipe, TrainConfig, field_path
from .typecheck import check_values


def check_recipe(recipe: Recipe) -> None:
    """Reject values and combinations that cannot run, naming the field and what is allowed."""
    check_values(recipe)  # each field's choices and bounds, as the schema declares them
    _check_relations(recipe)
    task_for(recipe).check()
    check_strategy(recipe)
    if recipe.accelerator == "cpu":
        check_hardware(recipe, "cpu")


def _check_relations(recipe: Recipe) -> None:
    """The rules that relate fields of the machinery's sections, or that no bound says."""
    if recipe.logger.upload_final_weights and recipe.logger.name != "wandb":
        raise RecipeError(
            f"logger.upload_final_weights=true uploads a W&B artifact: it needs logger.name=wandb,"
            f" not {recipe.logger.name}"
        )
    _check_profile(recipe)
    if recipe.train.min_learning_rate > recipe.train.learning_rate:
        raise RecipeError(
            f"train.min_learning_rate={recipe.train.min_learning_rate} must not exceed"
            f" train.learning_rate={recipe.train.learning_rate}"
        )
    _check_schedule(recipe.train)
    if recipe.strategy.activation_checkpointing_policy != "full" and not recipe.strategy.activation_checkpointing:
        raise RecipeError(
            f"strategy.activation_checkpointing_policy={recipe.strategy.activation_checkpointing_policy} needs"
            " strategy.activation_checkpointing=true"
        )
    if recipe.checkpoint.resume is not None and not recipe.checkpoint.resume.strip():
        raise RecipeError("checkpoint.resume must be null, auto, or a checkpoint path")
    if recipe.checkpoint.save_every_minutes == "auto" and recipe.checkpoint.mtbf_hours is None:
        raise RecipeError(
            f"{field_path(CheckpointConfig, 'save_every_minutes')}=auto needs"
            f" {field_path(CheckpointConfig, 'mtbf_hours')}: the job's mean time between failures in hours (such as"
            " 8), or give save_every_minutes a number"
        )


# More steps than this in one run make traces too large to open.
MAX_PROFILED_STEPS = 100


def _check_profile(recipe: Recipe) -> None:
    """profile.steps within the run's steps and not too many, profile.ranks within its processes."""
    profile, max_steps, world_size = recipe.profile, recipe.train.max_steps, recipe.world_size
    steps = sorted(set(profile.steps))
    if len(steps) > MAX_PROFILED_STEPS:
        raise RecipeError(
            f"profile.steps=[{steps[0]}, ..., {steps[-1]}] names {len(steps)} steps; at most {MAX_PROFILED_STEPS}"
            " (each one adds to the traces)"
        )
    if outside := [step for step in steps if not 1 <= step <= max_steps]:
        raise RecipeError(f"profile.steps={outside} must be steps from 1 to train.max_steps={max_steps}")
    if outside := sorted({rank for rank in profile.ranks if not 0 <= rank < world_size}):
        raise RecipeError(
            f"profile.ranks={outside} must be global ranks from 0 to {world_size - 1}"
            f" (devices x num_nodes = {world_size}), or [] for every rank"
        )


def _check_schedule(train: TrainConfig) -> None:
    """The warmup-stable-decay schedule's decay fits in the run after the warmup."""
    if train.schedule != "wsd":
        return
    if train.warmup_steps + (decay_steps := train.wsd_decay_steps) > train.max_steps:
        raise RecipeError(
            f"train.schedule=wsd: train.warmup_steps={train.warmup_steps} and the decay's {decay_steps} steps"
            f" (train.decay_fraction={train.decay_fraction} of {train.max_steps}) exceed train.max_steps={train.max_steps}"
        )


def check_strategy(recipe: Recipe) -> None:
    """The strategy exists, carries only its own options section, and accepts the recipe."""
    family = STRATEGIES(recipe.strategy.name)
    for section in STRATEGY_SECTIONS:
        if getattr(recipe.strategy, section) is not None and section != family.options_key:
            owners = " or ".join(name for name, other in STRATEGIES.classes.items() if other.options_key == section)
            raise RecipeError(
                f"strategy.{section} applies only to strategy.name={owners} (this recipe has {family.name};"
                " remove the section or change the strategy)"
            )
    if recipe.strategy.meta_init and not family.supports_meta_init:
        names = " or ".join(name for name, other in STRATEGIES.classes.items() if other.supports_meta_init)
        raise RecipeError(
            f"strategy.meta_init=True applies only to strategy.name={names}"
            f" (this recipe has {family.name}; remove the key or change the strategy)"
        )
    if adapters := task_for(recipe).adapters():
        if not family.trains_adapters:
            names = " or ".join(name for name, other in STRATEGIES.classes.items() if other.trains_adapters)
            raise RecipeError(f"{adapters} trains adapters under strategy.name={names} (this recipe has {family.name})")
        if recipe.strategy.meta_init:  # the model's own init (materialize) knows no adapters
            raise RecipeError(
                f"{adapters} does not compose with strategy.meta_init=true (adapters take their init when built):"
                " set it false"
            )
    strategy = family(recipe)
    strategy.check()
    if recipe.checkpoint.async_save and strategy.checkpoint_layout != "sharded":
        names = " or ".join(name for name, other in STRATEGIES.classes.items() if other.checkpoint_layout == "sharded")
        raise RecipeError(
            f"checkpoint.async_save=true needs torch.distributed.checkpoint shards (strategy.name {names}),"
            f" not strategy.name={family.name}"
        )


def check_hardware(
    recipe: Recipe, accelerator: str, capability: tuple[int, int] | None = None, found: bool = False
) -> None:
    """Reject a recipe the hardware cannot run.

    `accelerator` is cpu or cuda; `capability` the GPU's CUDA compute capability when known; `found`
    says the accelerator was detected on this machine (at launch) rather than read from the recipe.
    """
    requirement = strategy_for(recipe).gpu_requirement()
    if accelerator == "cpu":
        where = " and this machine has none" if found else " (accelerator=cpu)"
        if requirement is not None:
            raise RecipeError(
                f"{requirement.field} needs {requirement.needs}{where} ({requirement.why}); on CPU {requirement.remedy}"
            )
        if recipe.precision in GPU_ONLY:
            raise RecipeError(
                f"precision={recipe.precision} needs a GPU{where}; on CPU choose 32-true, bf16-mixed or bf16-true"
            )
        if recipe.strategy.process_group_backend == "nccl":
            raise RecipeError(f"strategy.process_group_backend=nccl needs GPUs{where}; use gloo or null on CPU")
        return
    if capability is None:
        return
    version = ".".join(map(str, capability))
    if recipe.precision.startswith("bf16") and capability < BF16_CAPABILITY:
        raise RecipeError(
            f"precision={recipe.precision} needs a GPU with bf16 (compute capability 8.0+, A100 or newer);"
            f" this GPU has {version}: choose 16-mixed or 32-true"
        )
    if requirement is not None and requirement.capability is not None and capability < requirement.capability:
        needed = ".".join(map(str, requirement.capability))
        raise RecipeError(
            f"{requirement.field} needs compute capability {needed}+ (H100, L4, ...); this GPU has {version}"
        )
    check_package(requirement)


def check_package(requirement: Any) -> None:
    """The package a strategy's option needs (`gpu_requirement()`'s: torchao for float8) is installed, or one line
    naming its extra."""
    if requirement is not None and requirement.package and importlib.util.find_spec(requirement.package) is None:
        install = (
            f"pip install -e '.[{requirement.extra}]'" if requirement.extra else f"pip install {requirement.package}"
        )
        raise RecipeError(f"{requirement.field} needs {requirement.package}: {install}")


def needs_gpu(recipe: Recipe) -> bool:
    """Whether the recipe can only run on CUDA GPUs."""
    return recipe.accelerator == "cuda" or strategy_for(recipe).gpu_requirement() is not None


def check_before_launch(recipe: Recipe) -> None:
    """The rules that depend on this machine rather than on the recipe: the logger's credentials and out_dir.

    Runs in every process before processes are launched; out_dir is probed last, since the probe
    creates the folder (the run would create it next anyway).
    """
    if recipe.logger.name == "wandb" and os.environ.get("WANDB_MODE") == "online" and not wandb_has_credentials():
        raise RecipeError(
            "logger.name=wandb with WANDB_MODE=online needs W&B credentials: set WANDB_API_KEY or run `wandb login`"
            " (or unset WANDB_MODE to log offline and `wandb sync` later)"
        )
    probe_out_dir(Path(recipe.out_dir))


def wandb_has_credentials() -> bool:
    """Whether W&B can go online: an API key in the environment or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def probe_out_dir(out_dir: Path) -> None:
    """Create out_dir if needed, then write and remove a file in it: refused here, not at the first save."""
    if out_dir.exists() and not out_dir.is_dir():
        raise RecipeError(
            f"out_dir={str(out_dir)!r} is a file, not a folder (choose a folder for checkpoints and logs)"
        )
    probe = out_dir / f".write-probe-{os.getpid()}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        raise RecipeError(
            f"out_dir={str(out_dir)!r} is not a writable folder ({error.strerror}: {error.filename}); choose another"
        ) from None
