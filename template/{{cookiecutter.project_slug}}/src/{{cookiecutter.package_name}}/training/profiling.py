"""Profiler traces and memory snapshots of the steps a recipe names (`profile:`); nothing runs outside them.

For each run of consecutive steps in `profile.steps`, every rank of `profile.ranks` starts torch.profiler
before the first step's data and stops it after the last step's logging, then writes

    <out_dir>/profile/steps-<first>-<last>/rank<r>.pt.trace.json     Chrome trace: CPU (and CUDA) activity,
        shapes, memory events; open it in Perfetto (ui.perfetto.dev), chrome://tracing, or TensorBoard
        (`tensorboard --logdir <out_dir>/profile` with the torch-tb-profiler plugin)
    <out_dir>/profile/steps-<first>-<last>/rank<r>.memory.pickle     GPUs, profile.memory: the CUDA
        allocator's history over those steps; drag it onto pytorch.org/memory_viz

With `profile.snapshot_on_oom` (GPUs), the allocator's history is recorded for the whole run and a
step that runs out of memory dumps `<out_dir>/profile/oom-rank<r>.memory.pickle` before the error ends
the process. Outside profiled steps the profiler is not running: a step costs one set lookup, and what the
profiler left behind is collected when its trace is written, not in a later step.
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import Logger

from ..recipe.schema import Recipe

MEMORY_VIZ = "https://pytorch.org/memory_viz"
# Allocations the CUDA allocator's history keeps (torch's own example uses 100k).
HISTORY_ENTRIES = 100_000


def step_ranges(steps: list[int]) -> list[tuple[int, int]]:
    """Consecutive runs of the given steps as (first, last) pairs: [3, 4, 5, 9] -> [(3, 5), (9, 9)]."""
    ranges: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if ranges and ranges[-1][1] == step - 1:
            ranges[-1] = (ranges[-1][0], step)
        else:
            ranges.append((step, step))
    return ranges


def describe(ranges: list[tuple[int, int]]) -> str:
    """Steps in words: `3-5, 9`."""
    return ", ".join(f"{first}-{last}" if last > first else str(first) for first, last in ranges)


class StepProfiler:
    """Starts and stops torch.profiler around the recipe's profiled steps; the loop calls it at each step's ends."""

    def __init__(self, fabric: Fabric, recipe: Recipe) -> None:
        config = recipe.profile
        self.fabric, self.config = fabric, config
        self.root = Path(recipe.out_dir) / "profile"
        self.ranges = step_ranges(config.steps)
        self.starts = {first: last for first, last in self.ranges}
        self.this_rank = not config.ranks or fabric.global_rank in config.ranks
        self.cuda = fabric.device.type == "cuda"
        self._profiler: Any = None
        self._range: tuple[int, int] | None = None
        self._step_marker: Any = None
        self.written: list[Path] = []  # the folders of the ranges profiled in this process (by any rank)
        if self.ranges:
            ranks = ", ".join(map(str, config.ranks)) if config.ranks else "every rank"
            fabric.print(f"Profiling steps {describe(self.ranges)} on rank(s) {ranks}: traces under {self.root}/")
        if config.snapshot_on_oom and self.cuda:
            self._record_oom_snapshots()

    def step_begins(self, step: int) -> None:
        """Before step `step` fetches its data: start the profiler at the first step of a profiled range."""
        if self._range is None and step in self.starts:
            self._range = (step, self.starts[step])
            if self.this_rank:
                self._start()
        if self._profiler is not None:
            self._step_marker = torch.profiler.record_function(f"step {step}")
            self._step_marker.__enter__()

    def step_ends(self, step: int) -> float:
        """After step `step` is logged: at the last step of a profiled range, stop and write the trace.

        Returns the seconds spent writing (0 in other steps)."""
        if self._step_marker is not None:
            self._step_marker.__exit__(None, None, None)
            self._step_marker = None
        if self._range is None or step != self._range[1]:
            return 0.0
        started = time.perf_counter()
        if self._profiler is not None:
            self._write(*self._range)
        self.written.append(self.root / f"steps-{self._range[0]}-{self._range[1]}")
        self._range = None
        return time.perf_counter() - started

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
            if self.config.memory and not self.config.snapshot_on_oom:
                torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        self._profiler = torch.profiler.profile(
            activities=activities,
            record_shapes=True,
            profile_memory=self.config.memory,
            with_stack=self.config.with_stack,
        )
        self._profiler.__enter__()

    def _write(self, first: int, last: int) -> None:
        self._profiler.__exit__(None, None, None)
        folder = self.root / f"steps-{first}-{last}"
        folder.mkdir(parents=True, exist_ok=True)
        rank = self.fabric.global_rank
        trace = folder / f"rank{rank}.pt.trace.json"
        self._profiler.export_chrome_trace(str(trace))
        self._profiler = None
        # The profiler's Python objects lived long enough to reach the oldest generation; left to the collector,
        # they set off a full collection of the whole heap (0.2 s on a 2-core machine) in some later step.
        # Collected now, in the time the monitor leaves out, no later step pays for them.
        gc.collect()
        steps = f"{first}-{last}" if last > first else str(first)
        print(f"[rank {rank}] profiler trace of step(s) {steps}: {trace} (open in ui.perfetto.dev)", flush=True)
        if self.cuda and self.config.memory:
            snapshot = folder / f"rank{rank}.memory.pickle"
            torch.cuda.memory._dump_snapshot(str(snapshot))
            if not self.config.snapshot_on_oom:
                torch.cuda.memory._record_memory_history(enabled=None)
            print(f"[rank {rank}] memory snapshot of step(s) {steps}: {snapshot} (open at {MEMORY_VIZ})", flush=True)

    def _record_oom_snapshots(self) -> None:
        """Record the allocator's history from now on; an out-of-memory error dumps it before it propagates."""
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES)
        path = self.root / f"oom-rank{self.fabric.global_rank}.memory.pickle"

        def dump(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(path))
            print(f"[rank {self.fabric.global_rank}] out of memory: snapshot {path} (open at {MEMORY_VIZ})",
                  file=sys.stderr, flush=True)  # fmt: skip

        torch._C._cuda_attach_out_of_memory_observer(dump)  # type: ignore[attr-defined]  # CUDA builds only

    def log_traces(self, loggers: list[Logger]) -> None:
        """Save this run's traces with the W&B run's files (rank 0; other loggers: nothing)."""
        wandb_loggers: list[Any] = [logger for logger in loggers if type(logger).__name__ == "WandbLogger"]
        if not self.ranges or not wandb_loggers:
            return
        self.fabric.barrier()  # every rank has written its traces
        if self.fabric.global_rank != 0:
            return
        # Every rank's traces where out_dir is shared (one node, or a shared file system); only rank 0's otherwise.
        traces = sorted(path for folder in self.written for path in folder.glob("rank*.pt.trace.json"))
        for trace in traces:
            wandb_loggers[0].experiment.save(str(trace), base_path=str(self.root.parent), policy="now")
        if traces:
            print(f"Saved {len(traces)} profiler trace(s) with the W&B run's files", flush=True)
