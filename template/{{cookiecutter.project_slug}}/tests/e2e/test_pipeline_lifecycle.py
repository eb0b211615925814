"""A pipeline-parallel job (2 stages on 2 CPU processes, gloo) through the life a cluster gives it.

One job in one out_dir, with W&B offline and checkpoints saved in the background, lives three times:
preempted by a stop signal that only its last stage gets (it saves the step it stopped at and exits to be
requeued), resumed and then SIGKILLed while a background save may still be in flight, resumed again to the
end. Each life logs the losses of an uninterrupted pipeline run bit for bit, writes to the same W&B run,
and the job ends with that run's weights.
The machinery's own test: it trains the toy task (tests/toy_task/), so it runs in every project.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import PIPELINE, assert_same_weights, final_weights, losses_by_run, run_cli, toy_train_args

from {{ cookiecutter.package_name }}.checkpoint.layout import find_latest
from {{ cookiecutter.package_name }}.errors import ExitCode

pytestmark = pytest.mark.slow

MAX_STEPS = 8
# Saves after steps 3 and 6 and at the end; a preempted life saves the step it stopped at besides.
SHARED = [
    "--train.max_steps", str(MAX_STEPS), "--eval.every_steps", "0", "--checkpoint.save_every_steps", "3",
    "--checkpoint.resume", "auto", *PIPELINE,
]  # fmt: skip
# The last rank (the last stage) gets SIGUSR1 after step 4: every rank stops and saves at step 5.
PREEMPTED_AT = 5
KILLED_AT = 7  # one step after the background save of step 6 started


@pytest.fixture(scope="module")
def reference(
    tmp_path_factory: pytest.TempPathFactory, toy_source: Path
) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """The uninterrupted pipeline run (saves in the foreground, CSV logs): (losses by step, final weights)."""
    out_dir = tmp_path_factory.mktemp("reference")
    result = run_cli(*toy_train_args(out_dir, *SHARED), source=toy_source)
    assert result.returncode == 0, result.stderr[-3000:]
    (losses,) = losses_by_run(out_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return losses, final_weights(out_dir, MAX_STEPS)


@pytest.fixture(scope="module")
def lives(tmp_path_factory: pytest.TempPathFactory, toy_source: Path) -> tuple[Path, list[subprocess.CompletedProcess]]:
    """(out_dir, [preempted, killed, finished]): the three lives of one pipeline job with W&B and async saves."""
    out_dir = tmp_path_factory.mktemp("job") / "run"
    args = toy_train_args(out_dir, *SHARED, "--logger.name", "wandb", "--checkpoint.async_save", "true")
    preempted = run_cli(*args, fault=f"signal-at-step:{PREEMPTED_AT - 1}:USR1", source=toy_source)
    killed = run_cli(*args, fault=f"kill-at-step:{KILLED_AT}", source=toy_source)
    finished = run_cli(*args, source=toy_source)
    return out_dir, [preempted, killed, finished]


def resumed_at(life: subprocess.CompletedProcess) -> int:
    """The step a life resumed from, read off its output."""
    match = re.search(r"Resumed from \S+ at step (\d+)", life.stdout)
    assert match, life.stdout[-3000:] + life.stderr[-3000:]
    return int(match.group(1))


def test_a_preempted_pipeline_job_saves_the_step_it_stopped_at_exits_for_requeue_and_resumes_there_bitwise(
    lives: tuple[Path, list[subprocess.CompletedProcess]], reference: tuple[dict[int, float], dict]
) -> None:
    out_dir, (preempted, killed, _) = lives
    expected_losses, _ = reference
    assert preempted.returncode == ExitCode.REQUEUE, preempted.stderr[-3000:]
    assert f"stopped: preempted by SIGUSR1 at step {PREEMPTED_AT}, checkpoint saved" in preempted.stderr
    assert "Traceback" not in preempted.stderr
    assert resumed_at(killed) == PREEMPTED_AT  # the preemption's checkpoint, written in the background, then waited for
    first_life, second_life, _ = losses_by_run(out_dir)
    assert first_life == {step: expected_losses[step] for step in range(1, PREEMPTED_AT + 1)}  # floats, exactly
    assert second_life == {step: expected_losses[step] for step in range(PREEMPTED_AT + 1, KILLED_AT + 1)}


def test_a_pipeline_job_killed_with_a_background_save_in_flight_resumes_bitwise(
    lives: tuple[Path, list[subprocess.CompletedProcess]], reference: tuple[dict[int, float], dict]
) -> None:
    out_dir, (_, killed, finished) = lives
    expected_losses, expected_weights = reference
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert finished.returncode == 0, finished.stderr[-3000:]
    # The save of step 6 is visible once written in the background: by the kill after step 7 it normally is.
    resumed = resumed_at(finished)
    assert resumed in (PREEMPTED_AT, KILLED_AT - 1)
    *_, third_life = losses_by_run(out_dir)
    assert third_life == {step: expected_losses[step] for step in range(resumed + 1, MAX_STEPS + 1)}
    assert find_latest(out_dir / "checkpoints").name == f"step-{MAX_STEPS:08d}"
    assert_same_weights(final_weights(out_dir, MAX_STEPS), expected_weights)


def test_every_life_of_a_pipeline_job_writes_to_one_wandb_run(
    lives: tuple[Path, list[subprocess.CompletedProcess]],
) -> None:
    out_dir, (preempted, _, finished) = lives
    runs = sorted((out_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 3, runs  # one folder per process lifetime ...
    run_ids = {run.name.rsplit("-", 1)[1] for run in runs}
    assert len(run_ids) == 1, runs  # ... all three writing to one W&B run
    (run_id,) = run_ids
    for life in (preempted, finished):  # the killed life never reached its last line
        assert f"W&B run {run_id} (offline" in life.stdout
    for meta in (out_dir / "checkpoints").glob("step-*[0-9]/meta.json"):
        assert json.loads(meta.read_text())["wandb_run_id"] == run_id, meta
