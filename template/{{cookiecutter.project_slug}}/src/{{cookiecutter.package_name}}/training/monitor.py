"""What a run reports through its loggers (training/loggers.py): throughput and MFU, memory, and rank-0 progress.

The loop talks to one `Monitor`: it times the data, counts steps, and every `logger.log_every_steps`
steps logs the metrics below to the chosen logger and shows them as progress (a live bar on a
terminal, one plain line per interval in a cluster log).

    train/loss, train/lr, train/grad_norm, train/<unit>s_seen, train/epoch
    throughput/<unit>s_per_second, .../<unit>s_per_second_per_device, .../samples_per_second,
        .../samples_per_second_per_device, .../flops_per_<unit>, .../tflops_per_second_per_device, .../mfu
    memory/peak_allocated_gib, memory/peak_reserved_gib (GPU), memory/host_peak_rss_gib (max over ranks)
    time/step_seconds, time/data_wait_seconds (per step, max over ranks), time/data_wait_fraction, time/unix_time,
        time/checkpoint_save_seconds, time/validation_seconds
    checkpoint/interval_minutes once, when checkpoint.save_every_minutes=auto chooses it (checkpoint/io.py)
    goodput/goodput, and at a lifetime's first step its start-up phases and redone steps (training/goodput.py)
    stragglers/... each rank's own step time and data wait, the slowest named (training/stragglers.py)
    val/<name> for each of the task's validation figures (val/loss, val/perplexity for a language model)
    the model's own figures of the step, by the names it gives (a mixture of experts' moe/...: tasks/base.py)

<unit> is what the task counts (token, image, ...); the FLOP and MFU figures need the task's FLOPs per unit.
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TextIO, TypeVar, cast

import torch
from lightning.fabric import Fabric
from tqdm import tqdm

from ..checkpoint.io import ChosenInterval
from ..planner.hardware import peak_tflops
from ..recipe.schema import Recipe
from .goodput import Goodput, StartupClock
from .memory import memory_gib
from .stragglers import RankTimes

Item = TypeVar("Item")


def model_flops_utilization(flops_per_unit: float, units_per_second_per_device: float, peak: float) -> float:
    """MFU: the model FLOP/s one device achieves as a fraction of its peak (given in TFLOP/s)."""
    return flops_per_unit * units_per_second_per_device / (peak * 1e12)


def progress_line(step: int, max_steps: int, metrics: dict[str, float], eta_seconds: float | None = None) -> str:
    """One plain progress line: step, loss, learning rate, gradient norm, throughput, MFU, memory, ETA."""
    parts = [f"step {step}/{max_steps}"]
    formats = [
        ("train/loss", "loss {:.4f}"),
        ("train/lr", "lr {:.2e}"),
        ("train/grad_norm", "grad_norm {:.3f}"),
    ]
    parts += [text.format(metrics[key]) for key, text in formats if key in metrics]
    if rate := unit_rate(metrics):
        parts.append(f"{rate[1]:,.0f} {rate[0]}/s")
    parts += [text.format(metrics[key]) for key, text in MEMORY_FORMATS if key in metrics]
    if eta_seconds is not None:
        parts.append(f"eta {timedelta(seconds=round(eta_seconds))}")
    return " | ".join(parts)


MEMORY_FORMATS = [("throughput/mfu", "mfu {:.1%}"), ("memory/peak_reserved_gib", "gpu mem {:.1f} GiB")]


def unit_rate(metrics: dict[str, float]) -> tuple[str, float] | None:
    """("tokens", value) of the first global `throughput/<unit>s_per_second` among the metrics (the task's unit)."""
    for key, value in metrics.items():
        if key.startswith("throughput/") and key.endswith("_per_second") and "flops" not in key:
            return key.removeprefix("throughput/").removesuffix("_per_second"), value
    return None


class Progress:
    """Rank-0 progress: a live tqdm bar on a terminal; otherwise one plain line per logging interval."""

    def __init__(self, start_step: int, max_steps: int, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.max_steps, self.enabled = max_steps, enabled
        self.stream = stream or sys.stdout
        live = enabled and self.stream.isatty()
        # The size is read once; a terminal reporting 0 columns or rows (some ptys) would hide tqdm's bar.
        columns, rows = shutil.get_terminal_size()
        bar = {"total": max_steps, "initial": start_step, "unit": "step", "ncols": columns, "nrows": rows}
        self.bar = tqdm(file=self.stream, **bar) if live else None

    def advance(self, step: int) -> None:
        """Move the bar to `step` (nothing in a log: lines come only from `report`)."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def report(self, step: int, metrics: dict[str, float], eta_seconds: float | None) -> None:
        """Show the metrics of a logging step: in the bar's postfix, or as one line."""
        if self.bar is not None:
            loss, (unit, rate) = metrics.get("train/loss", math.nan), unit_rate(metrics) or ("samples", 0.0)
            self.bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} {unit}/s", refresh=True)
        elif self.enabled:
            self.write(progress_line(step, self.max_steps, metrics, eta_seconds))

    def write(self, message: str) -> None:
        """Print a message without breaking the bar."""
        if self.bar is not None:
            self.bar.write(message, file=self.stream)
        elif self.enabled:
            print(message, file=self.stream, flush=True)

    def close(self) -> None:
        """End the bar."""
        if self.bar is not None:
            self.bar.close()


class Monitor:
    """The one thing the loop reports to: step metrics every N steps, validation, checkpoint timings, progress.

    Every rank calls it (the loss and the memory are reduced across ranks at logging steps); only
    rank 0 logs and prints. Throughput is wall time between logging steps on rank 0, less the time
    spent validating and saving, so those do not depress it.
    """

    def __init__(
        self,
        fabric: Fabric,
        recipe: Recipe,
        start_step: int,
        samples_per_step: int,
        unit: str = "sample",
        units_per_sample: int = 1,
        flops_per_unit: float | None = None,
        startup: StartupClock | None = None,
    ) -> None:
        """`unit`, `units_per_sample`, `flops_per_unit`: the task's (tasks/base.py); None FLOPs: no MFU.
        `startup`: this lifetime's start-up so far, logged with the run's goodput (training/goodput.py)."""
        self.goodput = Goodput(fabric, startup, start_step) if startup is not None else None
        self.fabric, self.every = fabric, recipe.logger.log_every_steps
        self.max_steps, self.world_size = recipe.train.max_steps, fabric.world_size
        self.unit, self.samples_per_step = unit, samples_per_step
        self.units_per_step = samples_per_step * units_per_sample
        self.flops_per_unit = flops_per_unit
        self.progress = Progress(start_step, self.max_steps, enabled=fabric.global_rank == 0)
        self.peak = recipe.logger.peak_tflops
        self.rank_times = RankTimes(fabric.device, recipe.logger.straggler_margin)
        if flops_per_unit is None:
            self.progress.write(f"MFU not reported: task={recipe.task} does not count its model's FLOPs")
        elif self.peak is None and fabric.device.type == "cuda":
            device_name = torch.cuda.get_device_name(fabric.device)
            self.peak = peak_tflops(device_name, recipe.precision, torch.backends.cuda.matmul.allow_tf32)
            if self.peak is None:
                self.progress.write(
                    f"MFU not reported: no dense peak for {device_name!r} at precision {recipe.precision} in"
                    " hardware.GPUS; set logger.peak_tflops to report it"
                )
        self._start_window(start_step)
        self._first_window = True  # its steps hold one-time work: no straggler is named in it (stragglers.py)

    def _start_window(self, step: int) -> None:
        self._window_start, self._window_first_step = time.perf_counter(), step
        self._excluded_seconds = self._data_wait_seconds = 0.0
        self.rank_times.reset()

    def timed(self, batches: Iterable[Item]) -> Iterator[Item]:
        """Yield from `batches`, adding the time spent waiting for each item to the data-wait time."""
        iterator = iter(batches)
        while True:
            started = time.perf_counter()
            try:
                item = next(iterator)
            except StopIteration:
                return
            self._data_wait_seconds += time.perf_counter() - started
            yield item

    def step_end(
        self,
        step: int,
        loss: torch.Tensor,
        grad_norm: torch.Tensor | None,
        learning_rate: float,
        units_seen: int,
        epoch: int,
        model_figures: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Count a finished optimizer step; at logging steps reduce, log and show the metrics (all ranks call).
        `model_figures`: the model's own figures of the step, already reduced over the ranks (tasks/base.py)."""
        self.progress.advance(step)
        if self.goodput is not None:
            self.goodput.step_done(step)  # the first: this lifetime's start-up and redone steps logged
        if step % self.every and step != self.max_steps:
            return
        steps = step - self._window_first_step
        seconds = max(time.perf_counter() - self._window_start - self._excluded_seconds, 1e-9)
        # One collective for every rank's memory, data wait and own step time: the worst of each is logged, and
        # the slowest rank named (training/stragglers.py); the loss is averaged below.
        local = {**memory_gib(self.fabric.device), "time/data_wait_seconds": self._data_wait_seconds / max(steps, 1)}
        gathered, straggler = self.rank_times.gather(local, seconds, steps, first_window=self._first_window)
        self._first_window = False
        metrics: dict[str, float] = {
            "train/loss": cast(torch.Tensor, self.fabric.all_reduce(loss.detach(), reduce_op="mean")).item(),
            "train/lr": learning_rate,
            f"train/{self.unit}s_seen": float(units_seen),
            "train/epoch": float(epoch),
            **self.throughput(steps, seconds),
            **gathered,
            "time/step_seconds": seconds / max(steps, 1),
            "time/unix_time": time.time(),  # the time axis of `report`
            **{name: float(value) for name, value in (model_figures or {}).items()},
        }
        if self.goodput is not None:
            metrics.update(self.goodput.figures(step, metrics["time/step_seconds"]))
        metrics["time/data_wait_fraction"] = metrics["time/data_wait_seconds"] / metrics["time/step_seconds"]
        if grad_norm is not None:  # a DTensor under FSDP2
            metrics["train/grad_norm"] = float(
                grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            )
        self.fabric.log_dict(metrics, step=step)
        self.progress.report(step, metrics, eta_seconds=metrics["time/step_seconds"] * (self.max_steps - step))
        if straggler:
            self.progress.write(f"step {step}/{self.max_steps} | {straggler}")
        self._start_window(step)

    def throughput(self, steps: int, seconds: float) -> dict[str, float]:
        """Units (tokens, images, ...) and samples per second (global and per device), model TFLOP/s per device, MFU."""
        units_per_second = steps * self.units_per_step / seconds
        per_device = units_per_second / self.world_size
        metrics = {
            f"throughput/{self.unit}s_per_second": units_per_second,
            f"throughput/{self.unit}s_per_second_per_device": per_device,
            "throughput/samples_per_second": steps * self.samples_per_step / seconds,
            "throughput/samples_per_second_per_device": steps * self.samples_per_step / seconds / self.world_size,
        }
        if self.flops_per_unit is not None:
            metrics[f"throughput/flops_per_{self.unit}"] = float(self.flops_per_unit)
            metrics["throughput/tflops_per_second_per_device"] = self.flops_per_unit * per_device / 1e12
            if self.peak:
                metrics["throughput/mfu"] = model_flops_utilization(self.flops_per_unit, per_device, self.peak)
        return metrics

    def log_skipped_update(self, step: int, skipped_updates: int) -> None:
        """Say that every rank skipped this step's update (a non-finite loss under on_nonfinite_loss=skip)."""
        self.progress.write(
            f"Skipped the update of step {step}: loss is NaN or infinite on some rank"
            f" (train.on_nonfinite_loss=skip; {skipped_updates} skipped so far)"
        )
        self.fabric.log_dict({"train/skipped_updates": float(skipped_updates)}, step=step)

    def log_validation(self, step: int, results: dict[str, float], seconds: float, prefix: str = "val") -> None:
        """Log and show the task's validation figures (or, prefix "eval", its benchmarks' scores); their time does
        not count against throughput."""
        self._excluded_seconds += seconds
        metrics = {f"{prefix}/{name}": value for name, value in results.items()}
        timed = "time/validation_seconds" if prefix == "val" else f"time/{prefix}_seconds"
        self.fabric.log_dict({**metrics, timed: seconds}, step=step)
        shown = " | ".join(f"{prefix}_{name} {value:.4f}" for name, value in results.items())
        self.progress.write(f"step {step}/{self.max_steps} | {shown}")

    def log_checkpoint(self, step: int, path: Path, seconds: float, chosen: ChosenInterval | None = None) -> None:
        """Log how long a checkpoint took to save (its time does not count against throughput), and the interval
        that save chose (save_every_minutes=auto) when it chose one."""
        self._excluded_seconds += seconds
        metrics = {"time/checkpoint_save_seconds": seconds}
        if chosen is not None:
            metrics["checkpoint/interval_minutes"] = chosen.interval_seconds / 60
        self.fabric.log_dict(metrics, step=step)
        self.progress.write(f"Saved checkpoint {path} in {seconds:.1f}s")
        if chosen is not None:
            self.progress.write(chosen.line())

    def exclude(self, seconds: float) -> None:
        """Leave time spent on something other than training (writing a profiler trace) out of the figures."""
        self._excluded_seconds += seconds

    def print(self, message: str) -> None:
        """Print on rank 0 without breaking the progress bar."""
        self.progress.write(message)

    def close(self) -> None:
        """Say each rank's peak memory as of the last logging step; end the progress display."""
        for line in self.rank_times.memory_lines():
            self.progress.write(line)
        self.progress.close()
