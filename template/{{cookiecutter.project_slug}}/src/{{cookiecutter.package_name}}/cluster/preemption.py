"""Preemption: on SIGUSR1, SIGUSR2 or SIGTERM every rank saves at the next step boundary, the job is requeued, and it exits.

SLURM sends SIGUSR1 before the time limit when a job asks for it (`--signal=USR1@120`), submitit's jobs get
SIGUSR2, and SLURM sends SIGTERM when it preempts or cancels; Kubernetes and
torchrun's agent send SIGTERM. Fabric has no handler for this (the Trainer's SLURM connector is not
part of Fabric), so it is written here:
- the signal handler only sets a flag;
- at each step the ranks agree (max of the flag over ranks, in step_decision.decide: a signal may
  reach only some ranks), so all of them save the same step and stop together;
- rank 0 then runs `scontrol requeue $SLURM_JOB_ID` (on SLURM) and every rank exits with
  ExitCode.REQUEUE, which a job script treats as "saved and requeued". The requeued
  job resumes from that checkpoint through `checkpoint.resume: auto`. In a job of submitit's, submitit
  requeues it instead, so nothing is requeued here.
A step may never reach its boundary (a huge grad_accum_steps, a hung data source), so the stop is
bounded: a second signal, or `checkpoint.stop_deadline_seconds` after the first with the step still
running, ends the process at once without saving, from a watchdog thread whatever the loop is doing.
It still requeues a SLURM job and exits with ExitCode.REQUEUE: the job resumes from the last checkpoint
(or starts over when there is none) instead of ending as killed (143), which SLURM would not requeue.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType

from ..checkpoint.lock import launched_rank
from ..errors import ExitCode, TrainingStopped

SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
SUBMITIT_JOB = "SUBMITIT_EXECUTOR"  # set by submitit in the environment of its jobs' tasks (slurm or local)


class Preempted(TrainingStopped):
    """Every rank saved the step it stopped at after `signal` (ExitCode.REQUEUE)."""

    def __init__(self, message: str, agreed_signal: int, report: bool) -> None:
        super().__init__(message, ExitCode.REQUEUE, report)
        self.signal = agreed_signal


class Preemption:
    """Catches SIGUSR1/SIGUSR2/SIGTERM on this rank; the ranks agree on it in the step decision.

    `deadline_seconds`: how long the step in progress may run on after the first signal (the recipe's
    checkpoint.stop_deadline_seconds once it is read); a second signal does not wait.
    """

    def __init__(self, deadline_seconds: float = 60.0) -> None:
        self.received = 0  # number of the first signal this rank caught
        self.deadline_seconds = deadline_seconds
        self._watchdog: threading.Timer | None = None
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread: Ray Train trains in another one, and handles them itself
        for signum in SIGNALS:
            signal.signal(signum, self._catch)

    def _catch(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving from inside a handler could interrupt a collective halfway through.
        if self.received:
            self.stop_now(f"a second signal ({signal.Signals(signum).name})")
        self.received = signum
        why = f"no step boundary within {self.deadline_seconds:g} s of {signal.Signals(signum).name}"
        self._watchdog = threading.Timer(self.deadline_seconds, self.stop_now, args=(why,))
        self._watchdog.daemon = True
        self._watchdog.start()

    def reached_boundary(self) -> None:
        """The ranks agreed to stop at this step boundary: the save that follows is not cut short."""
        if self._watchdog is not None:
            self._watchdog.cancel()

    def stop_now(self, why: str) -> None:
        """End this process at once, without saving: requeued like any preemption (rank 0 on SLURM), exit 75."""
        requeued = _requeue(f"{why}: exiting without saving", launched_rank(), "the newest checkpoint")
        print(f"stopped: {requeued}", file=sys.stderr, flush=True)
        os._exit(ExitCode.REQUEUE)  # from any thread; the interpreter's teardown could wait on a hung collective

    def requeue(self, step: int, agreed_signal: int, rank: int) -> Preempted:
        """Ask SLURM to requeue this job (rank 0 only); the exception the job exits with (ExitCode.REQUEUE)."""
        why = f"preempted by {signal.Signals(agreed_signal).name} at step {step}, checkpoint saved"
        return Preempted(_requeue(why, rank, "this checkpoint"), agreed_signal, report=rank == 0)


def _requeue(why: str, rank: int, resumes_from: str) -> str:
    """Requeue this SLURM job (rank 0); what happened, in words."""
    job = os.environ.get("SLURM_JOB_ID")
    if os.environ.get(SUBMITIT_JOB) and resumes_from == "this checkpoint":
        return f"{why}; submitit requeues the job, it resumes from {resumes_from}"
    if os.environ.get(SUBMITIT_JOB):  # submitit requeues from its own handler, which a stop without saving skips
        return f"{why}; submitit does not requeue it: submit it again to resume from {resumes_from}"
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
    return f"{why}; requeued SLURM job {job}, it resumes from {resumes_from}"
