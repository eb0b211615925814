"""How often to save: the checkpoint interval that maximises goodput for a save cost and a mean time between failures.

A run that blocks C seconds per save and fails on average every M seconds wastes, per second of training, C / tau
on saving and tau / (2 M) on redoing half an interval after each failure; Young's interval tau = sqrt(2 C M)
(J. W. Young, 1974) minimises the sum. Its expected goodput, the share of wall time spent on training that is
kept, also counts the restart (R: scheduling, start-up, loading the checkpoint):

    goodput = tau / (tau + C) x (1 - (R + (tau + C) / 2) / M)

the share of running time that trains, times the share of time not lost to failures (each costs R and on
average half an interval and a save redone).

With `checkpoint.async_save` the loop blocks only for the copy to host memory: C is that part alone. The write
runs beside training and the next save waits for it, so the interval is at least the write's time.

Torch-free: `plan --mtbf` prints the interval (planner/, commands/plan.py) and `checkpoint.save_every_minutes: auto`
saves by it during training (checkpoint/io.py, with the save cost the run measures).
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass

from ..errors import RecipeError
from .hardware import PCIE_GB_S
from .options import PlanSizes
from .units import GB, size

# Without a run's measurements, a save is estimated from the bytes one rank writes at this rate (`--write_gb_s`):
# a rank's share of a parallel file system's bandwidth, or a local NVMe drive shared by a node's 8 ranks.
DEFAULT_WRITE_GB_S = 1.0
DEFAULT_RESTART = "5m"  # scheduling, start-up and loading the checkpoint after a failure (`--restart`)
# What a checkpoint holds per trained parameter: fp32 weights (sharded only under ZeRO-3 / FSDP) and AdamW's two
# fp32 moments (sharded from ZeRO-1 on), as checkpoint/layout.py counts them.
WEIGHT_BYTES, MOMENT_BYTES = 4, 8
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
DURATION = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([smhd])\s*")


def parse_duration(text: str, flag: str) -> float:
    """Seconds of a duration written as `8h`, `90m`, `3600s` or `1.5d`; a RecipeError naming `flag` otherwise."""
    match = DURATION.fullmatch(text)
    seconds = float(match.group(1)) * UNITS[match.group(2)] if match else 0.0
    if not seconds > 0 or not math.isfinite(seconds):
        raise RecipeError(f"{flag}={text!r}: expected a duration > 0 such as 8h, 90m or 3600s (units s, m, h, d)")
    return seconds


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Seconds of training between saves that minimise the time lost to saving and to failures: sqrt(2 C M)."""
    return math.sqrt(2 * save_seconds * mtbf_seconds)


def expected_goodput(interval: float, save_seconds: float, mtbf_seconds: float, restart_seconds: float) -> float:
    """The share of wall time that trains and is kept, saving every `interval` seconds of training (0 at worst)."""
    running = interval / (interval + save_seconds)
    lost_to_failures = (restart_seconds + (interval + save_seconds) / 2) / mtbf_seconds
    return max(0.0, running * (1 - lost_to_failures))


def checkpoint_bytes_per_rank(sizes: PlanSizes, stage: int) -> float:
    """Bytes the busiest rank writes: fp32 weights and two moments of the trained parameters it holds (on one
    tensor-parallel rank, of the largest pipeline stage), as ZeRO `stage` shards them over the data-parallel ranks
    (a replicated state is written by one rank of them)."""
    weights = WEIGHT_BYTES / (sizes.data_parallel if stage >= 3 else 1)
    moments = MOMENT_BYTES / (sizes.data_parallel if stage >= 1 else 1)
    return sizes.parameters * sizes.trained * (weights + moments)


@dataclass(frozen=True)
class SaveCost:
    """What one save blocks training for, the time its write takes (the same unless saved in the background), and
    where the figure comes from, in words."""

    blocking_seconds: float
    write_seconds: float
    source: str


def measured_save(seconds: list[float], where: str) -> SaveCost:
    """A run's saves: the median of the blocked seconds it logged (the writes of a background save are not logged)."""
    median = statistics.median(seconds)
    return SaveCost(median, median, f"measured: the median of {len(seconds)} saves of {where}")


def estimated_save(bytes_per_rank: float, async_save: bool, write_gb_s: float) -> SaveCost:
    """A save estimated from the bytes one rank writes at `write_gb_s`; in the background (async_save) training
    blocks only for the copy to host memory, over PCIe."""
    write = bytes_per_rank / (write_gb_s * GB)
    rate = f"{size(bytes_per_rank)} per rank at {write_gb_s:g} GB/s (--write_gb_s)"
    if not async_save:
        return SaveCost(write, write, f"estimated: {rate}")
    copy = bytes_per_rank / (PCIE_GB_S * GB)
    return SaveCost(copy, write, f"estimated: async, {PCIE_GB_S:g} GB/s to host memory, then {rate}")


@dataclass(frozen=True)
class IntervalPlan:
    """The checkpoint interval that maximises goodput, and the goodput expected with it."""

    cost: SaveCost
    mtbf_seconds: float
    restart_seconds: float
    interval_seconds: float
    goodput: float

    def to_json(self) -> dict[str, float | str]:
        """The figures of `plan --json`'s `checkpoint_interval`."""
        return {
            "interval_seconds": self.interval_seconds,
            "expected_goodput": self.goodput,
            "save_blocking_seconds": self.cost.blocking_seconds,
            "save_write_seconds": self.cost.write_seconds,
            "save_cost_from": self.cost.source,
            "mtbf_seconds": self.mtbf_seconds,
            "restart_seconds": self.restart_seconds,
        }


def interval_plan(cost: SaveCost, mtbf_seconds: float, restart_seconds: float) -> IntervalPlan:
    """Young's interval for the blocking part of a save, at least as long as its write, and the goodput expected."""
    interval = max(young_interval(cost.blocking_seconds, mtbf_seconds), cost.write_seconds)
    goodput = expected_goodput(interval, cost.blocking_seconds, mtbf_seconds, restart_seconds)
    return IntervalPlan(cost, mtbf_seconds, restart_seconds, interval, goodput)


def duration(seconds: float) -> str:
    """`31.0 min`, `8.0 h`, `12.5 s`: a duration in the unit that keeps it readable."""
    if seconds >= 2 * 3600:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.3g} s"


def render_interval(plan: IntervalPlan) -> str:
    """Plan's two lines: the interval and goodput, then the save cost they come from."""
    cost = plan.cost
    rule = "sqrt(2 x save x MTBF)"
    if plan.interval_seconds <= cost.write_seconds:  # Young's is shorter than the background write
        rule = f"the write's {duration(cost.write_seconds)}, longer than {rule}"
    return (
        f"Checkpoint interval: save every {duration(plan.interval_seconds)}"
        f" (checkpoint.save_every_minutes: {plan.interval_seconds / 60:.1f}); expected goodput"
        f" {100 * plan.goodput:.1f}% with an MTBF of {duration(plan.mtbf_seconds)} and a restart of"
        f" {duration(plan.restart_seconds)}\n"
        f"  from a save that blocks training {duration(cost.blocking_seconds)} ({cost.source}): {rule}"
    )
