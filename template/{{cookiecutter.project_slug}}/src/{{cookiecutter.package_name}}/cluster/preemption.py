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
A step may never reach its boundary (a huge grad_accum_steps, a hung data source, a collective waiting
on a peer), so the stop is bounded: a second signal, or `checkpoint.stop_deadline_seconds` after the first
with the step still running, ends the process at once without saving, whatever the loop is doing. It still
requeues a SLURM job and exits with ExitCode.REQUEUE: the job resumes from the newest complete checkpoint
(a save cut short is a `.partial` folder, never loaded; or it starts over when there is none) instead of
ending as killed (143), which SLURM would not requeue.

The deadline is kept by a thread of its own, not by the Python handler: CPython runs a handler only on
the main thread between two bytecodes, so a main thread blocked in C (a gloo or NCCL collective waiting on a
peer, for up to strategy.timeout_minutes) would run it, and start the deadline, only when the collective
ends. CPython's C-level handler writes each signal's number to the wakeup fd (signal.set_wakeup_fd), here
a socket that the thread reads: it sets the flag the step decision reads and starts the deadline at once.
The Python handler sets the flag too, at once when the main thread is running Python, so that a signal sent
during a step stops the run at that step's boundary, not a step later.
Blocking the signals in every thread and waiting for them with signal.sigwait would do it too, but the mask
must be set before torch starts its threads, and every process started afterwards (Fabric's other ranks,
data workers, scontrol) would inherit the signals blocked.
A run in a process that goes on (a test, a notebook, `train` called in-process) hands the signals back when it
ends (`close`, or `with Preemption() as preemption:`): the handlers and wakeup fd from before, the thread ended,
no deadline pending. Else a later SIGTERM that other code catches for itself would still reach the thread, which
could see this catcher's handler back in place by the time it reads the signal, and end the process 60 s later.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType

from ..checkpoint.lock import launched_rank
from ..errors import ExitCode, TrainingStopped
from .watchdog import HangWatchdog

SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)
SUBMITIT_JOB = "SUBMITIT_EXECUTOR"  # set by submitit in the environment of its jobs' tasks (slurm or local)
Handler = Callable[[int, FrameType | None], None]
_wakeup: socket.socket | None = None  # the write end of the socket CPython writes the signals to
_forks_held = False  # _hold_signals_across_forks registered (once per process)


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
        self.received = 0  # number of the first signal this rank caught: the flag the step decision reads
        self._caught = 0  # the same, as the listening thread saw it: a signal after it is a second signal
        self.deadline_seconds = deadline_seconds
        self.watchdog: HangWatchdog | None = None
        self._deadline: threading.Timer | None = None
        self._at_boundary = False
        self._lock = threading.Lock()
        self._hand_back: Callable[[], None] = lambda: None
        if threading.current_thread() is not threading.main_thread():
            return  # signals reach only the main thread: Ray Train trains in another one, and handles them itself
        self._hand_back = _listen_for(SIGNALS, self._catch, self._flag)

    def __enter__(self) -> Preemption:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        """The run is over: no deadline, no hang watchdog, and the signals handled as before this catcher (its
        thread ends). From the main thread; a signal after it is the process's business, not a run's."""
        with self._lock:
            self._at_boundary = True  # a signal the thread reads from here on starts no deadline
            if self._deadline is not None:
                self._deadline.cancel()
        self.stop_watching()
        self._hand_back()

    def _flag(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler, on the main thread when it is between two bytecodes: the flag at once, so
        that a signal sent within a step stops the run at that step's boundary. The thread does the rest."""
        self.received = self.received or signum

    def _catch(self, signum: int) -> None:
        """From the listening thread, each signal as it arrives: the flag, and the deadline (or, on a second
        signal, the stop). Only a flag and a timer: saving from here could interrupt a collective halfway."""
        with self._lock:  # against reached_boundary: a deadline started after it would cut the agreed save short
            if self._caught:
                self.stop_now(f"a second signal ({signal.Signals(signum).name})")
            self._caught = signum
            self.received = self.received or signum
            if not self._at_boundary:
                why = f"no step boundary within {self.deadline_seconds:g} s of {signal.Signals(signum).name}"
                self._deadline = threading.Timer(self.deadline_seconds, self.stop_now, args=(why,))
                self._deadline.daemon = True
                self._deadline.start()

    def reached_boundary(self) -> None:
        """The ranks agreed to stop at this step boundary: the save that follows is not cut short."""
        with self._lock:
            self._at_boundary = True
            if self._deadline is not None:
                self._deadline.cancel()

    def watch_for_hangs(self, timeout_minutes: float, rank: int) -> HangWatchdog:
        """The hang watchdog (watchdog.py) the loop feeds; a hang ends this rank as `stop_now` does."""
        self.stop_watching()  # an earlier run's, in this process
        # Any rank that finds itself hung requeues the job: rank 0 may be the one that hangs.
        self.watchdog = HangWatchdog(timeout_minutes, rank, lambda why: self.stop_now(why, requeue_from=0))
        return self.watchdog

    def stop_watching(self) -> None:
        """The hang watchdog, if any, times nothing more."""
        if self.watchdog is not None:
            self.watchdog.stop_watching()

    def explains_failure(self) -> str | None:
        """Why an error from a collective is a stop's doing rather than a crash, if it is: a stop signal reached
        this rank (a peer may have ended at the deadline), or this rank had been waiting for over half its phase's
        hang allowance (a hung peer's watchdog ended it first). None: a crash, reported as one."""
        if self.received:
            return signal.Signals(self.received).name
        if self.watchdog is not None and self.watchdog.half_hung():
            return f"no progress for {self.watchdog.silent_seconds():.0f} s (a peer rank hung)"
        return None

    def stop_now(self, why: str, requeue_from: int | None = None) -> None:
        """End this process at once, without saving: requeued like any preemption (rank 0 on SLURM, or the rank
        `requeue_from` names when it is this one), exit 75. Safe from any thread."""
        rank = launched_rank() if requeue_from is None else requeue_from
        requeued = _requeue(f"{why}: exiting without saving", rank, "the newest checkpoint")
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


def _listen_for(
    signals: tuple[signal.Signals, ...], catch: Callable[[int], None], handler: Handler
) -> Callable[[], None]:
    """Call `catch(signum)` from a daemon thread for each of `signals` this process receives, even while the main
    thread is blocked in C; `handler` is their Python-level handler. From the main thread, which alone may install
    handlers (CPython writes a signal's number to the wakeup fd only when it has one). Returns what hands the
    signals back: the handlers and wakeup fd from before, the thread ended."""
    global _wakeup, _forks_held
    reader, writer = socket.socketpair()
    writer.setblocking(False)  # CPython requires it: its C handler must never block
    earlier_fd = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    earlier = {signum: signal.signal(signum, handler) for signum in signals}
    if _wakeup is not None:
        if earlier_fd == _wakeup.fileno():
            earlier_fd = -1  # closed below: nothing to hand back to
        _wakeup.close()  # an earlier catcher's thread reads the end of its socket and returns
    if not _forks_held:
        _hold_signals_across_forks(signals)
        _forks_held = True
    _wakeup = writer

    def hand_back() -> None:
        global _wakeup
        if _wakeup is not writer:
            return  # a later catcher took the signals over (and closed this one's socket) or this ran already
        for signum, before in earlier.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, before)
        current = signal.set_wakeup_fd(earlier_fd)
        if current != writer.fileno():  # someone else's since: theirs stays
            signal.set_wakeup_fd(current)
        writer.close()  # the thread reads the end of the socket and returns
        _wakeup = None

    def listen() -> None:
        while received := reader.recv(64):
            for signum in received:
                # Only while `handler` is the signal's: code that put its own in place since (a command's cleanup
                # on SIGTERM, after a run in the same process) handles the signal itself.
                if signum in signals and signal.getsignal(signum) is handler:
                    catch(signum)
        reader.close()

    threading.Thread(target=listen, name="stop-signals", daemon=True).start()
    return hand_back


def _hold_signals_across_forks(signals: tuple[signal.Signals, ...]) -> None:
    """A forked child (a data loader's worker) inherits the wakeup fd: its signals would reach its parent's thread,
    which would count them as its own (two: a second signal, a stop without saving). So the child writes them
    nowhere, and ignores them: its parent stops at the step boundary, and the child ends with it. The signals are
    held across the fork, so that none reaches the child before it lets go of the wakeup fd."""
    held: list[set[int | signal.Signals]] = []

    def before() -> None:
        held.append(signal.pthread_sigmask(signal.SIG_BLOCK, signals))

    def after_in_parent() -> None:
        signal.pthread_sigmask(signal.SIG_SETMASK, held.pop())

    def after_in_child() -> None:
        signal.set_wakeup_fd(-1)
        signal.pthread_sigmask(signal.SIG_SETMASK, held.pop())

    os.register_at_fork(before=before, after_in_parent=after_in_parent, after_in_child=after_in_child)
