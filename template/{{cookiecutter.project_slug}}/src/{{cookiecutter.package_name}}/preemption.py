"""Preemption: on SIGUSR1 or SIGTERM every rank saves at the next step boundary, the job is requeued, and it exits.

SLURM sends SIGUSR1 before the time limit (`#SBATCH --signal=USR1@120`) and SIGTERM when it preempts
or cancels; Kubernetes and torchrun's agent send SIGTERM. Fabric has no handler for this (the
Trainer's SLURM connector is not part of Fabric), so it is written here:
- the signal handler only sets a flag;
- at each step the ranks agree (max of the flag over ranks, in step_decision.decide: a signal may
  reach only some ranks), so all of them save the same step and stop together;
- rank 0 then runs `scontrol requeue $SLURM_JOB_ID` (on SLURM) and every rank exits with
  ExitCode.REQUEUE, which scripts/slurm/train.sbatch treats as "saved and requeued". The requeued
  job resumes from that checkpoint through `checkpoint.resume: auto`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType

from {{ cookiecutter.package_name }}.errors import ExitCode, TrainingStopped

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preemption:
    """Catches SIGUSR1/SIGTERM on this rank; the ranks agree on it in the step decision."""

    def __init__(self) -> None:
        self.received = 0  # number of the first signal this rank caught
        for signum in SIGNALS:
            signal.signal(signum, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving from inside a handler could interrupt a collective halfway through.
        self.received = self.received or signum

    def requeue(self, step: int, agreed_signal: int, rank: int) -> TrainingStopped:
        """Ask SLURM to requeue this job (rank 0 only); the exception the job exits with (ExitCode.REQUEUE)."""
        return TrainingStopped(self._requeue(step, agreed_signal, rank), ExitCode.REQUEUE, report=rank == 0)

    def _requeue(self, step: int, agreed_signal: int, rank: int) -> str:
        job = os.environ.get("SLURM_JOB_ID")
        why = f"preempted by {signal.Signals(agreed_signal).name} at step {step}, checkpoint saved"
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
