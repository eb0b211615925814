"""What a run reports: loggers (W&B, TensorBoard, CSV), throughput, and rank-0 progress lines."""

from __future__ import annotations

import netrc
import os
import time
from pathlib import Path

from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.fabric.utilities.rank_zero import rank_zero_only

from {{ cookiecutter.package_name }}.config import Recipe, dump_recipe


def wandb_has_credentials() -> bool:
    """Whether W&B can go online: an API key in the environment or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def build_loggers(recipe: Recipe) -> list[Logger]:
    """The experiment logger the recipe names; every rank builds it, only rank 0 writes."""
    out_dir = Path(recipe.out_dir)
    name = recipe.logger.name
    if name == "wandb":
        from wandb.integration.lightning.fabric import WandbLogger

        offline = os.environ.get("WANDB_MODE") == "offline" or not wandb_has_credentials()
        return [
            WandbLogger(
                project=recipe.logger.project,
                name=recipe.logger.run_name,
                save_dir=str(out_dir),
                offline=offline,
            )
        ]
    if name == "tensorboard":
        return [TensorBoardLogger(root_dir=out_dir / "tensorboard", name=recipe.logger.run_name or "")]
    if name == "csv":
        # Flush at every logging call so the metrics of a killed job survive it.
        return [CSVLogger(root_dir=out_dir / "csv", name=recipe.logger.run_name or "", flush_logs_every_n_steps=1)]
    return []


def logger_location(recipe: Recipe, loggers: list[Logger]) -> str:
    """Where the logs of this run are, in words, for the closing message."""
    if not loggers:
        return "no experiment logger (logger.name=none)"
    if recipe.logger.name == "wandb":
        experiment = loggers[0].experiment
        offline = experiment.settings.mode in ("offline", "dryrun")
        mode = "offline; upload later with `wandb sync`" if offline else "online"
        return f"W&B run {experiment.id} ({mode}): {Path(experiment.dir).parent}"
    return f"{recipe.logger.name} logs: {loggers[0].log_dir}"


def log_config(loggers: list[Logger], recipe: Recipe) -> None:
    """Record the resolved recipe once with every logger (rank 0 only)."""
    for logger in loggers:
        if isinstance(logger, CSVLogger):  # Fabric's CSVLogger has no hyperparameter support
            if rank_zero_only.rank == 0:
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


class Throughput:
    """Tokens per second between two reports, from wall time on rank 0."""

    def __init__(self, tokens_seen: int = 0) -> None:
        self._last_time = time.perf_counter()
        self._last_tokens = tokens_seen

    def tokens_per_second(self, tokens_seen: int) -> float:
        """Global tokens per second since the previous call."""
        now = time.perf_counter()
        rate = (tokens_seen - self._last_tokens) / max(now - self._last_time, 1e-9)
        self._last_time, self._last_tokens = now, tokens_seen
        return rate


def progress_line(step: int, max_steps: int, metrics: dict[str, float]) -> str:
    """One plain progress line: step, loss, learning rate, throughput."""
    parts = [f"step {step}/{max_steps}"]
    if "train/loss" in metrics:
        parts.append(f"loss {metrics['train/loss']:.4f}")
    if "train/lr" in metrics:
        parts.append(f"lr {metrics['train/lr']:.2e}")
    if "train/grad_norm" in metrics:
        parts.append(f"grad_norm {metrics['train/grad_norm']:.3f}")
    if "train/tokens_per_second" in metrics:
        parts.append(f"{metrics['train/tokens_per_second']:,.0f} tokens/s")
    return " | ".join(parts)
