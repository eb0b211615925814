"""`setup(recipe) -> Run`: the Fabric, model, optimizer, schedule, data and state of a training run.

Built the way the recipe's strategy wants it (strategies/), and resumed when the recipe says so.
Everything that can refuse the recipe runs before any process is launched or file written. The loop
(train.py), the benchmarks and the tests all start a run through here.
"""

from __future__ import annotations

import socket
import warnings
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger

from ..checkpoint.layout import check_free_space, checkpoint_root, read_meta, resolve_resume
from ..checkpoint.load import load_checkpoint, verified_resume
from ..checkpoint.lock import lock_out_dir, out_dir_in_use
from ..checkpoint.provenance import check_resume, run_provenance
from ..checkpoint.tensors import trained_part
from ..cluster.launchers import check_launcher, launched_by_ray, launcher_name, start_processes
from ..cluster.prestart import CPU_PROCESSES_PER_CORE, cpu_process_limit, release
from ..data.sampler import Batch, TrainBatches, validation_batches
from ..errors import ExitCode, RecipeError, TrainingStopped
from ..progress import working
from ..recipe.checks import check_before_launch, check_hardware
from ..recipe.load import dump_recipe
from ..recipe.schema import Recipe
from ..strategies import TrainingStrategy, strategy_for
from ..tasks import Task, task_for
from ..tasks.base import Benchmarks
from .goodput import StartupClock
from .loggers import build_loggers, new_run_id
from .optim import build_optimizer, build_scheduler


@dataclass
class Run:
    """A training run, set up and (if the recipe says so) resumed; `state` is what a checkpoint holds."""

    recipe: Recipe
    task: Task
    strategy: TrainingStrategy
    fabric: Fabric
    model: Any  # Fabric's wrapper of the (sharded) model
    optimizer: Any  # Fabric's wrapper of the optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    batches: TrainBatches
    val_batches: list[Batch]
    state: dict[str, Any]
    resumed_from: Path | None
    benchmarks: Benchmarks | None = None  # the task's downstream benchmarks during training (eval.tasks)
    provenance: dict[str, Any] = field(default_factory=dict)  # code, versions, hosts, launcher (checkpoint/provenance)
    startup: StartupClock = field(default_factory=StartupClock)  # when each start-up phase ended (training/goodput.py)


def resolve_accelerator(recipe: Recipe) -> str:
    """The accelerator this machine will use for the recipe; refuses cuda where no GPU is visible."""
    has_cuda = torch.cuda.is_available()
    if recipe.accelerator == "cuda" and not has_cuda:
        raise RecipeError("accelerator=cuda but no CUDA GPU is visible on this machine (use accelerator=cpu or auto)")
    if recipe.accelerator == "auto":
        return "cuda" if has_cuda else "cpu"
    return recipe.accelerator


def check_machine(recipe: Recipe) -> str:
    """Refuse a layout this machine or its launcher cannot run (GPUs, cores, launcher flags); the accelerator."""
    # Lightning warns on any machine with srun that does not run under it (a login node, a CPU box with SLURM's
    # client): check_launcher below checks the launch instead, and the warning would make one-line errors two.
    warnings.filterwarnings("ignore", message="The `srun` command is available on your system but is not used")
    accelerator = resolve_accelerator(recipe)
    if accelerator == "cuda" and recipe.devices > torch.cuda.device_count():
        raise RecipeError(f"devices={recipe.devices} but this machine has {torch.cuda.device_count()} GPU(s)")
    if accelerator == "cpu" and recipe.devices > (limit := cpu_process_limit()):
        raise RecipeError(
            f"devices={recipe.devices} CPU processes on one node, but this machine has {limit // CPU_PROCESSES_PER_CORE}"
            f" core(s): at most {limit} ({CPU_PROCESSES_PER_CORE} per core)"
        )
    capability = torch.cuda.get_device_capability() if accelerator == "cuda" else None
    check_hardware(recipe, accelerator, capability, found=True)  # the same rules as at parse time, on this machine
    check_launcher(recipe, accelerator)  # fabric run / torchrun / srun must start the recipe's layout
    return accelerator


def build_fabric(
    recipe: Recipe, strategy: TrainingStrategy, loggers: list[Logger], accelerator: str | None = None
) -> Fabric:
    """A Fabric object for the recipe on this machine (processes are launched by `start_processes`); `accelerator`:
    this one instead of the machine's, unchecked (a rehearsal runs a GPU recipe on the CPU's fake tensors)."""
    accelerator = accelerator or check_machine(recipe)
    # Fabric finds the ranks (torchrun's, SLURM's, its own launch), except in a Ray Train worker: there they are
    # taken as Ray gave them, and each logging step is reported to Ray too (cluster/ray_worker.py).
    environment = None
    if launched_by_ray():
        from ..cluster.ray_worker import RayReport, RayTrainEnvironment

        environment, loggers = RayTrainEnvironment(), [*loggers, RayReport()]
    return Fabric(
        accelerator=accelerator,
        devices=recipe.devices,
        num_nodes=recipe.num_nodes,
        precision=recipe.precision,
        strategy=strategy.fabric_strategy(),
        loggers=loggers,
        plugins=environment,
    )


def setup(recipe: Recipe) -> Run:
    """Launch the processes and build everything the loop trains; resumes from a checkpoint if the recipe says so."""
    startup = StartupClock()
    startup.mark("imports")
    task, strategy = task_for(recipe), strategy_for(recipe)
    splits = task.datasets()  # refuses data that is missing, too short or does not fit the model
    benchmarks = task.benchmarks()  # refuses tasks that are unknown or whose data is not here
    # One run per out_dir: a live run's lock refuses this one before its checkpoints are even read. Refused at once
    # when this process launches the others; under torchrun/srun/`fabric run` the other ranks already run and wait
    # for rank 0, so they hear the refusal from it once connected.
    in_use = out_dir_in_use(Path(recipe.out_dir))
    resume_from = None
    if not in_use:
        resume_from = resolve_resume(recipe)  # complete by its files' sizes; their digests are checked once launched
        if resume_from is not None:  # made by other code or packages: one line, or a refusal before anything is written
            check_resume(resume_from, recipe, task.key_packages)
        check_free_space(recipe)  # room for one more checkpoint, or no start at all
    # A resumed or requeued job appends to the W&B run of its checkpoint instead of starting a new one.
    run_id = (read_meta(resume_from).get("wandb_run_id") if resume_from else None) or new_run_id()
    fabric = build_fabric(recipe, strategy, build_loggers(recipe, run_id))
    if not in_use:
        check_before_launch(recipe)  # W&B credentials, out_dir writable: the last checks, nothing written before
        in_use = lock_out_dir(Path(recipe.out_dir))  # held until this process exits
    environment = getattr(fabric.strategy, "cluster_environment", None)  # none for one process
    if in_use and not (environment is not None and environment.creates_processes_externally):
        raise RecipeError(in_use)

    release(fabric)  # the ranks `train` started before its imports go now (cluster/prestart.py)
    start_processes(fabric)  # unless `fabric run` already did, or they were started early
    if in_use := fabric.broadcast(in_use):
        raise TrainingStopped(in_use, ExitCode.USAGE, report=fabric.global_rank == 0)
    startup.mark("rendezvous")
    provenance = run_provenance(task.key_packages, hostnames(fabric), launcher_name())
    fabric.seed_everything(recipe.train.seed)
    fabric.print(f"Recipe:\n{dump_recipe(recipe)}")
    # A resumed run has its own weights, except a frozen base under adapters: checkpoints hold only what trains.
    frozen_base = task.frozen_from_pretrained()
    weights_from = task.pretrained_from() if resume_from is None or frozen_base else None
    model = strategy.build_model(fabric, pretrained=weights_from is not None)  # sharded as built: meta_init, ZeRO-3
    model, optimizer, scheduled = strategy.setup(fabric, model, partial(build_optimizer, config=recipe.train))
    if weights_from is not None:
        strategy.load_pretrained(fabric, model)
        fabric.print(f"Started from the weights of {weights_from}")
    scheduler = build_scheduler(scheduled, recipe.train)

    dp_rank, dp_size = strategy.data_parallel_rank_and_size(fabric)  # tensor-parallel peers see the same batches
    micro_batch_size = recipe.train.micro_batch_size
    batches = TrainBatches(
        splits.train,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=recipe.train.grad_accum_steps,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=recipe.train.seed,
    )
    val_batches = validation_batches(
        splits.validation, micro_batch_size, recipe.eval.batches, dp_rank=dp_rank, dp_size=dp_size
    )
    state: dict[str, Any] = {
        "model": trained_part(model.module) if frozen_base else model,  # what a checkpoint holds of the model
        "optimizer": optimizer,
        "scheduler": scheduler,
        "data": batches,
        "step": 0,
        "units_seen": 0,  # tokens, images, ...: the task's unit
        "skipped_updates": 0,  # non-finite loss, on_nonfinite_loss=skip ("skipped_steps" is DeepSpeed's own key)
        "wandb_run_id": fabric.broadcast(run_id),  # rank 0's id: the one its logger writes to
    }
    startup.mark("model_build")  # and the optimizer, schedule and batches
    if resume_from is not None:
        resume_from = verified_resume(fabric, resume_from, recipe)  # every rank hashes a share of the files
        with working(f"Loading {resume_from}", enabled=fabric.global_rank == 0):
            load_checkpoint(fabric, resume_from, state, recipe)
        fabric.print(f"Resumed from {resume_from} at step {state['step']}")
        startup.mark("checkpoint_load")
    elif recipe.checkpoint.resume == "auto":
        fabric.print(f"No checkpoint under {checkpoint_root(recipe)}: starting from step 0")
    return Run(
        recipe,
        task,
        strategy,
        fabric,
        model,
        optimizer,
        scheduler,
        batches,
        val_batches,
        state,
        resume_from,
        benchmarks,
        provenance,
        startup,
    )


def hostnames(fabric: Fabric) -> list[str]:
    """The host of every rank, in rank order: gathered once, at the start of a run."""
    name = socket.gethostname()
    if fabric.world_size == 1 or not torch.distributed.is_initialized():
        return [name]
    names: list[Any] = [None] * fabric.world_size
    torch.distributed.all_gather_object(names, name)
    return [str(host) for host in names]
