"""`submit`: training through submitit. No SLURM here, so the job runs under submitit's local executor,
whose controller starts one task per device, signals them before its time limit and starts them again when
a task asks for a requeue, as SLURM does with `scontrol requeue`.

The preempted job is the tiny cpu-debug run on 2 processes (gloo); an uninterrupted `train` of the same
recipe is the reference it must match: the same losses and bitwise the same final weights.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from helpers import (
    MULTINODE,
    PACKAGE,
    RECIPES,
    assert_same_losses,
    assert_same_weights,
    executable,
    fail_with,
    final_weights,
    losses_by_run,
    run_cli,
    run_cli_without,
    run_overrides,
    train_args,
)

from {{ cookiecutter.package_name }}.cli import main

MAX_STEPS = 24
# Saves only at the end (and when preempted): the requeued job can only resume from the preemption's checkpoint.
SHARED = ["--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps", "0", "--eval.every_steps", "0"]
BAD_RECIPE = "devices: 0\n"


@pytest.mark.slow
def test_a_preempted_job_saves_is_requeued_by_submitit_and_resumes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fabric's own launch and submitit's tasks get the same thread count: CPU kernels sum in another order otherwise.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    reference = run_cli(*train_args(tmp_path / "reference", *SHARED))
    assert reference.returncode == 0, reference.stderr[-3000:]

    out_dir, folder = tmp_path / "run", tmp_path / "jobs"
    submit = ["submit", str(RECIPES / "cpu-debug.yaml"), *run_overrides(out_dir, *SHARED)]
    # The last rank gets submitit's signal after step 10 (SLURM's may reach only some ranks): all save step 11.
    result = run_cli(*submit, "--local", "--wait", "--folder", str(folder), fault="signal-at-step:10:USR2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job = result.stdout.split()[2]
    assert f"job {job} done: {out_dir / 'checkpoints' / f'step-{MAX_STEPS:08d}'}" in result.stdout

    rank_zero, rank_zero_errors = (folder / f"{job}_0_log.out").read_text(), (folder / f"{job}_0_log.err").read_text()
    assert "stopped: preempted by SIGUSR2 at step 11, checkpoint saved; submitit requeues the job" in rank_zero_errors
    assert f"Requeued job {job}" in rank_zero  # submitit's own requeue: rank 0 handed it the signal
    assert "Resumed from" in rank_zero and "step-00000011 at step 11" in rank_zero
    for rank in (0, 1):  # each task ran twice and returned once: no result was written when it was preempted
        log = (folder / f"{job}_{rank}_log.out").read_text()
        assert (log.count("Starting with JobEnvironment"), log.count("Job completed successfully")) == (2, 1)

    expected = losses_by_run(tmp_path / "reference")[0]
    before, after = losses_by_run(out_dir)
    assert_same_losses(before, {step: expected[step] for step in range(1, 12)}, tolerance=0.0)
    assert_same_losses(after, {step: expected[step] for step in range(12, MAX_STEPS + 1)}, tolerance=0.0)
    assert_same_weights(final_weights(out_dir, MAX_STEPS), final_weights(tmp_path / "reference", MAX_STEPS))


@pytest.mark.slow
def test_wait_reports_a_failed_job_in_one_line_with_exit_code_1(tmp_path: Path) -> None:
    out_dir, folder = tmp_path / "run", tmp_path / "jobs"
    submit = ["submit", str(RECIPES / "cpu-debug.yaml"), *run_overrides(out_dir, *SHARED)]
    result = run_cli(*submit, "--local", "--wait", "--folder", str(folder), fault="nan-at-step:3")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    job = result.stdout.split()[2]
    assert result.stderr == (
        f"stopped: job {job} failed: {PACKAGE}.errors.TrainingStopped: loss is NaN or infinite at step 3"
        " (train.on_nonfinite_loss=stop): lower train.learning_rate or raise train.warmup_steps, then resume from"
        f" the last checkpoint; or set train.on_nonfinite_loss=skip (log: {folder / f'{job}_0_log.err'})\n"
    )


def test_submitted_to_slurm_the_job_asks_for_the_recipes_layout_a_requeue_and_submitits_signal_before_the_limit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # No SLURM here: an sbatch that keeps the script submitit wrote and answers as SLURM does, and an srun.
    executable(tmp_path / "sbatch", f'#!/bin/sh\ncp "$1" {tmp_path / "job.sh"}\necho "Submitted batch job 4242"\n')
    executable(tmp_path / "srun", "#!/bin/sh\nexit 1\n")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    folder = tmp_path / "jobs"
    main(["submit", MULTINODE, "--time", "1-00:00:00", "--partition", "gpu", "--folder", str(folder)])
    printed = capsys.readouterr().out
    assert printed.startswith("submitted job 4242 to SLURM: 4 node(s) x 8 task(s)")
    assert f"logs: {folder / '4242_0_log.out'} and {folder / '4242_0_log.err'}" in printed
    script = (tmp_path / "job.sh").read_text()
    options = {line.removeprefix("#SBATCH ") for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {
        "--nodes=4", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=8", "--time=1440",
        "--partition=gpu", "--job-name={{ cookiecutter.project_slug }}", "--requeue", "--signal=USR2@120", "--open-mode=append",
    } <= options  # fmt: skip
    assert "-m submitit.core._submit" in script and (folder / "4242_submitted.pkl").exists()


def test_a_bad_recipe_is_refused_in_one_line_before_submitit_or_torch_is_imported(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_RECIPE)
    folder = tmp_path / "jobs"
    result = run_cli_without(("torch", "submitit"), "submit", str(bad), "--local", "--folder", str(folder))
    assert result.returncode == 2
    assert result.stderr == "error: recipe 'bad.yaml': devices=0 must be >= 1\n"
    assert not folder.exists()


def test_without_submitit_submit_says_how_to_install_it(tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    result = run_cli_without(("submitit",), "submit", "cpu-debug", "--local", "--folder", str(folder))
    assert result.returncode == 2
    assert result.stderr == 'error: submit needs submitit, which is not installed: pip install ".[submitit]"\n'
    assert not folder.exists()


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--time", "banana", "--local"], "--time='banana' is not a SLURM time limit"),
        (["--time", "2", "--local"], "--time=2 leaves no time to train: the job is signalled 120 s before"),
        (["--cpus_per_task", "0"], "--cpus_per_task=0 must be >= 1"),
        (["--max_timeouts", "-1"], "--max_timeouts=-1 must be >= 0"),
        (["--local", "--num_nodes", "2"], "submit --local runs the job on this machine, one node, but the recipe"),
        ([], "no SLURM here (sbatch and srun not on PATH): submit from a SLURM login node, or add --local"),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else "",
)
def test_job_options_and_a_layout_that_cannot_run_are_refused_in_one_line(
    arguments: list[str],
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no SLURM here, whatever this machine has
    folder = tmp_path / "jobs"
    assert message in fail_with(["submit", "cpu-debug", "--folder", str(folder), *arguments], capsys)
    assert not folder.exists()


def test_training_catches_submitits_signal() -> None:
    import submitit

    from {{ cookiecutter.package_name }}.cluster.preemption import SIGNALS

    assert signal.Signals[f"SIG{submitit.JobEnvironment.USR_SIG}"] in SIGNALS
