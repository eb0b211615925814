"""Goodput: what start-up and failures cost a run, recorded by every process lifetime and summed up by `report`.

Each process lifetime (the first launch, a relaunch after a failure, a torchrun restart, a requeued job) times
its start-up in phases, from the process's own start to the end of its first optimizer step:

    imports          the process started -> the training code imported (setup begins)
    rendezvous       -> the process group up: the data found, the recipe checked, the other ranks launched
    model_build      -> the model built, sharded and wrapped with its optimizer (pretrained weights loaded), the batches
    checkpoint_load  -> the checkpoint verified and loaded (0 on a fresh start)
    first_step       -> the first optimizer step done: compilation and every other first-time cost

and counts the steps it redoes: those between the checkpoint it resumed from and the furthest step an earlier
lifetime logged. Rank 0 logs them once, at its first step (METRICS), and the run's goodput at every logging
step: the time its steps took, each step once at the run's median step time, over the wall time since the
first lifetime started (restarts, saves and validation count as lost). The launch time is the process's own
start (Linux's /proc), so it holds under the CLI, `fabric run`, torchrun (a restarted worker is a new
process) and srun alike.
"""

from __future__ import annotations

import csv
import math
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # `report` reads the arithmetic below without importing torch
    from lightning.fabric import Fabric

IMPORTED_AT = time.time()
PHASES = ("imports", "rendezvous", "model_build", "checkpoint_load", "first_step")
STARTUP = "goodput/startup_seconds"
REDONE = "goodput/redone_steps"
LOST = "goodput/lost_seconds"  # start-up + redone steps x step time
LAUNCHED = "goodput/launched_unix_time"
GOODPUT = "goodput/goodput"
STEP_SECONDS = "time/step_seconds"  # what the monitor logs (training/monitor.py)


def phase_key(phase: str) -> str:
    """The metric of one start-up phase: goodput/phase/<phase>_seconds."""
    return f"goodput/phase/{phase}_seconds"


def process_start_time() -> float:
    """The unix time this process started (Linux: /proc); elsewhere the time this module was imported."""
    try:
        stat = Path("/proc/self/stat").read_text()
        started_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the fields after the name start at 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return IMPORTED_AT
    return time.time() - uptime + started_ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class StartupClock:
    """When this process started and when it finished each start-up phase (unix times)."""

    launched: float = field(default_factory=process_start_time)
    finished: dict[str, float] = field(default_factory=dict)

    def mark(self, phase: str) -> None:
        """`phase` (one of PHASES) is done now."""
        self.finished[phase] = time.time()

    def phase_seconds(self) -> dict[str, float]:
        """Seconds of each phase, in order; a phase never marked took none."""
        seconds, previous = {}, self.launched
        for phase in PHASES:
            end = self.finished.get(phase, previous)
            seconds[phase] = max(end - previous, 0.0)
            previous = max(end, previous)
        return seconds


def lost_seconds(startup_seconds: float, redone_steps: int, step_seconds: float) -> float:
    """What one lifetime's start lost: its start-up, and the steps it redid at the run's step time."""
    return startup_seconds + redone_steps * step_seconds


def run_goodput(steps_done: int, step_seconds: float, wall_seconds: float) -> float:
    """The fraction of the wall time that trained: each step once, at `step_seconds`, over the wall time."""
    if wall_seconds <= 0 or not math.isfinite(step_seconds):
        return math.nan
    return min(steps_done * step_seconds / wall_seconds, 1.0)


@dataclass
class Earlier:
    """What the earlier lifetimes of a run logged: the furthest step, their step times, the first launch."""

    furthest_step: int = 0
    step_seconds: list[float] = field(default_factory=list)
    first_launch: float | None = None


def earlier_lifetimes(metrics_files: Iterable[Path]) -> Earlier:
    """Read the CSV metrics of a run's earlier lifetimes (rank 0, once, at its first step)."""
    earlier = Earlier()
    for path in metrics_files:
        try:
            with path.open(newline="", encoding="utf-8") as handle:
                rows = list(csv.DictReader(handle))
        except (OSError, UnicodeDecodeError, csv.Error):
            continue  # an unreadable file costs the figures of one lifetime, not the run
        for row in rows:
            step = _number(row.get("step"))
            if math.isfinite(step):
                earlier.furthest_step = max(earlier.furthest_step, int(step))
            if math.isfinite(seconds := _number(row.get(STEP_SECONDS))):
                earlier.step_seconds.append(seconds)
            if math.isfinite(launched := _number(row.get(LAUNCHED))):
                earlier.first_launch = min(launched, earlier.first_launch or launched)
    return earlier


def _number(text: str | None) -> float:
    try:
        return float(text) if text else math.nan
    except ValueError:
        return math.nan


class Goodput:
    """One lifetime's start-up figures, logged at its first step, and the run's goodput at each logging step."""

    def __init__(self, fabric: Fabric, clock: StartupClock, start_step: int) -> None:
        from lightning.fabric.loggers import CSVLogger

        self.fabric, self.clock, self.start_step = fabric, clock, start_step
        self.first_step_logged = False
        self.step_seconds: list[float] = []
        self.earlier = Earlier()
        csv_loggers = [logger for logger in fabric.loggers if isinstance(logger, CSVLogger)]
        if fabric.global_rank == 0 and csv_loggers:  # only rank 0 logs: the others need not read
            own = Path(csv_loggers[0].log_dir)
            self.earlier = earlier_lifetimes(
                p for p in sorted(own.parent.glob("version_*/metrics.csv")) if p.parent != own
            )
        self.step_seconds = list(self.earlier.step_seconds)
        self.first_launch = min(self.earlier.first_launch or clock.launched, clock.launched)

    def step_done(self, step: int) -> None:
        """At this lifetime's first step: its start-up phases, redone steps and lost time to the loggers."""
        if self.first_step_logged:
            return
        self.first_step_logged = True
        self.clock.mark("first_step")
        phases = self.clock.phase_seconds()
        startup = sum(phases.values())
        redone = max(self.earlier.furthest_step - self.start_step, 0)
        step_seconds = statistics.median(self.step_seconds) if self.step_seconds else 0.0
        figures = {STARTUP: startup, REDONE: float(redone), LAUNCHED: self.clock.launched}
        figures |= {phase_key(phase): seconds for phase, seconds in phases.items()}
        figures[LOST] = lost_seconds(startup, redone, step_seconds)
        self.fabric.log_dict(figures, step=step)

    def figures(self, step: int, step_seconds: float) -> dict[str, float]:
        """The run's goodput so far, at a logging step whose window took `step_seconds` per step."""
        self.step_seconds.append(step_seconds)
        wall = time.time() - self.first_launch
        return {GOODPUT: run_goodput(step, statistics.median(self.step_seconds), wall)}
