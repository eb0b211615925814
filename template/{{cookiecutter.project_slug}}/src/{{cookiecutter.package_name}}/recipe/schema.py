"""The schema of a recipe: typed dataclasses that YAML files and command-line overrides both fill.

Every knob of the machinery is a field here, its choices a `Literal` and its range `bounds` beside its default
(recipe/bounds.py); a task adds its own `model:` and `data:` sections (tasks/<task>/config.py, a subclass of
`Recipe`). `recipe/load.py` reads a recipe into the task's `Recipe`, recipe/typecheck.py refuses a value outside
its field's choices or bounds and `recipe/checks.py` combinations that cannot run. Code elsewhere names a field
through `field_path`, never by spelling its path. No torch import.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from ..precision import Precision
from ..project import DEFAULT_LOGGER, PROJECT, TASK
from .bounds import bounds
from .strategy_schema import (  # the strategy: section, its own module
    STRATEGY_SECTIONS,
    DeepSpeedOptions,
    Fsdp2Options,
    FsdpOptions,
    Offload,
    StrategyConfig,
)

__all__ = [
    "STRATEGY_SECTIONS",
    "CheckpointConfig",
    "DeepSpeedOptions",
    "EvalConfig",
    "Fsdp2Options",
    "FsdpOptions",
    "LoggerConfig",
    "Offload",
    "ProfileConfig",
    "Recipe",
    "StrategyConfig",
    "TrainConfig",
    "field_path",
    "section_path",
]


@dataclass
class TrainConfig:
    """The optimisation.

    Args:
        max_steps: Optimizer steps to run in total (a resumed run continues up to this number).
        micro_batch_size: Samples (sequences, images, ...) per device per forward/backward pass.
        grad_accum_steps: Micro-batches accumulated per optimizer step; the global batch is
            micro_batch_size * grad_accum_steps * data-parallel world size.
        learning_rate: Peak learning rate, reached after the warmup.
        min_learning_rate: Learning rate at the end of the decay (at max_steps).
        warmup_steps: Steps of linear warmup from 0 to learning_rate.
        schedule: The learning rate after the warmup: cosine (decays from the peak to min_learning_rate over
            the rest of the run) or wsd (warmup-stable-decay: the peak until the last decay_fraction of
            max_steps, then a linear decay to min_learning_rate; a longer run needs only a new decay).
        decay_fraction: wsd only: the share of max_steps spent in the final decay, in (0, 1].
        weight_decay: AdamW weight decay, applied to matrices only (not to norms and biases).
        beta1: AdamW beta1.
        beta2: AdamW beta2.
        grad_clip: Clip the global gradient norm to this value; 0 disables clipping.
        seed: Seed for the model initialisation and the data order.
        on_nonfinite_loss: What a step whose loss is NaN or infinite on any rank does: stop (exit
            code 3 with a message naming the step; the last checkpoint is kept) or skip (every rank
            skips that optimizer update, the step still counts and consumes its batch, and
            train/skipped_updates is logged).
    """

    # The upper bounds guard what later overflows or cannot be allocated (Lightning seeds with 32-bit seeds).
    max_steps: int = field(default=100, metadata=bounds(at_least=1, at_most=10**12))
    micro_batch_size: int = field(default=8, metadata=bounds(at_least=1, at_most=2**20))
    grad_accum_steps: int = field(default=1, metadata=bounds(at_least=1, at_most=2**20))
    learning_rate: float = field(default=1e-3, metadata=bounds(above=0))
    min_learning_rate: float = field(default=1e-4, metadata=bounds(at_least=0))
    warmup_steps: int = field(default=10, metadata=bounds(at_least=0))
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: float = field(default=0.2, metadata=bounds(above=0, at_most=1, note="a share of train.max_steps"))
    weight_decay: float = field(default=0.1, metadata=bounds(at_least=0))
    beta1: float = field(default=0.9, metadata=bounds(at_least=0, below=1))
    beta2: float = field(default=0.95, metadata=bounds(at_least=0, below=1))
    grad_clip: float = field(default=1.0, metadata=bounds(at_least=0))
    seed: int = field(default=1337, metadata=bounds(at_least=0, at_most=2**32 - 1))
    on_nonfinite_loss: Literal["stop", "skip"] = "stop"

    @property
    def wsd_decay_steps(self) -> int:
        """Steps of the wsd schedule's final decay (at least 1)."""
        return max(1, round(self.decay_fraction * self.max_steps))


@dataclass
class EvalConfig:
    """Periodic validation.

    Args:
        every_steps: Validate every this many steps and at the end; 0 disables validation.
        batches: Micro-batches per device in one validation pass.
    """

    every_steps: int = field(default=50, metadata=bounds(at_least=0))
    batches: int = field(default=4, metadata=bounds(at_least=1))


@dataclass
class CheckpointConfig:
    """Saving and resuming.

    Args:
        save_every_steps: Save every this many steps (and always at the end); 0 disables step-based saving.
        save_every_minutes: Also save when this many minutes of wall time passed since the last save; 0 disables.
            auto: save once after the first step, measure what that save blocked training for (C, the slowest
            rank's), then save every sqrt(2 C M) of wall time, M being checkpoint.mtbf_hours (Young's interval:
            it maximises goodput; `plan --mtbf` prints it before a run).
        mtbf_hours: The job's mean time between failures, in hours: what save_every_minutes=auto weighs the
            save cost against (null: not known, and auto is refused).
        keep_last: Keep only the newest K complete checkpoints; 0 keeps all.
        async_save: Write sharded checkpoints in the background (fsdp2 only); the loop blocks only for
            the copy to host memory, and the next save or the end of training waits for the previous one.
        resume: null starts fresh; auto continues from the newest complete checkpoint under out_dir
            (fresh if there is none); a path continues from that checkpoint folder.
        stop_deadline_seconds: After a stop signal (SLURM's USR1 before the time limit, TERM), how long the
            step in progress may take to end before the run stops without saving (requeued all the same:
            it resumes from the newest checkpoint). Keep it below the notice the scheduler gives
            (`--signal=USR1@120`) minus the time a save takes. A second signal stops at once.
        hang_timeout_minutes: A rank that makes no progress for this long in one phase of a step (data,
            forward-backward, step-decision, optimizer) ends as hung: it names its step and phase, prints its
            threads' stacks, and stops as at the stop deadline (requeued, exit 75). The first step, a save,
            validation and the eval benchmarks may take 4 times as long. Keep it below
            strategy.timeout_minutes, which ends a hung collective as a crash; 0 disables.
        max_failures: How many times a launcher that restarts a failed run starts it again (`ray`: Ray Train
            ends the worker group when a worker dies and starts a new one); each restart resumes from the
            newest complete checkpoint. 0 never restarts; -1 restarts without limit.
        on_provenance_change: What a resume does when its checkpoint was made by another commit of the code
            (or another diff of it) or other versions of python, torch, lightning, the task's packages, CUDA
            or NCCL: warn names what changed in one line and continues; error refuses to start (exit 2).
    """

    save_every_steps: int = field(default=50, metadata=bounds(at_least=0))
    save_every_minutes: float | Literal["auto"] = field(default=0.0, metadata=bounds(at_least=0))
    mtbf_hours: float | None = field(default=None, metadata=bounds(above=0))
    keep_last: int = field(default=0, metadata=bounds(at_least=0))
    async_save: bool = False
    resume: str | None = None
    stop_deadline_seconds: float = field(default=60.0, metadata=bounds(above=0, at_most=86_400))
    hang_timeout_minutes: float = field(default=20.0, metadata=bounds(at_least=0, at_most=10_080))
    max_failures: int = field(default=3, metadata=bounds(at_least=-1))
    on_provenance_change: Literal["warn", "error"] = "warn"


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
            GPU up in the table in hardware.py (no MFU on CPUs or GPUs missing from it).
        upload_final_weights: wandb only: when a run completes, log the final checkpoint's weights
            (consolidated into one file on rank 0) as a W&B model artifact of the run. Off by default:
            it uploads the whole model.
        straggler_margin: Name the slowest rank in the log when its step time or data wait exceeds
            the median over ranks by this fraction of the median step time (0.2: 20%).
        fingerprint: Append every step's loss, gradient norm and a hash of the parameters to
            <out_dir>/fingerprints.jsonl, to find the first step where two runs part
            (`checkpoint compare --fingerprints`). Off by default: each rank hashes its parameters every step.
    """

    name: Literal["wandb", "tensorboard", "csv", "none"] = DEFAULT_LOGGER  # type: ignore[assignment]
    project: str = PROJECT
    entity: str | None = None
    run_name: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)
    log_every_steps: int = field(default=10, metadata=bounds(at_least=1))
    peak_tflops: float | None = field(default=None, metadata=bounds(above=0, note="or null to use the GPU table"))
    upload_final_weights: bool = False
    straggler_margin: float = field(default=0.2, metadata=bounds(at_least=0, note="0.2: 20% over the median"))
    fingerprint: bool = False


@dataclass
class ProfileConfig:
    """Profiler traces and memory snapshots of chosen steps; nothing is recorded outside them.

    Args:
        steps: Optimizer steps to profile (1 is the first step); consecutive steps share one trace.
            Each profiled rank writes a Chrome trace (Perfetto, TensorBoard, chrome://tracing) to
            <out_dir>/profile/steps-<first>-<last>/rank<r>.pt.trace.json; with logger.name=wandb the
            traces are saved with the run's files too.
        ranks: Global ranks that profile; empty profiles every rank.
        memory: Record memory with the traces: the profiler's memory events (CPU and GPU); on GPUs
            also the CUDA allocator's history, dumped as a snapshot beside the trace (open it at
            pytorch.org/memory_viz).
        with_stack: Record the Python stack of each operation (larger traces, more overhead).
        snapshot_on_oom: GPUs only: record the CUDA allocator's history for the whole run and dump a
            snapshot when a step runs out of memory (recording costs a little on every allocation).
    """

    steps: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=lambda: [0])
    memory: bool = True
    with_stack: bool = False
    snapshot_on_oom: bool = False


@dataclass
class Recipe:
    """Everything a training run does.

    Args:
        accelerator: cpu, cuda, or auto (cuda when a GPU is visible).
        devices: Processes (one per device) per node.
        num_nodes: Number of nodes.
        precision: 32-true, bf16-mixed, bf16-true, 16-mixed (GPU, ddp only) or 16-true.
        out_dir: Folder for checkpoints and logs of this run.
        task: What is trained and how it is measured (tasks/ lists them); it decides what the model
            and data sections hold.
        model: The task's model section (tasks/<task>/config.py).
        data: The task's data section (tasks/<task>/config.py).
        profile: Profiler traces and memory snapshots of chosen steps (off unless profile.steps is set).
    """

    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    devices: int = field(default=1, metadata=bounds(at_least=1, at_most=4096))
    num_nodes: int = field(default=1, metadata=bounds(at_least=1, at_most=100_000))
    precision: Precision = "32-true"
    out_dir: str = "runs/default"
    task: str = TASK
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    model: Any = None  # each task's Recipe subclass gives these two sections their types
    data: Any = None
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)

    @property
    def world_size(self) -> int:
        """Total number of processes."""
        return self.devices * self.num_nodes

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as plain data (what is logged and saved beside checkpoints).

        Options sections of other strategy families (null) are left out.
        """
        data = dataclasses.asdict(self)
        for section in STRATEGY_SECTIONS:
            if data["strategy"][section] is None:
                del data["strategy"][section]
        return data


def field_path(section: Any, name: str) -> str:
    """The dotted path of field `name` of a recipe section (a dataclass of the schema, or an instance of one):
    `field_path(TrainConfig, "max_steps")` is "train.max_steps", `field_path(Recipe, "devices")` "devices".

    Code that names a field in a message or an override asks here rather than spelling the path, so a renamed
    field or section fails where it is named. Raises LookupError when the section has no such field, or sits at
    no place, or at more than one, in the recipes (Recipe and each task's subclass of it).
    """
    cls = section if isinstance(section, type) else type(section)
    if not dataclasses.is_dataclass(cls) or name not in {f.name for f in dataclasses.fields(cls)}:
        raise LookupError(f"{cls.__name__} has no recipe field {name!r}")
    prefix = section_path(cls)
    return f"{prefix}.{name}" if prefix else name


def section_path(section: Any) -> str:
    """Where a recipe section (a dataclass of the schema, or an instance of one) sits in a recipe: "strategy.fsdp2";
    "" for a Recipe. Raises LookupError when it sits at no place, or at more than one, in the recipes."""
    cls = section if isinstance(section, type) else type(section)
    places = {prefix for recipe in _recipe_types() for found, prefix in _sections(recipe, "") if found is cls}
    if len(places) != 1:
        raise LookupError(f"{cls.__name__} sits at {len(places)} places in the recipes ({sorted(places)}), not one")
    return places.pop().removesuffix(".")


def _recipe_types() -> Iterator[type]:
    """Recipe and every subclass of it defined so far (each task's config.py adds one)."""
    pending: list[type] = [Recipe]
    while pending:
        recipe = pending.pop()
        pending += recipe.__subclasses__()
        yield recipe


def _sections(cls: type, prefix: str) -> Iterator[tuple[type, str]]:
    """(section dataclass, its path's prefix: "strategy.fsdp2.") of `cls` at `prefix` and of every section under it."""
    yield cls, prefix
    hints = typing.get_type_hints(cls)
    for member in dataclasses.fields(cls):
        annotation = hints[member.name]
        is_union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
        for kind in typing.get_args(annotation) if is_union else (annotation,):
            if isinstance(kind, type) and dataclasses.is_dataclass(kind):
                yield from _sections(kind, f"{prefix}{member.name}.")
