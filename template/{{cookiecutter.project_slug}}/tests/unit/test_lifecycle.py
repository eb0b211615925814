"""A stop signal ends a run in bounded time, a process the run starts does not outlive its parent, and one out_dir
holds one run. Real processes and signals; no torch, so each test takes a second or two."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli_env, executable, process_alive

from {{ cookiecutter.package_name }}.checkpoint.lock import LOCK_FILE, lock_out_dir, out_dir_in_use

# A process whose "step" never reaches its boundary (as with a huge grad_accum_steps), with the run's stop handling.
NEVER_ENDING_STEP = """
import sys, time
from {{ cookiecutter.package_name }}.cluster.preemption import Preemption
preemption = Preemption(deadline_seconds=float(sys.argv[1]))
print("ready", flush=True)
while True:
    time.sleep(0.01)
"""

# The same, its main thread blocked in C for good, as in a collective waiting on a peer: CPython runs no Python
# signal handler there. Relocking a default pthread mutex deadlocks, and pthread_mutex_lock never returns EINTR.
BLOCKED_IN_C = """
import ctypes, sys
from {{ cookiecutter.package_name }}.cluster.preemption import Preemption
preemption = Preemption(deadline_seconds=float(sys.argv[1]))
libc = ctypes.CDLL(None)
mutex = ctypes.create_string_buffer(64)  # zeroed: PTHREAD_MUTEX_INITIALIZER
libc.pthread_mutex_lock(mutex)
print("ready", flush=True)
libc.pthread_mutex_lock(mutex)
"""

# A loop that feeds the hang watchdog, then stops feeding it in the middle of a step.
HANGS_IN_A_PHASE = """
import sys, time
from {{ cookiecutter.package_name }}.cluster.preemption import Preemption
preemption = Preemption()
watchdog = preemption.watch_for_hangs(float(sys.argv[1]), rank=1)
for step in range(1, 4):
    for phase in ("data", "forward-backward", "step-decision", "optimizer"):
        watchdog.beat(step, phase)
        time.sleep(0.01)
print("ready", flush=True)
watchdog.beat(4, "data")
time.sleep(600)
"""

# A process that forks a child (as a data loader forks its workers), which a stop signal then reaches alone.
SIGNALS_A_FORKED_CHILD = """
import os, signal, time
from {{ cookiecutter.package_name }}.cluster.preemption import Preemption
preemption = Preemption(deadline_seconds=600)
child = os.fork()
if child == 0:
    time.sleep(10)
    os._exit(0)
print("ready", flush=True)
os.kill(child, signal.SIGTERM)
time.sleep(0.5)
print(preemption.received, os.waitpid(child, os.WNOHANG) == (0, 0), flush=True)
os.kill(child, signal.SIGKILL)
"""

# After a run in the same process, a command puts its own SIGTERM handler in place (as export's cleanup does) and
# receives two: they are its own, not a stop of the run (a second signal would end the process at once).
ANOTHER_HANDLER_SINCE = """
import os, signal, time
from {{ cookiecutter.package_name }}.cluster.preemption import Preemption
preemption = Preemption(deadline_seconds=600)
caught = []
signal.signal(signal.SIGTERM, lambda signum, frame: caught.append(signum))
print("ready", flush=True)
for _ in range(2):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
print(preemption.received, len(caught), flush=True)
"""

# A run's catcher closed while its deadline runs (as `train` in a process that goes on), then SIGTERM.
HANDED_BACK = """
import os, signal, threading, time
from {{ cookiecutter.package_name }}.cluster.preemption import SIGNALS, Preemption
print("ready", flush=True)
before = {signum: signal.getsignal(signum) for signum in SIGNALS}
preemption = Preemption(deadline_seconds=0.5)
os.kill(os.getpid(), signal.SIGUSR1)
while preemption._deadline is None:  # the thread read the signal: the deadline runs
    time.sleep(0.01)
preemption.close()
handlers = all(signal.getsignal(signum) is before[signum] for signum in SIGNALS)
print(handlers, signal.set_wakeup_fd(-1), flush=True)
time.sleep(1.5)  # past the deadline
for thread in threading.enumerate():
    if thread.name == "stop-signals":
        thread.join(timeout=10)
print([thread.name for thread in threading.enumerate() if thread.name == "stop-signals"], flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(10)
"""


def start(code: str, *args: str, **env: str) -> subprocess.Popen:
    """Run `code` in a new Python process; return once it printed its first line."""
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env={**cli_env(), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "ready"
    return process


def test_after_a_stop_signal_a_step_that_never_ends_is_cut_at_the_deadline_and_the_run_exits_75() -> None:
    process = start(NEVER_ENDING_STEP, "1")
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 75
    assert 1 <= time.monotonic() - signalled < 15
    assert stderr.strip() == (
        "stopped: no step boundary within 1 s of SIGTERM: exiting without saving; not a SLURM job, so nothing is"
        " requeued: rerun with checkpoint.resume=auto to continue"
    )


def test_a_stop_signal_reaches_a_rank_whose_main_thread_is_blocked_in_c_and_ends_it_at_the_deadline() -> None:
    process = start(BLOCKED_IN_C, "1")
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()  # still blocked, were the stop to fail
    assert process.returncode == 75, stderr
    assert 1 <= time.monotonic() - signalled < 5
    assert stderr.startswith("stopped: no step boundary within 1 s of SIGTERM: exiting without saving;"), stderr


def test_a_rank_that_stops_making_progress_is_named_with_its_step_and_phase_and_exits_75() -> None:
    process = start(HANGS_IN_A_PHASE, "0.02")  # 1.2 s
    started = time.monotonic()
    try:
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()  # still blocked, were the stop to fail
    assert process.returncode == 75, stderr
    assert 1 <= time.monotonic() - started < 10
    first, *stacks = stderr.strip().splitlines()
    assert (
        first == "hang: rank 1 made no progress for 1 s in phase data of step 4 (checkpoint.hang_timeout_minutes=0.02)"
    )
    assert any(line.startswith("Thread 0x") for line in stacks)  # the Python stacks of every thread
    assert '  File "<string>", line 12 in <module>' in stacks  # the main thread, in its time.sleep(600)
    assert stacks[-1] == (
        "stopped: rank 1 hung in phase data of step 4: exiting without saving; not a SLURM job, so nothing is"
        " requeued: rerun with checkpoint.resume=auto to continue"
    )


def test_a_stop_signal_to_a_forked_child_is_not_counted_by_its_parent_and_the_child_lives_on() -> None:
    process = start(SIGNALS_A_FORKED_CHILD)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert stdout.strip() == "0 True"  # no signal recorded in the parent; the child still running


def test_a_second_stop_signal_ends_the_run_at_once() -> None:
    process = start(NEVER_ENDING_STEP, "600")
    process.send_signal(signal.SIGUSR1)
    time.sleep(0.3)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 75 and time.monotonic() - signalled < 5
    assert stderr.startswith("stopped: a second signal (SIGTERM): exiting without saving;"), stderr


def test_a_slurm_job_stopped_without_saving_is_still_requeued(tmp_path: Path) -> None:
    """Exit 143 (killed) would end the job for good; requeued, it resumes from its newest checkpoint."""
    calls = tmp_path / "calls.txt"
    executable(tmp_path / "scontrol", f'#!/bin/sh\necho "$@" >> {calls}\n')
    path = f"{tmp_path}{os.pathsep}{os.environ['PATH']}"
    process = start(NEVER_ENDING_STEP, "0.5", PATH=path, SLURM_JOB_ID="99", SLURM_PROCID="0")
    process.send_signal(signal.SIGUSR1)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 75
    assert calls.read_text() == "requeue 99\n"
    assert stderr.strip().endswith("requeued SLURM job 99, it resumes from the newest checkpoint"), stderr


# A parent that starts a child which ends with it, prints the child's pid, and waits.
PARENT_OF_A_CHILD = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import os, time\\n"
    "from {{ cookiecutter.package_name }}.cluster.lifecycle import end_with_parent\\n"
    f"end_with_parent({os.getpid()})\\nprint('up', flush=True)\\ntime.sleep(600)"], stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "up"
print("ready", flush=True)
print(child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_process_started_by_the_run_dies_with_its_parent_even_by_sigkill() -> None:
    parent = start(PARENT_OF_A_CHILD)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert process_alive(child)
    parent.kill()
    parent.wait(timeout=10)
    deadline = time.monotonic() + 10
    while process_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(child)


HOLDS_THE_LOCK = """
import sys, time
from pathlib import Path
from {{ cookiecutter.package_name }}.checkpoint.lock import lock_out_dir
assert lock_out_dir(Path(sys.argv[1])) is None
print("ready", flush=True)
time.sleep(600)
"""


def test_a_live_runs_lock_refuses_a_second_run_naming_it_and_a_dead_runs_lock_is_taken_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK"):
        monkeypatch.delenv(variable, raising=False)
    assert out_dir_in_use(tmp_path / "new") is None and not (tmp_path / "new").exists()  # a check writes nothing
    holder = start(HOLDS_THE_LOCK, str(tmp_path))
    assert out_dir_in_use(tmp_path) == lock_out_dir(tmp_path)
    refusal = lock_out_dir(tmp_path)
    assert refusal is not None and refusal.startswith(f"out_dir={str(tmp_path)!r} is in use by another run (pid")
    assert f"pid {holder.pid} on host " in refusal and "choose another out_dir" in refusal
    holder.kill()  # dead, as after SIGKILL or a crash: its record stays in the file, its lock does not
    holder.wait(timeout=10)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid
    assert lock_out_dir(tmp_path) is None
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()


def test_only_the_process_that_becomes_rank_zero_takes_the_lock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = start(HOLDS_THE_LOCK, str(tmp_path))
    for variables in ({"LOCAL_RANK": "1"}, {"NODE_RANK": "1"}, {"RANK": "3"}, {"SLURM_PROCID": "5"}):
        with monkeypatch.context() as patched:
            for variable in ("RANK", "SLURM_PROCID", "NODE_RANK", "LOCAL_RANK"):
                patched.delenv(variable, raising=False)
            for variable, value in variables.items():
                patched.setenv(variable, value)
            assert lock_out_dir(tmp_path) is None, variables  # not rank 0: it neither takes nor checks the lock
    holder.kill()
    holder.wait(timeout=10)


def test_a_closed_catcher_cancels_its_deadline_and_hands_the_signals_back_as_they_were() -> None:
    """What `train` does when it ends in a process that goes on: no stop 0.5 s after the signal, the handlers and
    wakeup fd from before, its thread ended; a SIGTERM then does what it did before the run (here: the default)."""
    process = start(HANDED_BACK)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == -signal.SIGTERM, stderr
    assert stdout.splitlines() == ["True -1", "[]"], stderr


def test_signals_to_a_handler_put_in_place_after_the_runs_are_left_to_it() -> None:
    process = start(ANOTHER_HANDLER_SINCE)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert stdout.strip() == "0 2"  # the run recorded no stop; the command's handler caught both
