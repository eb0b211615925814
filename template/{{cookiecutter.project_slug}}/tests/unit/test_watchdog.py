"""The hang watchdog's rules: each phase is timed from its heartbeat, long phases and the first step get more time,
a hang ends the rank once with the rank, step and phase named; and when a broken collective counts as a stop."""

from __future__ import annotations

import threading
import time

from {{ cookiecutter.package_name }}.cluster.preemption import Preemption
from {{ cookiecutter.package_name }}.cluster.watchdog import (
    BEAT_HOOKS,
    LONG_PHASE_FACTOR,
    HangWatchdog,
    Heartbeat,
    allowance,
    hang_message,
    overdue,
)


def test_a_step_phase_gets_the_timeout_and_long_phases_and_the_first_step_get_more() -> None:
    assert allowance(Heartbeat(7, "forward-backward", 0.0), first_step=1, timeout_seconds=60) == 60
    assert allowance(Heartbeat(7, "data", 0.0), first_step=1, timeout_seconds=60) == 60
    for phase in ("checkpoint-save", "validation", "eval-benchmarks"):
        assert allowance(Heartbeat(7, phase, 0.0), first_step=1, timeout_seconds=60) == 60 * LONG_PHASE_FACTOR
    assert allowance(Heartbeat(1, "data", 0.0), first_step=1, timeout_seconds=60) == 60 * LONG_PHASE_FACTOR


def test_a_phase_is_overdue_only_once_its_allowance_since_its_heartbeat_has_passed() -> None:
    beat = Heartbeat(7, "optimizer", at=100.0)
    assert overdue(beat, 1, 60, now=159.0) < 0
    assert overdue(beat, 1, 60, now=161.0) > 0


def test_the_hang_line_names_the_rank_the_step_and_the_phase() -> None:
    line = hang_message(3, Heartbeat(12, "step-decision", at=0.0), now=90.4, timeout_minutes=1.5)
    assert (
        line
        == "hang: rank 3 made no progress for 90 s in phase step-decision of step 12 (checkpoint.hang_timeout_minutes=1.5)"
    )


def stops_of(watchdog_minutes: float, beats: list[tuple[int, str]], wait: float) -> list[str]:
    """Why a watchdog of `watchdog_minutes` stopped, after `beats` 0.05 s apart and `wait` seconds more."""
    stops: list[str] = []
    watchdog = HangWatchdog(watchdog_minutes, rank=1, stop=stops.append)
    for step, phase in beats:
        watchdog.beat(step, phase)
        time.sleep(0.05)
    time.sleep(wait)
    watchdog.stop_watching()
    return stops


def test_a_silent_phase_ends_the_rank_once_naming_where_it_hung(capfd) -> None:
    stops = stops_of(0.003, [(1, "data"), (2, "data"), (2, "forward-backward")], wait=0.4)  # 0.18 s per phase
    assert stops == ["rank 1 hung in phase forward-backward of step 2"]
    stderr = capfd.readouterr().err
    assert "hang: rank 1 made no progress for 0 s in phase forward-backward of step 2" in stderr
    assert "Thread 0x" in stderr and "in _watch" in stderr  # every thread's Python stack


def test_heartbeats_within_the_timeout_keep_the_rank_alive() -> None:
    beats = [(step, phase) for step in range(1, 6) for phase in ("data", "forward-backward", "optimizer")]
    assert stops_of(0.003, beats, wait=0.0) == []  # 0.75 s in all, 0.05 s per phase, 0.18 s allowed


def test_a_first_step_as_long_as_twice_the_timeout_is_not_a_hang() -> None:
    assert stops_of(0.003, [(1, "forward-backward")], wait=0.3) == []  # 0.35 s of 0.72 s allowed


def test_no_phase_is_timed_after_stop_watching_or_with_a_timeout_of_zero() -> None:
    assert stops_of(0.0, [(5, "data")], wait=0.2) == []
    stops: list[str] = []
    watchdog = HangWatchdog(0.001, rank=0, stop=stops.append)
    watchdog.beat(5, "data")
    watchdog.stop_watching()
    time.sleep(0.4)
    assert stops == []


def test_every_heartbeat_reaches_the_registered_hooks() -> None:
    seen: list[tuple[int, str]] = []
    BEAT_HOOKS.append(lambda step, phase: seen.append((step, phase)))
    try:
        HangWatchdog(0.0, rank=0, stop=print).beat(4, "validation")
    finally:
        BEAT_HOOKS.pop()
    assert seen == [(4, "validation")]


def preemption_off_the_main_thread() -> Preemption:
    """A Preemption that installs no signal handler in the test process (built where Ray Train builds it)."""
    built: list[Preemption] = []
    thread = threading.Thread(target=lambda: built.append(Preemption()))
    thread.start()
    thread.join()
    return built[0]


def test_a_broken_collective_is_a_stop_after_a_signal_or_a_long_wait_and_a_crash_otherwise() -> None:
    preemption = preemption_off_the_main_thread()
    assert preemption.explains_failure() is None  # no watchdog, no signal: a crash
    stops: list[str] = []
    preemption.watchdog = HangWatchdog(0.004, rank=0, stop=stops.append)  # 0.24 s: half of it is 0.12 s
    preemption.watchdog.beat(1, "data")
    preemption.watchdog.beat(3, "step-decision")
    assert preemption.explains_failure() is None  # a peer that crashed at once
    time.sleep(0.15)
    assert preemption.explains_failure() == "no progress for 0 s (a peer rank hung)"
    preemption.stop_watching()
    assert preemption.explains_failure() is None  # the loop is over: nothing is timed
    preemption.received = 15
    assert preemption.explains_failure() == "SIGTERM"
