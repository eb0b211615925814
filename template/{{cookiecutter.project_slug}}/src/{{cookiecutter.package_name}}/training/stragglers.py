"""Which rank holds the others back: each rank's step time and data wait, compared at every logging step.

Ranks of a synchronous run finish every step together, so a rank's wall time per step says nothing of
who was late. What differs is how long each waits for the others at the step's decision all_reduce
(training/step_decision.py): the rank that arrives last waits least. A rank's *own* step time is its
wall time per step less that wait; with its data wait it is gathered from every rank in the all_gather
the monitor already makes at logging steps (no collective is added). A rank whose own step time or
data wait exceeds the median over ranks by `logger.straggler_margin` of the median step time is named
in the log, and the figures go to the loggers (the first window of a process names nobody: its first
step holds each rank's one-time work, allocator growth, the profiler's start, compiling, which differs
between ranks without any of them being slow):

    stragglers/slowest_rank, stragglers/slowest_step_seconds, stragglers/median_step_seconds
    stragglers/slowest_data_wait_rank, stragglers/max_data_wait_seconds, stragglers/median_data_wait_seconds
    stragglers/straggler_rank    the rank named in the log, -1 when none is

A delay inside the strategy's own collectives (a rank slow before the gradient all-reduce of its backward)
makes every rank wait there alike and shows as a slower step on all ranks; the per-rank profiler traces
(`profile:`) show where.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist


class RankTimes:
    """This rank's time spent waiting for the others at the step's decision over a logging window, and the
    figures of every rank gathered at its end."""

    def __init__(self, device: torch.device, margin: float) -> None:
        self.device, self.margin, self.sync_wait_seconds = device, margin, 0.0
        self.memory_per_rank: dict[str, list[float]] = {}  # as of the last logging step

    @contextmanager
    def waiting_for_ranks(self) -> Iterator[None]:
        """Time the block (the step's decision all_reduce) as waiting for the other ranks."""
        if self.device.type == "cuda":  # the rank's own kernels are its work, not waiting: finish them first
            torch.cuda.current_stream(self.device).synchronize()
        started = time.perf_counter()
        yield
        self.sync_wait_seconds += time.perf_counter() - started

    def reset(self) -> None:
        """Start a new logging window."""
        self.sync_wait_seconds = 0.0

    def gather(
        self, local: dict[str, float], seconds: float, steps: int, first_window: bool = False
    ) -> tuple[dict[str, float], str | None]:
        """Each figure of `local` at its worst over ranks, with the stragglers/ metrics; a line naming a straggler
        (never in the `first_window` of a process: its figures are logged, nobody is named).

        `local`: this rank's figures (memory, time/data_wait_seconds per step); `seconds`: the window's wall time
        over `steps` steps. Every rank calls it: one all_gather.
        """
        own_step_seconds = (seconds - self.sync_wait_seconds) / max(steps, 1)
        per_rank = gather_per_rank(torch.tensor([*local.values(), own_step_seconds], device=self.device)).cpu()
        columns = {key: per_rank[:, index].tolist() for index, key in enumerate(local)}
        self.memory_per_rank = {key: values for key, values in columns.items() if key.startswith("memory/")}
        metrics, line = straggler_figures(per_rank[:, -1].tolist(), columns["time/data_wait_seconds"], self.margin)
        if first_window:
            metrics["stragglers/straggler_rank"], line = -1.0, None
        return {**{key: max(values) for key, values in columns.items()}, **metrics}, line

    def memory_lines(self) -> list[str]:
        """Each memory figure per rank, one line each: `peak host rss per rank (GiB): 0: 0.61, 1: 0.60`."""
        lines = []
        for key, values in self.memory_per_rank.items():
            name = key.removeprefix("memory/").removesuffix("_gib").replace("_", " ")
            lines.append(
                f"{name} per rank (GiB): " + ", ".join(f"{rank}: {value:.2f}" for rank, value in enumerate(values))
            )
        return lines


def gather_per_rank(figures: torch.Tensor) -> torch.Tensor:
    """Every rank's `figures` (a 1-D tensor of the same length on each) as rows of a (world size, n) tensor."""
    if not (dist.is_available() and dist.is_initialized()):
        return figures.unsqueeze(0)
    rows = [torch.empty_like(figures) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, figures)
    return torch.stack(rows)


def straggler_figures(
    step_seconds: list[float], data_wait_seconds: list[float], margin: float
) -> tuple[dict[str, float], str | None]:
    """The stragglers/ metrics of one logging window, and a line naming the straggler (None when there is none).

    `step_seconds[r]`, `data_wait_seconds[r]`: rank r's own time and data wait per step.
    """
    median_step, median_wait = statistics.median(step_seconds), statistics.median(data_wait_seconds)
    slowest = max(range(len(step_seconds)), key=step_seconds.__getitem__)
    waits_most = max(range(len(data_wait_seconds)), key=data_wait_seconds.__getitem__)
    metrics = {
        "stragglers/slowest_rank": float(slowest),
        "stragglers/slowest_step_seconds": step_seconds[slowest],
        "stragglers/median_step_seconds": median_step,
        "stragglers/slowest_data_wait_rank": float(waits_most),
        "stragglers/max_data_wait_seconds": data_wait_seconds[waits_most],
        "stragglers/median_data_wait_seconds": median_wait,
        "stragglers/straggler_rank": -1.0,
    }
    allowed = margin * median_step
    over_in_step = step_seconds[slowest] - median_step
    over_in_data = data_wait_seconds[waits_most] - median_wait
    if max(over_in_step, over_in_data) <= allowed or len(step_seconds) < 2:
        return metrics, None
    if over_in_step >= over_in_data:
        metrics["stragglers/straggler_rank"] = float(slowest)
        return metrics, (
            f"straggler: rank {slowest} takes {step_seconds[slowest]:.3f} s per step before the ranks sync"
            f" (median {median_step:.3f} s, +{over_in_step / max(median_step, 1e-9):.0%}; logger.straggler_margin={margin:g})"
        )
    metrics["stragglers/straggler_rank"] = float(waits_most)
    return metrics, (
        f"straggler: rank {waits_most} waits {data_wait_seconds[waits_most]:.3f} s per step for data"
        f" (median {median_wait:.3f} s, a step {median_step:.3f} s; logger.straggler_margin={margin:g})"
    )
