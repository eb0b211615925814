"""Preemption: on SIGUSR1 or SIGTERM every rank saves at the next step boundary, the job is requeued, and it exits.

SLURM sends SIGUSR1 before the time limit (`#SBATCH --signal=USR1@120`) and SIGTERM when it preempts
or cancels; Kubernetes and torchrun's agent send SIGTERM. Fabric has no handler for this (the
Trainer's SLURM connector is not part of Fabric), so it is written here:
- the signal handler only sets a flag;
- at each step the ranks agree (max of the flag over ranks, in step_sync.agree: a signal may reach
  only some ranks), so all of them save the same step and stop together;
- rank 0 then runs `scontrol requeue $SLURM_JOB_ID` (on SLURM) and every rank exits with
  REQUEUE_EXIT_CODE, which scripts/slurm/train.sbatch treats as "saved and requeued". The requeued
  job resumes from that checkpoint through `checkpoint.resume: auto`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from types import FrameType

from lightning.fabric import Fabric

from {{ cookiecutter.package_name }}.errors import TrainingStopped
from {{ cookiecutter.package_name }}.slurm import REQUEUE_EXIT_CODE

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preemption:
    """Catches SIGUSR1/SIGTERM and tells every rank, at the same step, that the job must stop."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.received = 0  # number of the first signal this rank caught
        self.agreed = 0  # the signal every rank stops for (the highest number caught on any rank)
        for signum in SIGNALS:
            signal.signal(signum, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving from inside a handler could interrupt a collective halfway through.
        self.received = self.received or signum

    def requested(self, signal_on_some_rank: int) -> bool:
        """Whether to stop: `signal_on_some_rank` is the max of `received` over ranks (step_sync.agree)."""
        self.agreed = signal_on_some_rank
        return self.agreed > 0

    def requeue(self, step: int) -> TrainingStopped:
        """Ask SLURM to requeue this job (rank 0 only); the exception the job exits with (code REQUEUE_EXIT_CODE)."""
        return TrainingStopped(self._requeue(step), REQUEUE_EXIT_CODE)

    def _requeue(self, step: int) -> str:
        job = os.environ.get("SLURM_JOB_ID")
        why = f"preempted by {signal.Signals(self.agreed).name} at step {step}, checkpoint saved"
        if job is None:
            return f"{why}; not a SLURM job, so nothing is requeued: rerun with checkpoint.resume=auto to continue"
        if self.fabric.global_rank != 0:
            return f"{why}; rank 0 requeues SLURM job {job}"
        try:
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        except OSError as error:  # no scontrol on this node
            return f"{why}; `scontrol requeue {job}` failed: {error}"
        if result.returncode != 0:
            return f"{why}; `scontrol requeue {job}` failed: {result.stderr.strip() or result.returncode}"
        return f"{why}; requeued SLURM job {job}, it resumes from this checkpoint"
