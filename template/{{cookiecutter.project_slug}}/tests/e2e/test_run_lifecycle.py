"""Real 2-process runs: a second run in a busy out_dir is refused and the first goes on intact; a SIGKILLed launcher
leaves no rank behind and its lock to the next run; a rank started before the imports ends with a refusal, silent; a stop signal to a rank blocked in a collective, and a rank
that hangs without any signal, end the job in bounded time, requeued, keeping the newest complete checkpoint."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from helpers import PACKAGE, child_processes, cli_env, process_alive, run_cli, train_args

pytestmark = pytest.mark.slow


def start_run(out_dir: Path, *overrides: str, fault: str = "") -> tuple[subprocess.Popen, Path]:
    """Start a 2-process training run in its own session, with TRAIN_FAULT=`fault`; (the launcher, its log file)."""
    log = out_dir.with_name(out_dir.name + ".log")
    with log.open("w") as handle:
        process = subprocess.Popen(
            [sys.executable, "-m", PACKAGE, *train_args(out_dir, *overrides)],
            env={**cli_env(), "TRAIN_FAULT": fault},
            stdout=handle,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return process, log


def wait_for(condition, what: str, process: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before {what}: {log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s: {log.read_text()[-3000:]}"
        time.sleep(0.2)


def test_a_second_run_in_a_busy_out_dir_is_refused_and_a_killed_launcher_leaves_no_rank_and_no_lock(
    tmp_path: Path,
) -> None:
    out_dir = tmp_path / "run"
    first, log = start_run(
        out_dir, "--train.max_steps", "100000", "--checkpoint.save_every_steps", "4", "--eval.every_steps", "0"
    )
    try:
        wait_for(lambda: (out_dir / "checkpoints" / "step-00000004").is_dir(), "a checkpoint", first, log)
        second = run_cli(*train_args(out_dir, "--train.max_steps", "2"))
        assert second.returncode == 2, second.stderr[-3000:]
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith(
            f"error: out_dir={str(out_dir)!r} is in use by another run (pid {first.pid} on host "
        )
        assert first.poll() is None  # the first run goes on
        ranks = child_processes(first.pid)
        assert ranks, "the launcher started no other rank"
    finally:
        first.kill()  # the launcher only, not its session: the rank it started must end by itself
        first.wait(timeout=30)
    deadline = time.monotonic() + 15
    while any(process_alive(rank) for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(rank) for rank in ranks), "a rank outlived its launcher"

    newest = max(int(path.name.removeprefix("step-")) for path in (out_dir / "checkpoints").glob("step-????????"))
    third = run_cli(*train_args(out_dir, "--train.max_steps", str(newest + 2), "--eval.every_steps", "0"))
    assert third.returncode == 0, third.stderr[-3000:]  # the dead run's lock does not hold the out_dir
    assert f"at step {newest}" in third.stdout and (out_dir / "checkpoints" / f"step-{newest + 2:08d}").is_dir()


def ended_with_its_ranks(run: subprocess.Popen, log: Path, ranks: list[int], within: float) -> float:
    """Seconds the run took to end with every rank it started, failing after `within` seconds."""
    started = time.monotonic()
    try:
        run.wait(timeout=within)
    finally:
        if run.poll() is None:
            run.kill()
    while any(process_alive(rank) for rank in ranks) and time.monotonic() - started < within:
        time.sleep(0.1)
    assert ranks and not any(process_alive(rank) for rank in ranks), "a rank outlived the run"
    assert run.returncode == 75, log.read_text()[-3000:]
    return time.monotonic() - started


def test_a_stop_signal_to_a_rank_blocked_in_a_collective_ends_the_job_at_the_deadline_keeping_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    from {{ cookiecutter.package_name }}.checkpoint.layout import find_latest, problem_with

    out_dir = tmp_path / "run"
    run, log = start_run(
        out_dir, "--train.max_steps", "100", "--checkpoint.save_every_steps", "2", "--eval.every_steps", "0",
        "--checkpoint.stop_deadline_seconds", "3", "--checkpoint.hang_timeout_minutes", "0",
        fault="hang-in-phase:3:step-decision",
    )  # fmt: skip
    checkpoints = out_dir / "checkpoints"
    wait_for(lambda: (checkpoints / "step-00000002").is_dir(), "a checkpoint", run, log)
    ranks = child_processes(run.pid)
    time.sleep(2)  # rank 0 waits in the step decision's all_reduce (in C, in gloo) for rank 1, which hangs
    run.send_signal(signal.SIGTERM)  # to rank 0 only: a Python signal handler would run only once the collective ends
    assert ended_with_its_ranks(run, log, ranks, within=3 + 10) >= 3
    assert "stopped: no step boundary within 3 s of SIGTERM: exiting without saving" in log.read_text()
    assert find_latest(checkpoints) == checkpoints / "step-00000002" and problem_with(find_latest(checkpoints)) is None


@pytest.mark.matrix
def test_a_rank_hung_in_a_save_is_named_and_the_job_requeued_from_the_previous_checkpoint(tmp_path: Path) -> None:
    out_dir = tmp_path / "run"
    args = (
        "--checkpoint.save_every_steps",
        "2",
        "--eval.every_steps",
        "0",
        "--checkpoint.hang_timeout_minutes",
        "0.05",
    )
    run, log = start_run(out_dir, "--train.max_steps", "100", *args, fault="hang-in-phase:4:checkpoint-save")
    wait_for(lambda: "starting from step 0" in log.read_text(), "the first step", run, log)
    ranks = child_processes(run.pid)
    ended_with_its_ranks(run, log, ranks, within=300)  # 12 s in a save (4 times the 3 s of a step's phase)
    # Rank 0 waits for rank 1 in the save's barrier: both are stuck, whichever watchdog fires first names itself.
    said = r"hang: rank [01] made no progress for 1\d s in phase checkpoint-save of step 4 \(checkpoint.hang_timeout_minutes=0.05\)"
    assert re.search(said, log.read_text()), log.read_text()[-3000:]
    assert "Thread 0x" in log.read_text()  # the ranks' Python stacks
    checkpoints = out_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-00000002", "step-00000004.partial"]
    resumed = run_cli(*train_args(out_dir, "--train.max_steps", "6", *args))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "at step 2" in resumed.stdout and (checkpoints / "step-00000006").is_dir()


@contextmanager
def small_disk(folder: Path, size: str) -> Iterator[Path]:
    """A filesystem of `size` (a tmpfs) mounted at `folder`, unmounted afterwards."""
    folder.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def test_a_save_that_runs_out_of_disk_stops_in_one_line_and_keeps_the_last_checkpoint(tmp_path: Path) -> None:
    from {{ cookiecutter.package_name }}.checkpoint.layout import problem_with

    with small_disk(tmp_path / "disk", "3m") as disk:  # a tiny model's checkpoint takes ~2 MiB: one fits, not two
        out_dir = disk / "run"
        result = run_cli(*train_args(out_dir, "--train.max_steps", "6", "--checkpoint.save_every_steps", "2", "--eval.every_steps", "0"))  # fmt: skip
        assert result.returncode == 74, result.stderr[-3000:]
        assert "stopped: checkpoint not saved: no space left: " in result.stderr
        said = rf"[\d.]+ MiB free on the disk of {re.escape(str(out_dir))}, a checkpoint of this run takes about [\d.]+ MiB;"
        assert re.search(said, result.stderr), result.stderr[-3000:]
        assert "the newest complete checkpoint is kept" in result.stderr and "Traceback" not in result.stderr
        assert sorted(path.name for path in (out_dir / "checkpoints").iterdir()) == ["step-00000002"]
        assert problem_with(out_dir / "checkpoints" / "step-00000002") is None


def test_a_run_whose_out_dir_cannot_hold_a_checkpoint_does_not_start(tmp_path: Path) -> None:
    with small_disk(tmp_path / "disk", "1m") as disk:
        result = run_cli(*train_args(disk / "run"))
        assert result.returncode == 2, result.stderr[-3000:]
        said = (
            rf"error: out_dir={re.escape(repr(str(disk / 'run')))}: 1\.0 MiB free on the disk of {re.escape(str(disk))}/run,"
            r" a checkpoint of this run takes about [\d.]+ MiB: free space there, or choose another out_dir"
        )
        assert re.fullmatch(said, result.stderr.strip()), result.stderr
        assert not (disk / "run").exists()


def test_train_starts_its_other_rank_before_its_checks_and_a_refusal_ends_it_in_one_line(tmp_path: Path) -> None:
    # Refused by rank 0 in setup, after its imports and before its launch: a rank started by Fabric's launcher
    # would never have existed; one started early must exist, then end without a word.
    missing = tmp_path / "no-such-checkpoint"
    first, log = start_run(tmp_path / "run", "--checkpoint.resume", str(missing))
    try:
        wait_for(lambda: child_processes(first.pid), "a second rank", first, log, timeout=120)
        ranks = child_processes(first.pid)
        first.wait(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    said = log.read_text().strip()
    assert first.returncode == 2, said[-3000:]
    assert said == f"error: checkpoint.resume={str(missing)!r}: no such checkpoint folder"  # one line, one process
    deadline = time.monotonic() + 15
    while any(process_alive(rank) for rank in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(rank) for rank in ranks), "a rank started early outlived the refusal"
    assert not (tmp_path / "run").exists()
