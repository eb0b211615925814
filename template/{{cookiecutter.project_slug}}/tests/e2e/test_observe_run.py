"""End to end with W&B offline: 2-process training is killed after a checkpoint, then resumed with
`resume: auto`; both processes must write to one W&B run, log every metric and the config, keep
the progress log short, and write no secret anywhere."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import LOGGED_METRICS, PACKAGE, UNIT, cli_env, run_cli, train_args

pytestmark = pytest.mark.slow

# Configured the way users do (environment variables), with W&B kept offline: nothing may leak them.
SECRETS = {"WANDB_API_KEY": "local-5ec7e7a91b2c3d4e5f60718293a4b5c6d7e8f901", "HF_TOKEN": "hf_TopSecretTestToken42"}
LOG_EVERY = 2


def train_command(out_dir: Path, max_steps: int) -> list[str]:
    return [
        sys.executable, "-m", PACKAGE,
        *train_args(
            out_dir,
            "--train.max_steps", str(max_steps), "--checkpoint.save_every_steps", "3", "--checkpoint.resume", "auto",
            "--eval.every_steps", "3", "--logger.name", "wandb", "--logger.group", "resume-group",
            "--logger.log_every_steps", str(LOG_EVERY),
            "--logger.peak_tflops", "0.5",  # CPUs are not in the GPU table; a stated peak makes MFU appear
        ),
    ]  # fmt: skip


def wandb_runs(out_dir: Path) -> list[Path]:
    return sorted((out_dir / "wandb").glob("offline-run-*"))


def run_id_of(run_dir: Path) -> str:
    return run_dir.name.rsplit("-", 1)[1]


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Start a long run, SIGKILL its whole process group after its first checkpoint, then resume it."""
    out_dir = tmp_path_factory.mktemp("observe") / "run"
    env = {**cli_env(), **SECRETS}
    log = (out_dir.parent / "killed.log").open("w")
    killed = subprocess.Popen(
        train_command(out_dir, max_steps=100_000), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    deadline = time.monotonic() + 300
    # A finished checkpoint only: `step-*.partial` holds a meta.json too, for the moment before its rename.
    while not list((out_dir / "checkpoints").glob("step-*[0-9]/meta.json")) and killed.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    os.killpg(killed.pid, signal.SIGKILL)  # what a preempted node or `scancel` does to every rank
    killed.wait()
    log.close()
    assert killed.returncode == -signal.SIGKILL, (out_dir.parent / "killed.log").read_text()[-3000:]
    latest = max(int(path.name.split("-")[1]) for path in (out_dir / "checkpoints").glob("step-*[0-9]"))
    resumed = subprocess.run(
        train_command(out_dir, max_steps=latest + 5), env=env, capture_output=True, text=True, timeout=600
    )
    return {"out_dir": out_dir, "killed": killed, "latest": latest, "resumed": resumed}


def test_a_killed_job_resumed_with_resume_auto_appends_to_the_same_wandb_run(killed_and_resumed: dict) -> None:
    out_dir, resumed, latest = (
        killed_and_resumed["out_dir"],
        killed_and_resumed["resumed"],
        killed_and_resumed["latest"],
    )
    assert killed_and_resumed["killed"].returncode == -signal.SIGKILL
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"at step {latest}" in resumed.stdout

    runs = wandb_runs(out_dir)
    assert len(runs) == 2, runs  # one folder per process lifetime ...
    run_id = run_id_of(runs[0])
    assert run_id_of(runs[1]) == run_id  # ... both writing to one W&B run
    assert f"W&B run {run_id} (offline" in resumed.stdout
    for meta in (out_dir / "checkpoints").glob("step-*[0-9]/meta.json"):
        assert json.loads(meta.read_text())["wandb_run_id"] == run_id, meta


def test_wandb_offline_run_holds_every_metric_and_the_config(killed_and_resumed: dict) -> None:
    records = (next(wandb_runs(killed_and_resumed["out_dir"])[1].glob("run-*.wandb"))).read_bytes()
    config = ["max_steps", "micro_batch_size", "log_every_steps", "peak_tflops", "resume-group"]
    missing = [key for key in [*sorted(LOGGED_METRICS), *config] if key.encode() not in records]
    assert not missing


def test_no_secret_in_the_environment_reaches_any_file_the_run_writes(killed_and_resumed: dict) -> None:
    assert killed_and_resumed["resumed"].returncode == 0
    files = [path for path in killed_and_resumed["out_dir"].rglob("*") if path.is_file()]
    assert len(files) > 10  # checkpoints, configs, W&B run files and logs
    for path in files:
        content = path.read_bytes()
        for name, value in SECRETS.items():
            assert value.encode() not in content, f"{name} written into {path}"


def test_progress_in_a_cluster_log_is_one_line_per_logging_interval(killed_and_resumed: dict) -> None:
    resumed, latest = killed_and_resumed["resumed"], killed_and_resumed["latest"]
    max_steps = latest + 5
    progress = [line for line in resumed.stdout.splitlines() if re.match(r"step \d+/\d+ \| loss ", line)]
    logging_steps = [step for step in range(latest + 1, max_steps + 1) if step % LOG_EVERY == 0 or step == max_steps]
    assert [int(line.split()[1].split("/")[0]) for line in progress] == logging_steps
    assert "eta " in progress[-1]
    assert "\r" not in resumed.stdout + resumed.stderr  # no progress bar redrawn into a log file


def test_on_a_terminal_rank_zero_draws_a_live_progress_bar_instead_of_lines(tmp_path: Path) -> None:
    command = [*train_command(tmp_path / "run", max_steps=12), "--logger.name", "csv", "--logger.peak_tflops", "null"]
    terminal, child_side = pty.openpty()
    process = subprocess.Popen(command, env=cli_env(), stdin=subprocess.DEVNULL, stdout=child_side, stderr=child_side)
    os.close(child_side)
    output, deadline = b"", time.monotonic() + 300
    while time.monotonic() < deadline:
        if select.select([terminal], [], [], 1.0)[0]:
            try:
                chunk = os.read(terminal, 65536)
            except OSError:  # every process holding the terminal has exited
                break
            if not chunk:
                break
            output += chunk
    os.close(terminal)
    assert process.wait(timeout=60) == 0, output.decode(errors="replace")[-3000:]
    text = output.decode(errors="replace")
    final_bar = r"12/12 \[\d\d:\d\d<\d\d:\d\d,\s+[\d.]+step/s, loss \d\.\d{4}, [\d,]+ " + UNIT + r"s/s\]"  # elapsed<ETA
    assert re.search(final_bar, text), text[-2000:]
    assert not re.search(r"step \d+/12 \| loss", text)  # no plain lines while the bar is drawn


@pytest.mark.slow
def test_the_final_weights_are_logged_as_a_wandb_artifact_when_asked(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = ["--devices", "1", "--train.max_steps", "2", "--eval.every_steps", "0", "--checkpoint.resume", "null"]
    result = run_cli(*train_args(out_dir, *args, "--logger.name", "wandb", "--logger.upload_final_weights", "true"))
    assert result.returncode == 0, result.stderr[-3000:]
    run_id = run_id_of(wandb_runs(out_dir)[0])
    assert f"Logged the weights of step-00000002 as W&B artifact model-{run_id}" in result.stdout
    weights = torch.load(out_dir / "final" / "weights.pt", weights_only=True)
    assert ("lm_head.weight" if UNIT == "token" else "head.weight") in weights  # the model's output layer
    records = next(wandb_runs(out_dir)[0].glob("run-*.wandb")).read_bytes()
    assert f"model-{run_id}".encode() in records and b"weights.pt" in records
