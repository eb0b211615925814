"""What the ranks decide together each step: apply, skip or stop the update (NaN/inf loss), preempted (a stop signal
on some rank: save, requeue on SLURM, exit 75), and whether a time-based save is due.

No SLURM here: `scontrol` is a stub on PATH that records its arguments.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import RECIPES, TOY_RECIPE, executable, fail_with

from {{ cookiecutter.package_name }}.cluster.preemption import SIGNALS, Preemption
from {{ cookiecutter.package_name }}.errors import ExitCode, RecipeError
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.training.step_decision import StepDecision, Update, decide, nonfinite_loss_stop


class OneProcess(SimpleNamespace):
    """The part of Fabric that the step decision uses, for a single process."""

    device = torch.device("cpu")
    global_rank = 0
    world_size = 1

    def all_reduce(self, tensor: torch.Tensor, reduce_op: str) -> torch.Tensor:
        return tensor


@pytest.fixture
def restore_signal_handlers() -> None:
    saved = {signum: signal.getsignal(signum) for signum in SIGNALS}
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)
    signal.set_wakeup_fd(-1)  # Preemption's: nothing reads it once the test is over


@pytest.fixture
def scontrol_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """SLURM job 99 with an `scontrol` stub on PATH; the file its calls are recorded in."""
    calls = tmp_path / "calls.txt"
    executable(tmp_path / "scontrol", f'#!/bin/sh\necho "$@" >> {calls}\n')
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "99")
    return calls


@pytest.mark.usefixtures("restore_signal_handlers")
def test_a_signal_only_sets_a_flag_and_rank_zero_requeues_the_slurm_job(scontrol_calls: Path) -> None:
    preemption = Preemption()
    assert not decide(OneProcess(), torch.tensor(1.0), "stop", preemption.received, False).preempted
    os.kill(os.getpid(), signal.SIGUSR1)  # the process survives: the handler only records it
    decision = decide(OneProcess(), torch.tensor(1.0), "stop", preemption.received, False)
    assert decision.stop_signal == signal.SIGUSR1 and decision.preempted
    stopped = preemption.requeue(step=12, agreed_signal=decision.stop_signal, rank=0)
    assert stopped.exit_code == ExitCode.REQUEUE
    assert (
        str(stopped)
        == "preempted by SIGUSR1 at step 12, checkpoint saved; requeued SLURM job 99, it resumes from this checkpoint"
    )
    assert scontrol_calls.read_text() == "requeue 99\n"
    preemption.reached_boundary()  # as the loop does: the stop deadline no longer applies


@pytest.mark.usefixtures("restore_signal_handlers")
def test_outside_slurm_a_signal_stops_without_requeueing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    preemption = Preemption()
    os.kill(os.getpid(), signal.SIGTERM)
    assert decide(OneProcess(), torch.tensor(1.0), "stop", preemption.received, False).preempted
    assert "not a SLURM job, so nothing is requeued" in str(preemption.requeue(3, signal.SIGTERM, rank=0))
    preemption.reached_boundary()


@pytest.mark.usefixtures("restore_signal_handlers")
def test_in_a_submitit_job_submitits_signal_stops_the_run_and_submitit_not_scontrol_requeues_it(
    scontrol_calls: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    preemption = Preemption()
    os.kill(os.getpid(), signal.SIGUSR2)  # submitit's signal: a flag too, not submitit's own checkpoint-and-exit
    decision = decide(OneProcess(), torch.tensor(1.0), "stop", preemption.received, False)
    assert decision.stop_signal == signal.SIGUSR2
    stopped = preemption.requeue(step=7, agreed_signal=decision.stop_signal, rank=0)
    assert (stopped.exit_code, stopped.signal) == (ExitCode.REQUEUE, signal.SIGUSR2)
    assert (
        str(stopped)
        == "preempted by SIGUSR2 at step 7, checkpoint saved; submitit requeues the job, it resumes from this checkpoint"
    )
    assert not scontrol_calls.exists()
    preemption.reached_boundary()


@pytest.mark.usefixtures("restore_signal_handlers", "toy_task_here")
def test_a_train_in_this_process_hands_the_stop_signals_back_when_it_ends(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Else a SIGTERM that later code catches for itself (a command's cleanup of a partial output) still reaches the
    run's thread, which may see the run's handler back by the time it reads it and end the process 60 s later."""
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    missing = ["--out_dir", str(tmp_path / "run"), "--checkpoint.resume", str(tmp_path / "none")]
    assert "none" in fail_with(["train", "--config", str(TOY_RECIPE), *missing], capsys)
    assert {signum: signal.getsignal(signum) for signum in SIGNALS} == before
    assert signal.set_wakeup_fd(-1) == -1
    listening = [thread for thread in threading.enumerate() if thread.name == "stop-signals"]
    for thread in listening:
        thread.join(timeout=10)
    assert not any(thread.is_alive() for thread in listening)


def test_the_step_decision_stops_or_skips_on_nan_and_inf_and_passes_finite_losses() -> None:
    def update(policy: str, loss: float) -> Update:
        return decide(OneProcess(), torch.tensor(loss), policy, 0, False).update

    assert update("stop", 2.5) is Update.APPLY
    assert update("stop", float("inf")) is Update.STOP
    stopped = nonfinite_loss_stop(5)
    assert stopped.exit_code == ExitCode.NONFINITE_LOSS and str(stopped).startswith(
        "loss is NaN or infinite at step 5 "
    )
    assert update("skip", float("nan")) is Update.SKIP
    assert update("skip", 2.5) is Update.APPLY


def test_one_step_decision_carries_each_flag_as_its_own_max() -> None:
    decision = decide(OneProcess(), torch.tensor([1.0, float("-inf")]), "skip", signal.SIGTERM, True)
    assert decision == StepDecision(update=Update.SKIP, stop_signal=signal.SIGTERM, save_due=True)
    assert decide(OneProcess(), torch.tensor(3.0), "skip", 0, False) == StepDecision(Update.APPLY, 0, False)


def test_on_nonfinite_loss_accepts_stop_or_skip_only() -> None:
    with pytest.raises(RecipeError, match=r"train.on_nonfinite_loss: 'ignore' is not allowed \(choose one of"):
        parse_recipe(["--config", str(RECIPES / "cpu-debug.yaml"), "--train.on_nonfinite_loss", "ignore"])
