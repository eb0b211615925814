"""Checkpoints a preempted cluster job can continue from exactly.

A checkpoint is a folder `<out_dir>/checkpoints/step-<step>/`:
  state/ or state     `fabric.save` of model, optimizer, LR scheduler, data position, counters
                      (a torch.distributed.checkpoint folder, one shard per rank, under fsdp2;
                      one file under ddp)
  rng/rank-<r>.pt     torch / numpy / python (and CUDA) RNG states of every rank
  config.yaml         the resolved recipe
  meta.json           step, task, units seen, strategy, world size, W&B run id, provenance (the commit, the
                      package versions, hosts and launcher: provenance.py), the size and SHA-256 of every
                      file; written last
It is written as `step-<step>.partial`, flushed to disk (fsync of every file and folder) and renamed
once every rank has finished, so a folder with the final name is complete; one whose files do not
match its meta.json is skipped with a warning. The sizes are checked for every folder, the digests
(every rank hashes a share of the files, in parallel) for the one a run resumes from: a shard
corrupted in place is found before it is loaded. A save that runs out of disk space stops the run
in one line (ExitCode.SAVE_FAILED); the newest complete checkpoint is kept. Reading them back: load.py.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from lightning.fabric import Fabric
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import ExitCode, TrainingStopped
from ..recipe.load import dump_recipe
from ..recipe.schema import Recipe
from .layout import (
    META_FILE,
    checkpoint_bytes,
    checkpoint_root,
    file_sha256,
    free_bytes,
    remove_checkpoint,
    remove_old_checkpoints,
    space_report,
)
from .provenance import PROVENANCE
from .rng import rng_state

# Called on the rank that makes a checkpoint visible, once its tensors are written and before meta.json and the
# rename: (step, the run's out_dir). training/faults.py adds its kill-in-save point here (this layer knows no loop).
WRITTEN_HOOKS: list[Callable[[int, str], None]] = []
AUTO = "auto"  # checkpoint.save_every_minutes: the interval chosen from the run's own save cost


@dataclass(frozen=True)
class ChosenInterval:
    """What save_every_minutes=auto chose after the run's first save: every rank's the same."""

    save_seconds: float  # what the first save blocked the slowest rank for
    mtbf_seconds: float
    interval_seconds: float

    def line(self) -> str:
        """The line a run prints when it chooses."""
        return (
            f"Checkpoint interval: every {self.interval_seconds:.4g} s = {self.interval_seconds / 60:.3g} min"
            f" (save_every_minutes=auto: sqrt(2 x save x MTBF), a save blocks {self.save_seconds:.3g} s, MTBF"
            f" {self.mtbf_seconds / 3600:g} h)"
        )


class Checkpointer:
    """Saves a run's checkpoints on schedule (steps, wall time, end), keeps the newest K, optionally in the background."""

    def __init__(
        self,
        fabric: Fabric,
        recipe: Recipe,
        provenance: dict[str, Any] | None = None,
        interval_rule: Callable[[float, float], float] | None = None,
    ) -> None:
        """`interval_rule`: (seconds a save blocks, mean seconds between failures) -> seconds between saves, for
        save_every_minutes=auto (planner/interval.py's, passed down by the loop)."""
        self.fabric = fabric
        self.provenance = provenance  # what made the run (provenance.py): code, versions, hosts, launcher
        self.recipe = recipe
        self.config = recipe.checkpoint
        self.root = checkpoint_root(recipe)
        self._last_save_time = time.monotonic()
        self._interval_rule = interval_rule
        minutes = self.config.save_every_minutes
        # auto: 0 until chosen, so the first step saves and its cost is measured.
        self.interval_seconds = 0.0 if minutes == AUTO else 60 * float(minutes)
        self.chosen: ChosenInterval | None = None  # set by the save that chose the interval (auto), else None
        self._pending: Future[None] | None = None  # a background save, until written and made visible
        self._process_group: Any = None
        self._stager: Any = None
        if self.config.async_save:
            # Background writes synchronise over their own group, never racing the training collectives.
            self._process_group = torch.distributed.new_group(backend="gloo")
            self._stager = HostCopy(pinned=torch.cuda.is_available())
            # Finishing a save (meta.json, the rename, retention's deletions) is file work the loop need not wait for.
            self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-finish")

    def time_is_up(self) -> bool:
        """Whether the time-based interval has passed on this rank's clock since the last save (ranks then agree)."""
        timed = self.config.save_every_minutes == AUTO or bool(self.interval_seconds)
        return timed and time.monotonic() - self._last_save_time >= self.interval_seconds

    def due(self, step: int, time_is_up_on_some_rank: bool) -> bool:
        """Whether to save after this step; the same answer on every rank when its argument is (step_sync.agree)."""
        if step >= self.recipe.train.max_steps or time_is_up_on_some_rank:
            return True
        return bool(self.config.save_every_steps) and step % self.config.save_every_steps == 0

    def save(self, state: dict[str, Any]) -> float:
        """Write a checkpoint of `state`; return the seconds the loop was blocked."""
        start = time.perf_counter()
        self.wait()
        step = state["step"]
        final = self.root / f"step-{step:08d}"
        partial = final.with_name(final.name + ".partial")
        if self.fabric.global_rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            (partial / "rng").mkdir(parents=True)
        self.fabric.barrier()
        torch.save(rng_state(), partial / "rng" / f"rank-{self.fabric.global_rank:05d}.pt")
        meta = {
            "step": step,
            "task": self.recipe.task,
            "units_seen": state["units_seen"],  # tokens, images, ...: the task's unit
            "strategy": self.recipe.strategy.name,
            "world_size": self.fabric.world_size,
            "time": time.time(),
            "wandb_run_id": state.get("wandb_run_id"),  # readable before launch, to continue the same W&B run
            PROVENANCE: self.provenance,  # compared at resume: another commit or package version is named
        }
        with self._disk_full_stops_the_run(partial):
            if self.config.async_save:
                written = _async_save_sharded(self.fabric, partial / "state", state, self._process_group, self._stager)
                self._pending = self._finisher.submit(self._finish_when_written, written, partial, meta)
            else:
                self.fabric.save(partial / "state", state)
                self.fabric.barrier()
                for hook in WRITTEN_HOOKS:
                    hook(step, self.recipe.out_dir)
                self._finish(partial, meta, self._hash_shares(partial, group=None))
                self.fabric.barrier()
        self._last_save_time = time.monotonic()
        blocked = time.perf_counter() - start
        self.chosen = None
        if self.config.save_every_minutes == AUTO and not self.interval_seconds:
            self.chosen = self._choose_interval(blocked)
            self.interval_seconds = self.chosen.interval_seconds
        return blocked

    def _choose_interval(self, blocked: float) -> ChosenInterval:
        """save_every_minutes=auto, after the first save: the interval from the slowest rank's save cost, the same on
        every rank (each then counts it on its own clock, and the step decision takes the first rank whose is up)."""
        if self._interval_rule is None or self.config.mtbf_hours is None:  # recipe/checks.py refuses auto without
            raise ValueError("save_every_minutes=auto needs an interval rule and checkpoint.mtbf_hours")
        measured = torch.tensor([blocked], device=self.fabric.device)
        slowest = float(cast(torch.Tensor, self.fabric.all_reduce(measured, reduce_op="max")).item())
        mtbf = 3600 * self.config.mtbf_hours
        return ChosenInterval(slowest, mtbf, self._interval_rule(slowest, mtbf))

    def poll(self) -> None:
        """Raise the error of a background save that failed, without blocking (call every step).

        A save that finished is left for `wait` to make visible: that takes a barrier, and a rank's save
        finishing is its own clock, so only the next save or the end of the run, which every rank reaches
        at the same step, may enter it (one rank in the barrier and another in the step's collectives
        would hang both).
        """
        if self._pending is not None and self._pending.done() and self._pending.exception() is not None:
            self.wait()

    def wait(self) -> None:
        """Block until a background save is written and visible on every rank."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        with self._disk_full_stops_the_run(None):
            pending.result()
        self.fabric.barrier()

    def _finish_when_written(self, written: Future[Any], partial: Path, meta: dict[str, Any]) -> None:
        """In the background, on every rank: once the shards are written, hash them; rank 0 makes the checkpoint
        visible. The digests travel over the background group, never racing the training collectives."""
        written.result()  # done means every rank's shard and the metadata are written
        records = self._hash_shares(partial, group=self._process_group)
        if self.fabric.global_rank == 0:
            for hook in WRITTEN_HOOKS:
                hook(meta["step"], self.recipe.out_dir)
            self._finish(partial, meta, records)

    def _hash_shares(self, partial: Path, group: Any) -> dict[str, dict[str, Any]]:
        """Each rank hashes and fsyncs its share of the files written so far, in parallel; rank 0 gets every record."""
        names = sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
        rank, world = self.fabric.global_rank, self.fabric.world_size
        mine = {name: _record(partial / name) for name in names[rank::world]}
        if world == 1 or not torch.distributed.is_initialized():
            return mine
        gathered: list[Any] = [None] * world if rank == 0 else []
        torch.distributed.gather_object(mine, gathered if rank == 0 else None, dst=0, group=group)
        return {name: record for share in gathered if share for name, record in share.items()} if rank == 0 else {}

    def _finish(self, partial: Path, meta: dict[str, Any], records: dict[str, dict[str, Any]]) -> None:
        """On rank 0: record the files, flush everything to disk, rename into place, apply retention."""
        if self.fabric.global_rank != 0:
            return
        (partial / "config.yaml").write_text(dump_recipe(self.recipe))
        files = sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
        meta["files"] = {name: records.get(name) or _record(partial / name) for name in files}  # config.yaml: here
        (partial / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _record(partial / META_FILE)  # fsync
        for folder in {partial, *((partial / name).parent for name in files)}:  # a new file's name is on disk only
            _fsync_folder(folder)  # once its folder is flushed too
        final = partial.with_name(partial.name.removesuffix(".partial"))
        remove_checkpoint(final)  # a complete one of the same step, saved again after an older resume
        partial.rename(final)
        _fsync_folder(final.parent)
        if self.config.keep_last:
            remove_old_checkpoints(self.root, self.config.keep_last)

    @contextmanager
    def _disk_full_stops_the_run(self, partial: Path | None) -> Iterator[None]:
        """A save that runs out of space ends the run in one line (exit SAVE_FAILED), naming the space it needs;
        the unfinished folder is removed and the newest complete checkpoint kept. Other errors pass through."""
        try:
            yield
        except (OSError, RuntimeError, CheckpointException) as error:  # DCP's is a BaseException
            # torch.save reports a full disk as a RuntimeError ("unexpected pos"): the free space tells.
            if not (_disk_full(error) or free_bytes(self.root) < checkpoint_bytes(self.recipe)):
                raise
            if partial is not None and self.fabric.global_rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
            raise TrainingStopped(
                f"checkpoint not saved: no space left: {space_report(self.recipe)}; the newest complete checkpoint is"
                " kept: free space there (or lower checkpoint.keep_last), then resume with checkpoint.resume=auto",
                ExitCode.SAVE_FAILED,
                report=self.fabric.global_rank == 0,
            ) from None


def _record(path: Path) -> dict[str, Any]:
    """What meta.json records of a file (its size and SHA-256), once its data is flushed to disk."""
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path, sync=True)}


def _fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (the names of new files, a rename) to disk."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


FULL = (errno.ENOSPC, errno.EDQUOT)


def _disk_full(error: BaseException | None) -> bool:
    """Whether an error (DCP's wrapper of every rank's, or a chain of causes) comes from a full disk or quota."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in FULL:
            return True
        if isinstance(error, CheckpointException):
            return any(
                _disk_full(failure[0] if isinstance(failure, tuple) else failure) for failure in error.failures.values()
            )
        error = error.__cause__ or error.__context__
    return False


class HostCopy:
    """Stages a state dict for a background save into host tensors made once and reused by every later save.

    The first save copies through torch's DefaultStager, which allocates a host copy of each tensor
    (pinned on a GPU). Later saves copy each tensor into its host copy of the same key, with no
    allocation and no walk over tensor attributes: the loop is then blocked for about one plain memory
    copy. Non-tensor values (learning rates, step counts) are taken fresh at every save. The host
    copies are overwritten by the next save, so the previous background write must have finished
    first (Checkpointer.save waits for it).
    """

    def __init__(self, pinned: bool) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self._first = DefaultStager(StagingOptions(pinned, False, use_async_staging=False, use_non_blocking_copy=False))
        self._copies: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def should_synchronize_after_execute(self) -> bool:
        """stage() returns a finished copy: async_save has nothing to wait for after starting the write."""
        return False

    @torch.no_grad()
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self._copies:
            try:
                return self._copy_into(state_dict, ())
            except KeyError:  # another set of tensors (a parameter added or reshaped): stage afresh
                self._copies.clear()
        staged = self._first.stage(state_dict)
        if isinstance(staged, Future):  # not with use_async_staging=False, but the type allows it
            staged = staged.result()
        self._copies = dict(_tensors(staged, ()))
        return staged

    def _copy_into(self, value: Any, key: tuple[Any, ...]) -> Any:
        if isinstance(value, dict):
            return {name: self._copy_into(item, (*key, name)) for name, item in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._copy_into(item, (*key, index)) for index, item in enumerate(value))
        if not torch.is_tensor(value):
            return value
        copy = self._copies[key]
        if copy.shape != value.shape or copy.dtype != value.dtype or type(copy) is not type(value):
            raise KeyError(key)
        _local(copy).copy_(_local(value))
        return copy

    def synchronize_staging(self) -> None:
        """Nothing to wait for: stage() returns a finished copy."""

    def close(self) -> None:
        self._copies.clear()
        self._first.close()


def _tensors(value: Any, key: tuple[Any, ...]) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """(key path, tensor) of every tensor in a nested state dict."""
    if isinstance(value, dict):
        for name, item in value.items():
            yield from _tensors(item, (*key, name))
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from _tensors(item, (*key, index))
    elif torch.is_tensor(value):
        yield key, value


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _async_save_sharded(fabric: Fabric, path: Path, state: dict[str, Any], process_group: Any, stager: Any) -> Any:
    """Start a background torch.distributed.checkpoint save in the layout `fabric.load` reads.

    Fabric has no asynchronous save; this mirrors its sharded layout (model and optimizer in DCP,
    everything else in meta.pt from rank 0) and uses DCP's async_save, which copies to host memory
    before returning so training may change the parameters while the files are written.
    """
    from lightning.fabric.strategies.model_parallel import _METADATA_FILENAME
    from torch.distributed.checkpoint import async_save
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    # Without Fabric's wrappers (a model's trained part, checkpoint.tensors.trained_part, has none).
    model, optimizer = getattr(state["model"], "module", state["model"]), state["optimizer"].optimizer
    sharded = {"model": get_model_state_dict(model), "optimizer": get_optimizer_state_dict(model, optimizer)}
    rest = {key: value for key, value in state.items() if key not in ("model", "optimizer")}
    rest = {key: value.state_dict() if hasattr(value, "state_dict") else value for key, value in rest.items()}
    if fabric.global_rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        torch.save(rest, path / _METADATA_FILENAME)
    fabric.barrier()
    return async_save(sharded, checkpoint_id=path, process_group=process_group, async_stager=stager)
