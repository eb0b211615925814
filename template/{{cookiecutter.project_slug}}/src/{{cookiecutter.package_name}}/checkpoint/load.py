"""Reading checkpoints back: which one a run resumes (its files' digests checked), restoring a run's state from it
(also across strategies and process counts), and a whole checkpoint as one state dict in memory (`consolidate`,
`export`, `inspect`). Nothing here unpickles a file before checkpoint/safety.py has checked it."""

from __future__ import annotations

import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from ..errors import ExitCode, RecipeError, TrainingStopped
from ..recipe.registry import STRATEGIES
from ..recipe.schema import Recipe
from .layout import META_FILE, damaged_files, list_checkpoints, read_meta, removed_unless_finished, step_of
from .rng import set_rng_state
from .safety import check_sharded, load_tensors


def verified_resume(fabric: Fabric, path: Path, recipe: Recipe) -> Path:
    """The checkpoint to resume: `path` when its files match the digests in its meta.json; else, under
    checkpoint.resume=auto, the newest older checkpoint that does. Every rank hashes a share of the files, in
    parallel, and all hear the answer; refused (exit 2) when no checkpoint matches."""
    while True:
        started = time.perf_counter()
        names = sorted(read_meta(path).get("files", {}))
        rank, world = fabric.global_rank, fabric.world_size
        damaged = damaged_files(path, names[rank::world])
        if world > 1 and torch.distributed.is_initialized():
            shares: list[Any] = [None] * world
            torch.distributed.all_gather_object(shares, damaged)
            damaged = sorted(name for share in shares for name in share)
        if not damaged:
            fabric.print(
                f"Checked the digests of {len(names)} files of {path} in {time.perf_counter() - started:.1f} s"
            )
            return path
        why = f"checkpoint {path} is damaged: {', '.join(damaged[:3])} differ from the SHA-256 in its {META_FILE}"
        older = [other for other in list_checkpoints(path.parent) if step_of(other) < step_of(path)]
        if recipe.checkpoint.resume != "auto" or not older:
            raise TrainingStopped(
                f"{why}; resume from an older checkpoint (or start afresh with checkpoint.resume=null)",
                ExitCode.USAGE,
                report=rank == 0,
            )
        if rank == 0:
            print(f"skipping {why}; resuming from {older[-1].name}", file=sys.stderr, flush=True)
        path = older[-1]


def load_checkpoint(fabric: Fabric, path: Path, state: dict[str, Any], recipe: Recipe) -> None:
    """Restore `state` in place from a checkpoint folder, including this rank's RNG states."""
    meta = read_meta(path, needs=("strategy",))
    # Every rank checks every small file before anything is unpickled, so that all refuse a crafted one alike.
    if STRATEGIES(meta["strategy"]).checkpoint_layout == "sharded":  # torch.distributed.checkpoint's layout
        from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME

        check_sharded(path / "state")
        load_tensors(path / "state" / _METADATA_FILENAME)
    for rng_file in sorted((path / "rng").glob("*.pt")):
        load_tensors(rng_file)
    stateful = {key: value for key, value in state.items() if hasattr(value, "load_state_dict")}
    layouts = {
        STRATEGIES(meta["strategy"]).checkpoint_layout,
        STRATEGIES(recipe.strategy.name).checkpoint_layout,
    }
    if layouts == {"replicated", "sharded"}:  # ddp <-> fsdp2/hsdp
        _load_across_layouts(path, state)
    else:  # the same kind of strategy (also FSDP2 on another number of processes: DCP reshards)
        try:
            fabric.load(path / "state", state, weights_only=True)
        except pickle.UnpicklingError:  # a whole (ddp) state file holding more than tensors
            load_tensors(path / "state", map_location="cpu", mmap=True)  # raises the one-line refusal
            raise
    # Fabric's sharded loader puts the saved dict in place of objects such as the LR scheduler
    # instead of calling their load_state_dict; restore those objects here.
    for key, value in stateful.items():
        if state[key] is not value:
            value.load_state_dict(state[key])
            state[key] = value
    rng_file = path / "rng" / f"rank-{fabric.global_rank:05d}.pt"
    if meta["world_size"] == fabric.world_size and rng_file.is_file():
        set_rng_state(load_tensors(rng_file))
    else:
        # Another process count: per-rank streams cannot carry over; derive them from the step.
        fabric.seed_everything(recipe.train.seed + state["step"] * 1000 + fabric.global_rank, verbose=False)
        if fabric.global_rank == 0:
            warnings.warn(
                f"checkpoint {path} was saved by {meta['world_size']} processes, this run has {fabric.world_size}:"
                " random number streams are re-seeded from the step (data order and weights carry over exactly)",
                stacklevel=2,
            )


def _load_across_layouts(path: Path, state: dict[str, Any]) -> None:
    """Load a checkpoint saved by the other kind of strategy (replicated <-> sharded) through a full state dict.

    Every rank reads the whole checkpoint into host memory, so this suits models that fit there.
    Written here because Fabric's own ddp -> sharded path maps optimizer states by parameter order
    and mixes them up when the optimizer has several parameter groups.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = load_full_state(path)
    # Without Fabric's wrappers (a model's trained part, checkpoint.tensors.trained_part, has none).
    model, optimizer = getattr(state["model"], "module", state["model"]), state["optimizer"].optimizer
    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, full.pop("model"), options=options)
    saved = full.pop("optimizer")
    if saved["state"] and isinstance(next(iter(saved["state"])), int):  # a plain optimizer's ids -> names
        current_groups: Any = get_optimizer_state_dict(model, optimizer, options=options)["param_groups"]
        names: dict[int, str] = {}
        for saved_group, current_group in zip(saved["param_groups"], current_groups, strict=True):
            names.update(zip(saved_group["params"], current_group["params"], strict=True))
        saved = {
            "state": {names[index]: value for index, value in saved["state"].items()},
            "param_groups": [
                {**group, "params": [names[index] for index in group["params"]]} for group in saved["param_groups"]
            ],
        }
    set_optimizer_state_dict(model, optimizer, saved, options=options)
    for key in state.keys() - {"model", "optimizer"}:
        if key in full:
            state[key] = full[key]


def load_sharded_state(path: Path) -> dict[str, Any]:
    """A whole sharded checkpoint as one full state dict in memory, without a process group."""
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    check_sharded(path)  # before torch's reader unpickles it
    full: dict[str, Any] = {}
    _load_state_dict(full, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    full.update(load_tensors(path / _METADATA_FILENAME))
    return full


def load_full_state(path: Path) -> dict[str, Any]:
    """The full state of any checkpoint folder (sharded or not) as one dict in memory."""
    state_path = path / "state"
    if state_path.is_dir():
        return load_sharded_state(state_path)
    return load_tensors(state_path, map_location="cpu")


def consolidate(path: Path, output: Path, force: bool = False) -> dict[str, Any]:
    """Write the model weights of a checkpoint as one file loadable with `torch.load(..., weights_only=True)`.
    An existing output is replaced only with `force`, and never one inside a checkpoint folder."""
    if output.resolve().is_relative_to(path.resolve().parent):
        raise RecipeError(f"{output} is inside {path.parent}, where checkpoints live: write the weights elsewhere")
    if output.exists() and not force:
        raise RecipeError(f"{output} exists: choose another file, or pass --force to replace it")
    temporary = output.with_name(output.name + ".partial")
    if temporary.exists():
        raise RecipeError(f"{temporary} exists (left by an interrupted run?): delete it, then run again")
    weights = load_full_state(path)["model"]
    output.parent.mkdir(parents=True, exist_ok=True)
    with removed_unless_finished(temporary):
        torch.save(weights, temporary)
        temporary.replace(output)
    return weights
