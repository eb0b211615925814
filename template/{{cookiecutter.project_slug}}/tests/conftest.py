"""Shared helpers: run the command line in a subprocess exactly as a user would."""

from __future__ import annotations

import csv
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parents[1]
PACKAGE = "{{ cookiecutter.package_name }}"
RECIPES = PROJECT / "recipes"

# A model and run small enough for 2 CPU cores; every e2e test starts from cpu-debug plus these.
TINY = [
    "--model.n_layer",
    "2",
    "--model.n_embd",
    "64",
    "--model.n_head",
    "2",
    "--model.block_size",
    "64",
    "--train.micro_batch_size",
    "4",
    "--eval.batches",
    "2",
    "--logger.log_every_steps",
    "1",
]

# What every run logs with any logger (CPU runs: no GPU memory figures).
LOGGED_METRICS = {
    "train/loss",
    "train/lr",
    "train/grad_norm",
    "throughput/tokens_per_second",
    "throughput/tokens_per_second_per_device",
    "throughput/samples_per_second",
    "throughput/samples_per_second_per_device",
    "throughput/flops_per_token",
    "throughput/tflops_per_second_per_device",
    "throughput/mfu",
    "memory/host_peak_rss_gib",
    "time/data_wait_seconds",
    "time/data_wait_fraction",
    "time/checkpoint_save_seconds",
    "val/loss",
    "val/perplexity",
}


def cli_env() -> dict[str, str]:
    """Environment for a CLI subprocess: the package importable, W&B offline and quiet."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PROJECT / "src"), env.get("PYTHONPATH")]))
    env.update({"WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"})
    env.pop("WANDB_API_KEY", None)
    return env


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 600, fault: str = "", script: Path | None = None
) -> subprocess.CompletedProcess:
    """Run `python -m <package> ARGS` (or `python SCRIPT ARGS`) in its own session, so an injected fault kills
    only it; capture its output."""
    env = cli_env()
    if fault:
        env["TRAIN_FAULT"] = fault
    return subprocess.run(
        [sys.executable, *([str(script)] if script else ["-m", PACKAGE]), *args],
        cwd=cwd or PROJECT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        start_new_session=True,
    )


def read_csv_metrics(out_dir: Path) -> list[dict[str, str]]:
    """Rows of every CSV metrics file a run wrote, in version order."""
    rows: list[dict[str, str]] = []
    for path in sorted(out_dir.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with path.open() as handle:
            rows.extend(csv.DictReader(handle))
    return rows


def losses_by_run(out_dir: Path) -> list[dict[int, float]]:
    """step -> training loss, one dict per run (CSV version) into out_dir."""
    runs = []
    for path in sorted(out_dir.glob("csv/version_*/metrics.csv"), key=lambda p: int(p.parent.name.split("_")[1])):
        with path.open() as handle:
            runs.append({int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(handle) if r.get("train/loss")})
    return runs


def train_losses(out_dir: Path) -> dict[int, float]:
    """step -> logged training loss, over all runs into out_dir."""
    return {int(row["step"]): float(row["train/loss"]) for row in read_csv_metrics(out_dir) if row.get("train/loss")}


@pytest.fixture
def project() -> Path:
    """The generated project's root folder."""
    return PROJECT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without DeepSpeed (`pip install -e ".[dev]"`, e.g. on macOS) skip the tests that need it, saying how to get it."""
    if importlib.util.find_spec("deepspeed") is not None:
        return
    skip = pytest.mark.skip(reason='DeepSpeed is not installed: pip install -e ".[test]" (Linux) runs these too')
    for item in items:
        if "deepspeed" in item.nodeid.lower():
            item.add_marker(skip)
