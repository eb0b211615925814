"""The schema of a recipe: typed dataclasses that YAML files and command-line overrides both fill.

Every knob a run has is a field here. `parse_recipe` reads a recipe file plus dotted overrides
(`--train.max_steps 20`), rejects unknown keys and bad values with one line naming the field, and
`check_recipe` rejects combinations that cannot run (for example an impossible device layout).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.strategy_config import GPU_ONLY_STRATEGIES, MODEL_PARALLEL, StrategyConfig, check_strategy

Precision = Literal["32-true", "bf16-mixed", "bf16-true", "16-mixed", "16-true"]


@dataclass
class ModelConfig:
    """A decoder-only GPT; the defaults make a tiny model that trains on a laptop CPU.

    Args:
        vocab_size: Size of the token vocabulary (256 for the byte-level text data).
        block_size: Context length in tokens.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide n_embd.
        n_embd: Width of the residual stream.
        mlp_ratio: Hidden width of the MLP as a multiple of n_embd.
        dropout: Dropout probability (0 for pre-training).
        bias: Whether linear and norm layers have a bias.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0
    bias: bool = False


@dataclass
class DataConfig:
    """Where the tokens come from.

    Args:
        source: embedded (a corpus made in code, offline, no download), text (a folder of .txt
            files, byte-level tokens), tokens (a flat binary file of token ids, read by memory map)
            or prepared (a folder written by `prepare`: token shards, tokenizer, manifest).
        path: The folder (text, prepared) or file (tokens); unused for embedded.
        token_dtype: Integer type of the token file (uint16 for vocabularies up to 65536); a
            prepared folder states its own.
        val_fraction: Fraction of the tokens held out, at the end, for validation; a prepared
            folder brings its own split (`prepare --val-fraction`).
    """

    source: Literal["embedded", "text", "tokens", "prepared"] = "embedded"
    path: str | None = None
    token_dtype: Literal["uint16", "uint32"] = "uint16"
    val_fraction: float = 0.1


@dataclass
class TrainConfig:
    """The optimisation.

    Args:
        max_steps: Optimizer steps to run in total (a resumed run continues up to this number).
        micro_batch_size: Sequences per device per forward/backward pass.
        grad_accum_steps: Micro-batches accumulated per optimizer step; the global batch is
            micro_batch_size * grad_accum_steps * data-parallel world size.
        learning_rate: Peak learning rate, reached after the warmup.
        min_learning_rate: Learning rate at the end of the cosine decay.
        warmup_steps: Steps of linear warmup from 0 to learning_rate.
        weight_decay: AdamW weight decay, applied to matrices only (not to norms and biases).
        beta1: AdamW beta1.
        beta2: AdamW beta2.
        grad_clip: Clip the global gradient norm to this value; 0 disables clipping.
        seed: Seed for the model initialisation and the data order.
        on_nonfinite_loss: What a step whose loss is NaN or infinite on any rank does: stop (exit
            code 3 with a message naming the step; the last checkpoint is kept) or skip (every rank
            skips that optimizer update, the step still counts and consumes its batch, and
            train/skipped_steps is logged).
    """

    max_steps: int = 100
    micro_batch_size: int = 8
    grad_accum_steps: int = 1
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    seed: int = 1337
    on_nonfinite_loss: Literal["stop", "skip"] = "stop"


@dataclass
class EvalConfig:
    """Periodic validation.

    Args:
        every_steps: Validate every this many steps and at the end; 0 disables validation.
        batches: Micro-batches per device in one validation pass.
    """

    every_steps: int = 50
    batches: int = 4


@dataclass
class CheckpointConfig:
    """Saving and resuming.

    Args:
        save_every_steps: Save every this many steps (and always at the end); 0 disables step-based saving.
        save_every_minutes: Also save when this many minutes of wall time passed since the last save; 0 disables.
        keep_last: Keep only the newest K complete checkpoints; 0 keeps all.
        async_save: Write sharded checkpoints in the background (fsdp2 only); the loop blocks only for
            the copy to host memory, and the next save or the end of training waits for the previous one.
        resume: null starts fresh; auto continues from the newest complete checkpoint under out_dir
            (fresh if there is none); a path continues from that checkpoint folder.
    """

    save_every_steps: int = 50
    save_every_minutes: float = 0.0
    keep_last: int = 0
    async_save: bool = False
    resume: str | None = None


@dataclass
class LoggerConfig:
    """Experiment tracking and what a run reports; only rank 0 logs and prints.

    Credentials are never recipe fields: W&B reads its API key from WANDB_API_KEY or from
    `wandb login` (~/.netrc), so no key can end up in a logged config or a checkpoint.

    Args:
        name: wandb (offline when no API key is configured, or when WANDB_MODE=offline), tensorboard,
            csv, or none. All log the same metrics.
        project: W&B project name.
        entity: W&B team or user that owns the project; null uses the account's default.
        run_name: Name of the run (W&B display name, TensorBoard/CSV folder); null lets the logger choose.
        group: W&B group, to show related runs (for example the jobs of one sweep) together.
        tags: W&B tags of the run.
        log_every_steps: Log metrics and print a progress line every this many steps.
        peak_tflops: Dense peak TFLOP/s of one device at the run's precision, for MFU; null looks the
            GPU up in the table in observe.py (no MFU on CPUs or GPUs missing from it).
    """

    name: Literal["wandb", "tensorboard", "csv", "none"] = "{{ cookiecutter.logger }}"
    project: str = "{{ cookiecutter.project_slug }}"
    entity: str | None = None
    run_name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    log_every_steps: int = 10
    peak_tflops: float | None = None


@dataclass
class Recipe:
    """Everything a training run does.

    Args:
        accelerator: cpu, cuda, or auto (cuda when a GPU is visible).
        devices: Processes (one per device) per node.
        num_nodes: Number of nodes.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed (GPU, ddp only) or 16-true.
        out_dir: Folder for checkpoints and logs of this run.
    """

    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int = 1
    num_nodes: int = 1
    precision: Precision = "32-true"
    out_dir: str = "runs/default"
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    @property
    def world_size(self) -> int:
        """Total number of processes."""
        return self.devices * self.num_nodes

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what is logged and saved beside checkpoints)."""
        return dataclasses.asdict(self)


def recipe_parser(prog: str = "train") -> ArgumentParser:
    """A parser for a recipe file plus dotted command-line overrides."""
    parser = ArgumentParser(prog=prog, exit_on_error=False, description="Train with a recipe.")
    parser.add_argument("--config", action=ActionConfigFile, help="Recipe YAML file.")
    parser.add_class_arguments(Recipe, nested_key=None, fail_untyped=True)
    return parser


def parse_recipe(argv: list[str], parser: ArgumentParser | None = None) -> Recipe:
    """Parse and check a recipe; raises RecipeError with a one-line message."""
    parser = parser or recipe_parser()
    source = _config_source(argv)
    try:
        namespace = parser.parse_args(argv)
    except Exception as error:  # jsonargparse raises ArgumentError; its text spans lines
        raise RecipeError(_one_line(str(error), source)) from None
    values = parser.instantiate(namespace).as_dict()
    values.pop("config", None)
    recipe = Recipe(**{f.name: values[f.name] for f in dataclasses.fields(Recipe)})
    try:
        check_recipe(recipe)
    except RecipeError as error:
        raise RecipeError(f"{source}: {error}") from None
    return recipe


def load_recipe(path: str | Path) -> Recipe:
    """Parse and check one recipe file."""
    return parse_recipe(["--config", str(path)])


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as YAML that `load_recipe` reads back."""
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)


def check_recipe(recipe: Recipe) -> None:
    """Reject values and combinations that cannot run, naming the field and what is allowed."""
    at_least = {
        "devices": (recipe.devices, 1),
        "num_nodes": (recipe.num_nodes, 1),
        "strategy.timeout_minutes": (recipe.strategy.timeout_minutes, 1),
        "strategy.tensor_parallel_size": (recipe.strategy.tensor_parallel_size, 1),
        "strategy.activation_checkpointing_every": (recipe.strategy.activation_checkpointing_every, 1),
        "model.vocab_size": (recipe.model.vocab_size, 1),
        "model.block_size": (recipe.model.block_size, 1),
        "model.n_layer": (recipe.model.n_layer, 1),
        "model.n_head": (recipe.model.n_head, 1),
        "model.n_embd": (recipe.model.n_embd, 1),
        "model.mlp_ratio": (recipe.model.mlp_ratio, 1),
        "train.max_steps": (recipe.train.max_steps, 1),
        "train.micro_batch_size": (recipe.train.micro_batch_size, 1),
        "train.grad_accum_steps": (recipe.train.grad_accum_steps, 1),
        "train.warmup_steps": (recipe.train.warmup_steps, 0),
        "train.weight_decay": (recipe.train.weight_decay, 0),
        "train.grad_clip": (recipe.train.grad_clip, 0),
        "train.min_learning_rate": (recipe.train.min_learning_rate, 0),
        "eval.every_steps": (recipe.eval.every_steps, 0),
        "eval.batches": (recipe.eval.batches, 1),
        "checkpoint.save_every_steps": (recipe.checkpoint.save_every_steps, 0),
        "checkpoint.save_every_minutes": (recipe.checkpoint.save_every_minutes, 0),
        "checkpoint.keep_last": (recipe.checkpoint.keep_last, 0),
        "logger.log_every_steps": (recipe.logger.log_every_steps, 1),
    }
    for name, (value, minimum) in at_least.items():
        if value < minimum:
            raise RecipeError(f"{name}={value} must be >= {minimum}")
    if recipe.logger.peak_tflops is not None and not recipe.logger.peak_tflops > 0:
        raise RecipeError(f"logger.peak_tflops={recipe.logger.peak_tflops} must be > 0 (or null to use the GPU table)")
    if not recipe.train.learning_rate > 0:
        raise RecipeError(f"train.learning_rate={recipe.train.learning_rate} must be > 0")
    if recipe.train.min_learning_rate > recipe.train.learning_rate:
        raise RecipeError(
            f"train.min_learning_rate={recipe.train.min_learning_rate} must not exceed"
            f" train.learning_rate={recipe.train.learning_rate}"
        )
    for name, value in (("train.beta1", recipe.train.beta1), ("train.beta2", recipe.train.beta2)):
        if not 0 <= value < 1:
            raise RecipeError(f"{name}={value} must be in [0, 1)")
    if not 0 <= recipe.model.dropout < 1:
        raise RecipeError(f"model.dropout={recipe.model.dropout} must be in [0, 1)")
    if recipe.model.n_embd % recipe.model.n_head:
        raise RecipeError(f"model.n_head={recipe.model.n_head} does not divide model.n_embd={recipe.model.n_embd}")
    if not 0 < recipe.data.val_fraction < 1:
        raise RecipeError(f"data.val_fraction={recipe.data.val_fraction} must be in (0, 1)")
    if recipe.data.source != "embedded" and not recipe.data.path:
        raise RecipeError(f"data.path is required when data.source={recipe.data.source}")
    if recipe.data.source == "embedded" and recipe.model.vocab_size < 256:
        raise RecipeError(
            f"model.vocab_size={recipe.model.vocab_size} is too small for data.source=embedded"
            " (byte-level tokens need 256)"
        )
    if recipe.checkpoint.resume is not None and not recipe.checkpoint.resume.strip():
        raise RecipeError("checkpoint.resume must be null, auto, or a checkpoint path")
    check_strategy(recipe)
    if recipe.checkpoint.async_save and recipe.strategy.name not in MODEL_PARALLEL:
        raise RecipeError(
            f"checkpoint.async_save=true needs torch.distributed.checkpoint shards (strategy.name fsdp2 or hsdp),"
            f" not strategy.name={recipe.strategy.name}"
        )
    if recipe.accelerator == "cpu":
        if recipe.precision in ("16-mixed", "16-true"):
            raise RecipeError(
                f"precision={recipe.precision} needs a GPU; on accelerator=cpu choose 32-true, bf16-mixed or bf16-true"
            )
        if recipe.strategy.process_group_backend == "nccl":
            raise RecipeError("strategy.process_group_backend=nccl needs GPUs; use gloo or null on CPU")


def needs_gpu(recipe: Recipe) -> bool:
    """Whether the recipe can only run on CUDA GPUs."""
    return recipe.accelerator == "cuda" or recipe.strategy.name in GPU_ONLY_STRATEGIES or recipe.strategy.float8


def _config_source(argv: list[str]) -> str:
    """Name of the recipe file in argv, for error messages."""
    for index, arg in enumerate(argv):
        if arg == "--config" and index + 1 < len(argv):
            return f"recipe {Path(argv[index + 1]).name!r}"
        if arg.startswith("--config="):
            return f"recipe {Path(arg.split('=', 1)[1]).name!r}"
    return "recipe"


def _one_line(message: str, source: str) -> str:
    """Condense a jsonargparse error (often several lines) into one line that names the field."""
    lines = [line.strip() for line in message.strip().splitlines() if line.strip()] or [message]
    text = lines[0]
    if key := re.match(r'Parser key "([^"]+)":\s*', text):
        rest = text[key.end() :] or (lines[1] if len(lines) > 1 else "")
        if key.group(1) == "config":  # the recipe file itself: missing or not YAML
            return f"{source}: {rest[:1].lower()}{rest[1:]}"
        detail = lines[1] if len(lines) > 1 else rest
        if literal := re.search(r"Literal\[(.*)\]\. Got value: (.*)", detail):
            detail = f"{literal.group(2)!r} is not allowed (choose one of {literal.group(1)})"
        elif expected := re.search(r"Expected a <class '(\w+)'>\. Got value: (.*)", detail):
            detail = f"expected {expected.group(1)}, got {expected.group(2)!r}"
        return f"{source}: {key.group(1)}: {detail}"
    if unknown := re.match(r"Option '([^']+)' is not accepted", text):
        return f"{source}: unknown key {unknown.group(1)!r} (allowed: {_fields_of(Recipe)})"
    if nested := re.match(r"Group '([^']+)' does not accept option '([^']+)'", text):
        group, option = nested.groups()
        allowed = _fields_of(_group_class(group))
        return f"{source}: unknown key '{group}.{option}' (allowed in {group}: {allowed})"
    return f"{source}: {text}"


def _group_class(group: str) -> Any:
    """The dataclass behind a dotted group name such as 'strategy'."""
    cls: Any = Recipe
    for part in group.split("."):
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        cls = globals()[types[part]] if isinstance(types.get(part), str) else types.get(part)
    return cls


def _fields_of(cls: Any) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))
