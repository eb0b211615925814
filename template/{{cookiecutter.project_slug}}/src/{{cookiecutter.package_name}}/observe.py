"""What a run reports: loggers (W&B, TensorBoard, CSV), throughput and MFU, memory, and rank-0 progress.

The loop talks to one `Monitor`: it times the data, counts steps, and every `logger.log_every_steps`
steps logs the metrics below to the chosen logger and shows them as progress (a live bar on a
terminal, one plain line per interval in a cluster log).

    train/loss, train/lr, train/grad_norm, train/tokens_seen, train/epoch
    throughput/tokens_per_second, .../tokens_per_second_per_device, .../samples_per_second,
        .../samples_per_second_per_device, .../flops_per_token, .../tflops_per_second_per_device, .../mfu
    memory/peak_allocated_gib, memory/peak_reserved_gib (GPU), memory/host_peak_rss_gib (max over ranks)
    time/step_seconds, time/data_wait_seconds (per step, max over ranks), time/data_wait_fraction,
        time/checkpoint_save_seconds, time/validation_seconds
    val/loss, val/perplexity
"""

from __future__ import annotations

import importlib.util
import math
import netrc
import os
import shutil
import sys
import time
import uuid
from collections.abc import Iterable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import TextIO, TypeVar, cast

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.fabric.utilities.rank_zero import rank_zero_only
from tqdm import tqdm

from {{ cookiecutter.package_name }}.config import Recipe, dump_recipe
from {{ cookiecutter.package_name }}.errors import RecipeError

try:
    import resource
except ImportError:  # not on Windows: host memory is then not reported
    resource = None  # type: ignore[assignment]

Item = TypeVar("Item")

# Dense peak tensor TFLOP/s of one GPU, from NVIDIA's datasheets and architecture whitepapers, which
# quote tensor figures "with sparsity" (2:4 structured sparsity, twice the dense rate a training run
# can reach): the dense figure is half of that. fp32 is the non-tensor rate; tf32 applies to 32-true
# when torch.backends.cuda.matmul.allow_tf32 is on. bf16/fp16 are with fp32 accumulation (what
# PyTorch uses; GeForce cards run fp16 accumulation twice as fast). A GPU missing here falls back to
# Lightning's table (LIGHTNING_ROWS_NOT_USED says which of its rows are wrong and skipped).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "GB200": {"bf16": 2500.0, "fp16": 2500.0, "tf32": 1250.0},  # GB200 NVL72: 360 PF sparse bf16 / 72 GPUs / 2
    "B200": {"bf16": 2250.0, "fp16": 2250.0},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H200 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    # The export variants: H800 computes as the H100 (less NVLink bandwidth); H20 is a cut-down Hopper.
    "H800 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 67.0},
    "H800 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H20": {"bf16": 148.0, "fp16": 148.0, "tf32": 74.0, "fp32": 44.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A40": {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    # AWS's A10G has no NVIDIA datasheet; like Lightning, the A10's figures (set logger.peak_tflops to override).
    "A10G": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX A6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},  # Ada whitepaper, fp32 accumulate
    "T4": {"fp16": 65.0, "fp32": 8.1},  # Turing: no bf16 or tf32 tensor cores
    "V100 SXM": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
}
# (word in the device name, second word or None, table row): the first match wins, so variants first.
GPU_NAME_RULES = [
    ("GB200", None, "GB200"),
    ("GH200", None, "GH200"),
    ("H200", "NVL", "H200 NVL"),
    ("H200", None, "H200 SXM"),
    ("H100", "NVL", "H100 NVL"),
    ("H100", "PCIE", "H100 PCIe"),
    ("H100", None, "H100 SXM"),
    ("H800", "PCIE", "H800 PCIe"),
    ("H800", None, "H800 SXM"),
    ("H20", None, "H20"),
    ("B200", None, "B200"),
    ("A100", None, "A100"),
    ("L40S", None, "L40S"),
    ("L40", None, "L40"),
    ("L4", None, "L4"),
    ("A40", None, "A40"),
    ("A10G", None, "A10G"),
    ("A10", None, "A10"),
    ("A6000", None, "RTX A6000"),
    ("4090", None, "RTX 4090"),
    ("T4", None, "T4"),
    ("V100", "PCIE", "V100 PCIe"),
    ("V100", None, "V100 SXM"),
]
PRECISION_COLUMN = {"bf16-mixed": "bf16", "bf16-true": "bf16", "16-mixed": "fp16", "16-true": "fp16"}
# Rows of Lightning's table (lightning.fabric.utilities.throughput._CUDA_FLOPS) that are wrong for MFU:
# H200 and H100 NVL list the sparse peaks (2000, 1700, 1979 bf16), and the H200 keys ("h200 sxm1")
# never match the names torch reports; the GeForce RTX 30xx/40xx, RTX A6000, A40 and Titan RTX rows
# list the non-tensor fp32 rate as bf16/fp16 (the A40 does 149.7 dense bf16, not 37.4); the RTX 20xx
# rows list the non-tensor fp16 rate. Its other rows (A100, H100 SXM/PCIe, L4, L40, A10G, T4, V100,
# V100S, Quadro RTX 5000) agree with the datasheets.
LIGHTNING_ROWS_NOT_USED = ("h200", "h100 nvl", "rtx 40", "rtx 30", "rtx 20", "a6000", "a40", "titan rtx")
LIGHTNING_COLUMN: dict[str, torch.dtype | str] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "tf32": "tfloat32",
    "fp32": torch.float32,
}


def gpu_model(device_name: str) -> str | None:
    """The row of PEAK_TFLOPS for a name as `torch.cuda.get_device_name` reports it, e.g. 'NVIDIA H200'."""
    words = set(device_name.upper().replace("-", " ").split())
    for word, variant, row in GPU_NAME_RULES:
        if word in words and (variant is None or variant in words):
            return row
    return None


def lightning_peak_tflops(device_name: str, column: str) -> float | None:
    """Dense peak TFLOP/s from Lightning's table for a GPU missing from ours, unless its row is a known wrong one."""
    try:
        from lightning.fabric.utilities.throughput import _CUDA_FLOPS
    except ImportError:  # a private table: gone in some Lightning release, then no fallback
        return None
    name = f" {' '.join(device_name.lower().replace('-', ' ').split())} "
    for chip in _CUDA_FLOPS:  # whole words only: "a100" is not the "RTX A1000"
        if f" {chip} " in name and not chip.startswith(LIGHTNING_ROWS_NOT_USED):
            flops = _CUDA_FLOPS[chip].get(LIGHTNING_COLUMN[column])
            return flops / 1e12 if flops else None
    return None


def peak_tflops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """Dense peak TFLOP/s of one GPU at a recipe precision; None when neither table has the GPU at that precision."""
    row = gpu_model(device_name)
    column = PRECISION_COLUMN.get(precision, "tf32" if tf32 else "fp32")
    if row is not None:
        return PEAK_TFLOPS[row].get(column)
    return lightning_peak_tflops(device_name, column)


def model_flops_utilization(flops_per_token: float, tokens_per_second_per_device: float, peak: float) -> float:
    """MFU: the model FLOP/s one device achieves as a fraction of its peak (given in TFLOP/s)."""
    return flops_per_token * tokens_per_second_per_device / (peak * 1e12)


def wandb_has_credentials() -> bool:
    """Whether W&B can go online: an API key in the environment or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def wandb_offline() -> bool:
    """W&B runs offline unless credentials are configured; WANDB_MODE=offline forces it."""
    return os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_has_credentials()


def new_run_id() -> str:
    """A fresh W&B run id (8 lowercase hex characters)."""
    return uuid.uuid4().hex[:8]


def build_loggers(recipe: Recipe, run_id: str) -> list[Logger]:
    """The experiment logger the recipe names; every rank builds it, only rank 0 writes.

    `run_id` is the W&B run to write to: a resumed job passes the id saved in its checkpoint, so it
    appends to the run it continues (W&B's resume="allow").
    """
    out_dir, config = Path(recipe.out_dir), recipe.logger
    if config.name in ("wandb", "tensorboard") and importlib.util.find_spec(config.name) is None:
        raise RecipeError(
            f"logger.name={config.name} needs the {config.name} package:"
            f' pip install "{{ cookiecutter.project_slug }}[{config.name}]" (or choose another logger.name)'
        )
    if config.name == "wandb":
        # Lightning's own W&B logger works with Fabric (a Fabric logger underneath). It opens the run
        # with resume="allow" and logs the step as the metric trainer/global_step, the x-axis of every
        # chart, so a resumed run continues its curves. mode= rather than its offline= flag, which
        # would set WANDB_MODE for the whole process.
        from lightning.pytorch.loggers import WandbLogger

        return [
            WandbLogger(
                project=config.project,
                entity=config.entity,
                name=config.run_name,
                group=config.group,
                tags=config.tags or None,
                id=run_id,
                save_dir=str(out_dir),
                mode="offline" if wandb_offline() else "online",
            )
        ]
    if config.name == "tensorboard":
        return [TensorBoardLogger(root_dir=out_dir / "tensorboard", name=config.run_name or "")]
    if config.name == "csv":
        # Flush at every logging call so the metrics of a killed job survive it.
        return [CSVLogger(root_dir=out_dir / "csv", name=config.run_name or "", flush_logs_every_n_steps=1)]
    return []


def logger_location(recipe: Recipe, loggers: list[Logger]) -> str:
    """Where the logs of this run are, in words, for the closing message."""
    if not loggers:
        return "no experiment logger (logger.name=none)"
    if recipe.logger.name == "wandb":
        experiment = loggers[0].experiment  # type: ignore[attr-defined]  # a WandbLogger
        offline = experiment.settings.mode in ("offline", "dryrun")
        mode = "offline; upload later with `wandb sync`" if offline else "online"
        return f"W&B run {experiment.id} ({mode}): {Path(experiment.dir).parent}"
    return f"{recipe.logger.name} logs: {loggers[0].log_dir}"


def log_config(loggers: list[Logger], recipe: Recipe) -> None:
    """Record the resolved recipe once with every logger (rank 0 only)."""
    for logger in loggers:
        if isinstance(logger, CSVLogger):  # Fabric's CSVLogger has no hyperparameter support
            if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set by Lightning at import
                _ = logger.experiment  # creates log_dir; writing into it first would make it warn
                (Path(logger.log_dir) / "config.yaml").write_text(dump_recipe(recipe))
        else:
            logger.log_hyperparams(recipe.to_dict())


def finish_loggers(loggers: list[Logger]) -> None:
    """Flush and close the loggers (W&B's run is finished so its offline files are complete)."""
    for logger in loggers:
        logger.finalize("success")
    if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
        import wandb

        wandb.finish()


def memory_gib(device: torch.device) -> dict[str, float]:
    """Peak GPU memory allocated and reserved by this process (GPU only) and its peak host RSS, in GiB."""
    memory = {}
    if device.type == "cuda":
        memory["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        memory["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    if resource is not None:  # ru_maxrss is KiB on Linux, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        memory["memory/host_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale / 2**30
    return memory


def progress_line(step: int, max_steps: int, metrics: dict[str, float], eta_seconds: float | None = None) -> str:
    """One plain progress line: step, loss, learning rate, gradient norm, throughput, MFU, memory, ETA."""
    parts = [f"step {step}/{max_steps}"]
    formats = [
        ("train/loss", "loss {:.4f}"),
        ("train/lr", "lr {:.2e}"),
        ("train/grad_norm", "grad_norm {:.3f}"),
        ("throughput/tokens_per_second", "{:,.0f} tokens/s"),
        ("throughput/mfu", "mfu {:.1%}"),
        ("memory/peak_reserved_gib", "gpu mem {:.1f} GiB"),
    ]
    parts += [text.format(metrics[key]) for key, text in formats if key in metrics]
    if eta_seconds is not None:
        parts.append(f"eta {timedelta(seconds=round(eta_seconds))}")
    return " | ".join(parts)


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
            loss, rate = metrics.get("train/loss", math.nan), metrics.get("throughput/tokens_per_second", 0.0)
            self.bar.set_postfix_str(f"loss {loss:.4f}, {rate:,.0f} tokens/s", refresh=True)
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
    spent validating and saving, so those do not depress tokens/s.
    """

    def __init__(
        self, fabric: Fabric, recipe: Recipe, flops_per_token: int, start_step: int, samples_per_step: int
    ) -> None:
        self.fabric, self.every = fabric, recipe.logger.log_every_steps
        self.max_steps, self.world_size = recipe.train.max_steps, fabric.world_size
        self.samples_per_step, self.tokens_per_step = samples_per_step, samples_per_step * recipe.model.block_size
        self.flops_per_token = flops_per_token
        self.progress = Progress(start_step, self.max_steps, enabled=fabric.global_rank == 0)
        self.peak = recipe.logger.peak_tflops
        if self.peak is None and fabric.device.type == "cuda":
            device_name = torch.cuda.get_device_name(fabric.device)
            self.peak = peak_tflops(device_name, recipe.precision, torch.backends.cuda.matmul.allow_tf32)
            if self.peak is None:
                self.progress.write(
                    f"MFU not reported: no dense peak for {device_name!r} at precision {recipe.precision} in"
                    " observe.PEAK_TFLOPS; set logger.peak_tflops to report it"
                )
        self._start_window(start_step)

    def _start_window(self, step: int) -> None:
        self._window_start, self._window_first_step = time.perf_counter(), step
        self._excluded_seconds = self._data_wait_seconds = 0.0

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
        tokens_seen: int,
        epoch: int,
    ) -> None:
        """Count a finished optimizer step; at logging steps reduce, log and show the metrics (all ranks call)."""
        self.progress.advance(step)
        if step % self.every and step != self.max_steps:
            return
        steps = step - self._window_first_step
        seconds = max(time.perf_counter() - self._window_start - self._excluded_seconds, 1e-9)
        # One collective for what is worst on any rank: memory and data wait (loss is averaged below).
        local = {**memory_gib(self.fabric.device), "time/data_wait_seconds": self._data_wait_seconds / max(steps, 1)}
        worst = cast(
            torch.Tensor,
            self.fabric.all_reduce(torch.tensor(list(local.values()), device=self.fabric.device), reduce_op="max"),
        )
        metrics: dict[str, float] = {
            "train/loss": cast(torch.Tensor, self.fabric.all_reduce(loss.detach(), reduce_op="mean")).item(),
            "train/lr": learning_rate,
            "train/tokens_seen": float(tokens_seen),
            "train/epoch": float(epoch),
            **self.throughput(steps, seconds),
            **dict(zip(local, worst.tolist(), strict=True)),
            "time/step_seconds": seconds / max(steps, 1),
        }
        metrics["time/data_wait_fraction"] = metrics["time/data_wait_seconds"] / metrics["time/step_seconds"]
        if grad_norm is not None:  # a DTensor under FSDP2
            metrics["train/grad_norm"] = float(
                grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
            )
        self.fabric.log_dict(metrics, step=step)
        self.progress.report(step, metrics, eta_seconds=metrics["time/step_seconds"] * (self.max_steps - step))
        self._start_window(step)

    def throughput(self, steps: int, seconds: float) -> dict[str, float]:
        """Tokens and samples per second (global and per device), model TFLOP/s per device and MFU."""
        tokens_per_second = steps * self.tokens_per_step / seconds
        per_device = tokens_per_second / self.world_size
        metrics = {
            "throughput/tokens_per_second": tokens_per_second,
            "throughput/tokens_per_second_per_device": per_device,
            "throughput/samples_per_second": steps * self.samples_per_step / seconds,
            "throughput/samples_per_second_per_device": steps * self.samples_per_step / seconds / self.world_size,
            "throughput/flops_per_token": float(self.flops_per_token),
            "throughput/tflops_per_second_per_device": self.flops_per_token * per_device / 1e12,
        }
        if self.peak:
            metrics["throughput/mfu"] = model_flops_utilization(self.flops_per_token, per_device, self.peak)
        return metrics

    def log_validation(self, step: int, loss: float, seconds: float) -> None:
        """Log and show a validation result; its time does not count against throughput."""
        self._excluded_seconds += seconds
        metrics = {"val/loss": loss, "val/perplexity": math.exp(loss), "time/validation_seconds": seconds}
        self.fabric.log_dict(metrics, step=step)
        self.progress.write(f"step {step}/{self.max_steps} | val_loss {loss:.4f} | val_perplexity {math.exp(loss):.2f}")

    def log_checkpoint(self, step: int, path: Path, seconds: float) -> None:
        """Log how long a checkpoint took to save; its time does not count against throughput."""
        self._excluded_seconds += seconds
        self.fabric.log_dict({"time/checkpoint_save_seconds": seconds}, step=step)
        self.progress.write(f"Saved checkpoint {path} in {seconds:.1f}s")

    def print(self, message: str) -> None:
        """Print on rank 0 without breaking the progress bar."""
        self.progress.write(message)

    def close(self) -> None:
        """End the progress display."""
        self.progress.close()
