"""The run's loggers (W&B, TensorBoard, CSV): building them, recording the recipe and provenance with them, the
final weights as a W&B artifact, closing them, and where their logs are (training/monitor.py logs through them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import uuid
from pathlib import Path
from typing import Any

from lightning.fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning.fabric.utilities.rank_zero import rank_zero_only

from ..checkpoint.provenance import LOGGED_FILE, PROVENANCE
from ..errors import RecipeError
from ..project import DEFAULT_LOGGER, PROJECT
from ..recipe.checks import wandb_has_credentials
from ..recipe.load import dump_recipe
from ..recipe.schema import Recipe
from .metrics_csv import MetricsCsv


def wandb_offline() -> bool:
    """W&B runs offline unless credentials are configured; WANDB_MODE=offline forces it."""
    return os.environ.get("WANDB_MODE") in ("offline", "dryrun") or not wandb_has_credentials()


def new_run_id() -> str:
    """A fresh W&B run id (8 lowercase hex characters)."""
    return uuid.uuid4().hex[:8]


def build_loggers(recipe: Recipe, run_id: str) -> list[Logger]:
    """The experiment logger the recipe names, and CSV files beside it; every rank builds them, only rank 0 writes.

    `run_id` is the W&B run to write to: a resumed job passes the id saved in its checkpoint, so it
    appends to the run it continues (W&B's resume="allow").
    """
    out_dir, config = Path(recipe.out_dir), recipe.logger
    if config.name in ("wandb", "tensorboard") and importlib.util.find_spec(config.name) is None:
        # The default logger's package is a dependency of the project; each other logger is an extra of its name.
        install = config.name if config.name == DEFAULT_LOGGER else f'"{PROJECT}[{config.name}]"'
        raise RecipeError(f"logger.name={config.name} needs {config.name}: pip install {install} (or another logger)")
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
            ),
            csv_logger(recipe),
        ]
    if config.name == "tensorboard":
        return [TensorBoardLogger(root_dir=out_dir / "tensorboard", name=config.run_name or ""), csv_logger(recipe)]
    if config.name == "csv":
        return [csv_logger(recipe)]
    return []


def csv_logger(recipe: Recipe) -> CSVLogger:
    """The CSV metrics every run keeps beside its experiment logger: what `report` reads, offline."""
    # Flush at every logging call so the metrics of a killed job survive it; a full disk ends the run as a save's.
    return MetricsCsv(
        root_dir=Path(recipe.out_dir) / "csv", name=recipe.logger.run_name or "", flush_logs_every_n_steps=1
    )


def logger_location(recipe: Recipe, loggers: list[Logger]) -> str:
    """Where the logs of this run are, in words, for the closing message."""
    if recipe.logger.name == "none":
        return "no experiment logger (logger.name=none)"
    if recipe.logger.name == "wandb":
        experiment = loggers[0].experiment  # type: ignore[attr-defined]  # a WandbLogger
        offline = experiment.settings.mode in ("offline", "dryrun")
        mode = "offline; upload later with `wandb sync`" if offline else "online"
        return f"W&B run {experiment.id} ({mode}): {Path(experiment.dir).parent}"
    return f"{recipe.logger.name} logs: {loggers[0].log_dir}"


def log_config(loggers: list[Logger], recipe: Recipe, provenance: dict[str, Any] | None = None) -> None:
    """Record the resolved recipe and what made the run (its provenance: commit, versions, hosts, launcher) once
    with every logger (rank 0 only): the CSV logger's folder holds them as config.yaml and provenance.json."""
    for logger in loggers:
        if isinstance(logger, CSVLogger):  # Fabric's CSVLogger has no hyperparameter support
            if rank_zero_only.rank == 0:  # type: ignore[attr-defined]  # set by Lightning at import
                _ = logger.experiment  # creates log_dir; writing into it first would make it warn
                (Path(logger.log_dir) / "config.yaml").write_text(dump_recipe(recipe))
                if provenance:
                    (Path(logger.log_dir) / LOGGED_FILE).write_text(json.dumps(provenance, indent=2) + "\n")
        else:
            logger.log_hyperparams({**recipe.to_dict(), **({PROVENANCE: provenance} if provenance else {})})


def upload_final_weights(loggers: list[Logger], checkpoints: Path) -> None:
    """Log the newest checkpoint's weights, consolidated into one file, as a W&B model artifact (rank 0).

    The artifact is named after the run (`model-<run id>`) and carries the step and the resolved recipe;
    offline runs keep it until `wandb sync`. Consolidating reads the whole model into host memory.
    """
    from ..checkpoint.layout import find_latest, read_meta
    from ..checkpoint.load import consolidate

    latest = find_latest(checkpoints)
    wandb_loggers: list[Any] = [logger for logger in loggers if type(logger).__name__ == "WandbLogger"]
    experiment = wandb_loggers[0].experiment if wandb_loggers else None
    if latest is None or experiment is None:
        return
    import wandb

    weights = consolidate(latest, latest.parent.parent / "final" / "weights.pt", force=True)  # the run's own file
    artifact = wandb.Artifact(
        f"model-{experiment.id}",
        type="model",
        metadata={"step": read_meta(latest)["step"], "parameters": sum(t.numel() for t in weights.values())},
    )
    artifact.add_file(str(latest.parent.parent / "final" / "weights.pt"))
    artifact.add_file(str(latest / "config.yaml"))
    experiment.log_artifact(artifact)
    print(f"Logged the weights of {latest.name} as W&B artifact model-{experiment.id}", flush=True)


def finish_loggers(loggers: list[Logger]) -> None:
    """Flush and close the loggers (W&B's run is finished so its offline files are complete)."""
    for logger in loggers:
        logger.finalize("success")
    if any(type(logger).__name__ == "WandbLogger" for logger in loggers):
        import wandb

        wandb.finish()
