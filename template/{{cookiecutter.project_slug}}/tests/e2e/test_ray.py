"""`ray`: training in Ray Train's workers on a local Ray cluster of 2 CPUs. A worker killed with SIGKILL mid-run
makes Ray end the worker group and start it again; the new group resumes from the newest checkpoint and ends
with bitwise the weights of an uninterrupted `train` of the same recipe, in the same W&B run.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import (
    PACKAGE,
    PROJECT,
    RECIPES,
    assert_same_losses,
    assert_same_weights,
    cli_env,
    final_weights,
    losses_by_run,
    run_cli,
    run_overrides,
    train_args,
)

ray = pytest.importorskip("ray")

MAX_STEPS = 8
KILLED_AFTER = 4  # the step of the checkpoint that must exist when a worker is killed: the restart resumes from it
SHARED = ["--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps", str(KILLED_AFTER), "--eval.every_steps", "0"]  # fmt: skip


@contextlib.contextmanager
def local_cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A Ray cluster of this machine, started here: 2 CPUs, a small object store, no dashboard; its address.

    Its workers inherit this process's environment: the package importable, W&B offline, and a slow last rank
    from the step after the checkpoint on (training/faults.py), so a worker is killed while the run is still going.
    """
    for name, value in cli_env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TRAIN_FAULT", f"slow-rank:{KILLED_AFTER + 1}:0.5")
    context = ray.init(num_cpus=2, object_store_memory=200 * 2**20, include_dashboard=False, log_to_driver=False)
    try:
        yield context.address_info["address"]
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_a_killed_worker_restarts_the_group_which_resumes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Ray gives each one-CPU worker one thread; so does the reference (CPU kernels sum in another order otherwise).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reference = run_cli(*train_args(tmp_path / "reference", *SHARED))
    assert reference.returncode == 0, reference.stderr[-3000:]

    out_dir = tmp_path / "run"
    with local_cluster(monkeypatch) as address:
        command = [sys.executable, "-m", PACKAGE, "ray", str(RECIPES / "cpu-debug.yaml"), "--address", address]
        command += ["--max_failures", "1", *run_overrides(out_dir, *SHARED, "--logger.name", "wandb")]
        env = {**cli_env(), "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "600"}  # this machine's cores are shared
        log = tmp_path / "ray.log"  # a file, not a pipe: nothing reads the output until the worker is killed
        with log.open("w") as output_file, subprocess.Popen(command, cwd=PROJECT, env=env, stdout=output_file,
                                                            stderr=subprocess.STDOUT, start_new_session=True) as driver:  # fmt: skip
            killed = kill_rank_zero_after_checkpoint(out_dir, driver)
            driver.wait(timeout=600)
    output = log.read_text()
    assert driver.returncode == 0, output[-5000:]
    assert f"ray: done: {out_dir / 'checkpoints' / f'step-{MAX_STEPS:08d}'}" in output
    # Ray's controller says the worker group failed once and starts it again: the restart count, in the log.
    assert output.count("ray: restart 1 of 1: the worker group failed (rank ") == 1, output[-5000:]
    assert "ray: restart 2" not in output
    assert f"Resumed from {out_dir / 'checkpoints' / f'step-{KILLED_AFTER:08d}'} at step {KILLED_AFTER}" in output
    assert f"pid={killed})" in output  # the process killed was a worker of the group Ray started

    expected = losses_by_run(tmp_path / "reference")[0]
    # Ray's own reporting got the steps and losses: its last report is the last step's.
    assert f"ray: reported step {MAX_STEPS}, loss {expected[MAX_STEPS]:.6f} (rank 0)" in output, output[-3000:]
    before, after = losses_by_run(out_dir)  # the killed group's steps, then the restarted group's
    assert KILLED_AFTER in before and MAX_STEPS not in before
    assert_same_losses(before, {step: expected[step] for step in before}, tolerance=0.0)
    assert_same_losses(after, {step: expected[step] for step in range(KILLED_AFTER + 1, MAX_STEPS + 1)}, tolerance=0.0)
    assert_same_weights(final_weights(out_dir, MAX_STEPS), final_weights(tmp_path / "reference", MAX_STEPS))
    # W&B (offline here) stays one run: the restarted group's rank 0 appends to the run the first one began.
    runs = sorted((out_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({run.name.rsplit("-", 1)[1] for run in runs}) == 1, runs


def kill_rank_zero_after_checkpoint(out_dir: Path, driver: subprocess.Popen) -> int:
    """SIGKILL the worker of rank 0 once the checkpoint of KILLED_AFTER is complete; its pid.

    Rank 0 holds out_dir's lock, whose file records its pid (checkpoint/lock.py); a checkpoint folder exists only
    once complete (written as .partial, then renamed).
    """
    checkpoint, deadline = out_dir / "checkpoints" / f"step-{KILLED_AFTER:08d}", time.monotonic() + 540
    while not checkpoint.is_dir():
        assert driver.poll() is None, "the run ended before its first checkpoint"
        assert time.monotonic() < deadline, "no checkpoint within 9 minutes"
        time.sleep(0.1)
    pid = int(json.loads((out_dir / "run.lock").read_text())["pid"])
    assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::"), "rank 0 is a Ray worker process"
    os.kill(pid, signal.SIGKILL)
    return pid
