"""Preemption: on SIGUSR1, SIGUSR2 or SIGTERM every rank saves at the next step boundary, the job is requeued, and it exits.

SLURM sends SIGUSR1 before the time limit (`#SBATCH --signal=USR1@120`), submitit's jobs get SIGUSR2
(`<project> submit`: submit.py), and SLURM sends SIGTERM when it preempts or cancels; Kubernetes and
torchrun's agent send SIGTERM. Fabric has no handler for this (the Trainer's SLURM connector is not
part of Fabric), so it is written here:
- the signal handler only sets a flag;
- at each step the ranks agree (max of the flag over ranks, in step_decision.decide: a signal may
  reach only some ranks), so all of them save the same step and stop together;
- rank 0 then runs `scontrol requeue $SLURM_JOB_ID` (on SLURM) and every rank exits with
  ExitCode.REQUEUE, which scripts/slurm/train.sbatch treats as "saved and requeued". The requeued
  job resumes from that checkpoint through `checkpoint.resume: auto`. In a job of submitit's, submitit
  requeues it instead (submit.py), so nothing is requeued here.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType

from {{ cookiecutter.package_name }}.errors import ExitCode, TrainingStopped

SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
SUBMITIT_JOB = "SUBMITIT_EXECUTOR"  # set by submitit in the environment of its jobs' tasks (slurm or local)


class Preempted(TrainingStopped):
    """Every rank saved the step it stopped at after `signal` (ExitCode.REQUEUE)."""

    def __init__(self, message: str, agreed_signal: int, report: bool) -> None:
        super().__init__(message, ExitCode.REQUEUE, report)
        self.signal = agreed_signal


class Preemption:
    """Catches SIGUSR1/SIGUSR2/SIGTERM on this rank; the ranks agree on it in the step decision."""

    def __init__(self) -> None:
        self.received = 0  # number of the first signal this rank caught
        for signum in SIGNALS:
            signal.signal(signum, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving from inside a handler could interrupt a collective halfway through.
        self.received = self.received or signum

    def requeue(self, step: int, agreed_signal: int, rank: int) -> Preempted:
        """Ask SLURM to requeue this job (rank 0 only); the exception the job exits with (ExitCode.REQUEUE)."""
        return Preempted(self._requeue(step, agreed_signal, rank), agreed_signal, report=rank == 0)

    def _requeue(self, step: int, agreed_signal: int, rank: int) -> str:
        job = os.environ.get("SLURM_JOB_ID")
        why = f"preempted by {signal.Signals(agreed_signal).name} at step {step}, checkpoint saved"
        if os.environ.get(SUBMITIT_JOB):
            return f"{why}; submitit requeues the job, it resumes from this checkpoint"
        if job is None:
            return f"{why}; not a SLURM job, so nothing is requeued: rerun with checkpoint.resume=auto to continue"
        if rank != 0:
            return f"{why}; rank 0 requeues SLURM job {job}"
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        except OSError as error:  # no scontrol on this node
            return f"{why}; `scontrol requeue {job}` failed: {error}"
        if result.returncode != 0:
            return f"{why}; `scontrol requeue {job}` failed: {result.stderr.strip() or result.returncode}"
        return f"{why}; requeued SLURM job {job}, it resumes from this checkpoint"
