"""Hang detection: a rank that stops making progress ends, requeued, instead of holding the job until a timeout.

A hang sends no signal: a data source that never answers, a collective waiting on a peer that died
without closing its sockets, a filesystem that stopped answering a save. The collective's own
timeout (strategy.timeout_minutes) ends only the hangs inside a collective, and as a crash (exit 1),
which SLURM does not requeue. So the loop feeds a heartbeat (the step and the phase it enters) to a
daemon thread, which ends the process when no heartbeat came for `checkpoint.hang_timeout_minutes`:
it prints one line naming the rank, the step and the phase, the Python stacks of every thread, requeues
like a stop at the stop deadline and exits with ExitCode.REQUEUE. The job resumes from the newest
complete checkpoint: a save cut short leaves only a `.partial` folder, which is never loaded.

The timeout bounds each phase of a training step. The phases that are long by nature (the first step
of a run, which compiles and warms up; a checkpoint save; validation; the eval benchmarks) get
LONG_PHASE_FACTOR times as long, so a default that catches a stuck step cannot fire on a big save.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

LONG_PHASES = ("checkpoint-save", "validation", "eval-benchmarks")
LONG_PHASE_FACTOR = 4
# Called with (step, phase) on every heartbeat: training/faults.py registers one only under TRAIN_FAULT.
BEAT_HOOKS: list[Callable[[int, str], None]] = []


@dataclass(frozen=True)
class Heartbeat:
    """The phase of the loop a rank entered last, in which step, and when (time.monotonic)."""

    step: int
    phase: str
    at: float


def allowance(beat: Heartbeat, first_step: int, timeout_seconds: float) -> float:
    """Seconds the phase of `beat` may run before it counts as hung: the timeout, or LONG_PHASE_FACTOR times it
    for a long phase or the run's first step."""
    long = beat.phase in LONG_PHASES or beat.step == first_step
    return timeout_seconds * (LONG_PHASE_FACTOR if long else 1)


def overdue(beat: Heartbeat, first_step: int, timeout_seconds: float, now: float) -> float:
    """Seconds past its allowance the phase of `beat` is at `now`; 0 or less while it may still run."""
    return now - beat.at - allowance(beat, first_step, timeout_seconds)


def hang_message(rank: int, beat: Heartbeat, now: float, timeout_minutes: float) -> str:
    """The one line a rank prints when it ends as hung."""
    return (
        f"hang: rank {rank} made no progress for {now - beat.at:.0f} s in phase {beat.phase} of step {beat.step}"
        f" (checkpoint.hang_timeout_minutes={timeout_minutes:g})"
    )


class HangWatchdog:
    """Ends this process through `stop(why)` when the loop's heartbeat stops for longer than a phase's allowance.

    `timeout_minutes` 0 watches nothing (the heartbeat still calls BEAT_HOOKS). The thread starts with the
    first heartbeat and stops at `stop_watching` (the loop's end: what follows, an upload of the final
    weights, may take as long as it takes).
    """

    def __init__(self, timeout_minutes: float, rank: int, stop: Callable[[str], None]) -> None:
        self.timeout_minutes = timeout_minutes
        self.rank = rank
        self._stop = stop
        self._last: Heartbeat | None = None  # replaced whole, so the thread always reads one consistent beat
        self._first_step = -1
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self, step: int, phase: str) -> None:
        """The loop enters `phase` of `step`."""
        self._last = Heartbeat(step, phase, time.monotonic())
        for hook in BEAT_HOOKS:
            hook(step, phase)
        if self._thread is None and self.timeout_minutes > 0:
            self._first_step = step
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog", daemon=True)
            self._thread.start()

    def stop_watching(self) -> None:
        """No phase is timed from here on."""
        self._done.set()

    def silent_seconds(self) -> float:
        """Seconds since the last heartbeat; 0 before the first."""
        return 0.0 if self._last is None else time.monotonic() - self._last.at

    def half_hung(self) -> bool:
        """This rank has spent over half its allowance in the phase it is in (watched, not stopped)."""
        beat = self._last
        if beat is None or self.timeout_minutes <= 0 or self._done.is_set():
            return False
        return overdue(beat, self._first_step, self.timeout_minutes * 30, time.monotonic()) > 0

    def _watch(self) -> None:
        timeout_seconds = self.timeout_minutes * 60
        while not self._done.is_set():
            beat = self._last
            assert beat is not None  # the thread starts after the first beat
            late = overdue(beat, self._first_step, timeout_seconds, time.monotonic())
            if late > 0:
                self._fire(beat)
                return
            # Until this phase's allowance runs out, but no longer than the shortest one: a beat may have come since.
            self._done.wait(min(-late, timeout_seconds) + 0.05)

    def _fire(self, beat: Heartbeat) -> None:
        print(hang_message(self.rank, beat, time.monotonic(), self.timeout_minutes), file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)  # where each thread of this rank is stuck
        self._stop(f"rank {self.rank} hung in phase {beat.phase} of step {beat.step}")
