"""Real launchers on one machine (loopback): `fabric run` and torchrun as two nodes, elastic restarts, preemption.

Every run is the same tiny FSDP2 job on 2 processes; the one started by Fabric itself on one node is
the reference that the others must match exactly (losses compared as floats, weights bitwise).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import (
    PACKAGE,
    PROJECT,
    assert_same_weights,
    cli_env,
    executable,
    final_weights,
    free_port,
    losses_by_run,
    read_csv_metrics,
    recipe_args,
)

from {{ cookiecutter.package_name }}.checkpoint.layout import find_latest
from {{ cookiecutter.package_name }}.cluster.launchers import torchrun_command
from {{ cookiecutter.package_name }}.errors import ExitCode

pytestmark = pytest.mark.slow
MAX_STEPS = 8
SCRIPT = PROJECT / "src" / PACKAGE / "train.py"
FABRIC = Path(sys.executable).with_name("fabric")  # the `fabric` command of this environment
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")  # the `torchrun` command of this environment


# What every run here shares (resume auto: a rerun continues).
SHARED = [
    "--train.max_steps", str(MAX_STEPS), "--checkpoint.save_every_steps", "4", "--eval.every_steps", "0",
    "--checkpoint.resume", "auto",
]  # fmt: skip


def start(command: list[str], **env: str) -> subprocess.Popen:
    """Start a launcher in its own session, output captured."""
    # Launchers choose different thread counts (torchrun 1, `fabric run` cores / processes), and CPU
    # kernels sum in another order with another count: fix it, so that runs compare bitwise.
    return subprocess.Popen(
        command,
        cwd=PROJECT,
        env={**cli_env(), "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def finish(launch: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a launcher; a hung one is killed with all its processes and fails the test."""
    try:
        stdout, stderr = launch.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [*descendants(launch.pid), launch.pid]:  # torchrun puts its workers in sessions of their own
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        stdout, stderr = launch.communicate()
        pytest.fail(f"launcher still running after {timeout} s:\n{stderr[-3000:]}")
    return launch.returncode, stdout, stderr


def descendants(pid: int) -> list[int]:
    """Every process started, directly or not, by `pid` (Linux /proc)."""
    parents = {}
    for stat_file in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            fields = stat_file.read_text().rsplit(")", 1)[1].split()
            parents[int(stat_file.parent.name)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def two_nodes(launcher: str, out_dir: Path, *extra: str, **env: str) -> list[tuple[int, str, str]]:
    """The same launcher on node ranks 0 and 1 (one process each), meeting over loopback."""
    port = str(free_port())
    args = recipe_args(out_dir, *SHARED, "--devices", "1", "--num_nodes", "2", *extra)

    def command(rank: int) -> list[str]:
        if launcher == "torchrun":  # the command `k8s` writes into every pod, with this machine's torchrun
            return torchrun_command(2, 1, str(rank), "127.0.0.1", port, args, torchrun=TORCHRUN)
        # After `--` fabric run passes every argument to the script, including names it has too (--devices).
        fabric = [str(FABRIC), "run", "--accelerator", "cpu", "--devices", "1", "--num-nodes", "2"]
        address = ["--main-address", "127.0.0.1", "--main-port", port]
        return [*fabric, "--node-rank", str(rank), *address, str(SCRIPT), "--", *args]

    launches = [start(command(rank), **env) for rank in (0, 1)]
    return [finish(launch) for launch in launches]


def train(out_dir: Path, *extra: str, **env: str) -> tuple[int, str, str]:
    """`<project> train` (Fabric starts the processes) with the shared recipe."""
    return finish(start([sys.executable, "-m", PACKAGE, "train", *recipe_args(out_dir, *SHARED, *extra)], **env))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, float], dict[str, torch.Tensor]]:
    """One node, 2 processes started by Fabric itself: (losses by step, final weights)."""
    out_dir = tmp_path_factory.mktemp("reference")
    returncode, _, stderr = train(out_dir)
    assert returncode == 0, stderr[-3000:]
    (losses,) = losses_by_run(out_dir)
    assert sorted(losses) == list(range(1, MAX_STEPS + 1))
    return losses, final_weights(out_dir, MAX_STEPS)


@pytest.mark.parametrize("launcher", ["fabric", "torchrun"])
def test_two_nodes_train_exactly_like_one_node_with_two_processes(
    tmp_path: Path, reference: tuple, launcher: str
) -> None:
    expected_losses, expected_weights = reference
    for returncode, _, stderr in two_nodes(launcher, tmp_path):
        assert returncode == 0, stderr[-3000:]
    assert losses_by_run(tmp_path) == [expected_losses]
    assert_same_weights(final_weights(tmp_path, MAX_STEPS), expected_weights)


def test_fabric_run_flags_that_contradict_the_recipe_are_refused_with_one_line(tmp_path: Path) -> None:
    command = [str(FABRIC), "run", "--accelerator", "cpu", "--devices", "1", "--main-port", str(free_port())]
    returncode, _, stderr = finish(
        start([*command, str(SCRIPT), "--", *recipe_args(tmp_path, *SHARED)])
    )  # recipe: devices 2
    assert returncode != 0
    line = "error: fabric run --devices=1 conflicts with the recipe's devices=2"
    assert line in stderr, stderr[-3000:]
    assert "Traceback" not in stderr.split(line)[0].rsplit("\n", 2)[-1]  # the worker's own output is that one line
    assert not (tmp_path / "checkpoints").exists()


def test_torchrun_restarts_a_crashed_worker_which_resumes_and_ends_identical(tmp_path: Path, reference: tuple) -> None:
    """Two torchrun launchers ("nodes") with c10d rendezvous; rank 1's worker crashes once, both restart."""
    expected_losses, expected_weights = reference
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "restart-test",
        "--max-restarts", "1", "--monitor-interval", "0.5", str(SCRIPT),
        *recipe_args(tmp_path, *SHARED, "--devices", "1", "--num_nodes", "2"),
    ]  # fmt: skip
    # torch's switch that gives every rendezvous round its own store (the project refuses restarts without it).
    env = {"TRAIN_FAULT": "crash-once-at-step:6", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launches = [start(command, **env) for _ in range(2)]
    results = [finish(launch) for launch in launches]
    assert all(returncode == 0 for returncode, _, _ in results), [stderr[-3000:] for _, _, stderr in results]
    stdout, stderr = "".join(r[1] for r in results), "".join(r[2] for r in results)
    assert "rank 1 crashes after step 6" in stderr
    assert "at step 4" in stdout and "Resumed from" in stdout  # the restarted workers continued from step 4
    before_crash, after_restart = losses_by_run(tmp_path)
    assert before_crash == {step: expected_losses[step] for step in range(1, 7)}
    assert after_restart == {step: expected_losses[step] for step in range(5, MAX_STEPS + 1)}
    assert_same_weights(final_weights(tmp_path, MAX_STEPS), expected_weights)


def test_torchrun_restarts_through_a_shared_store_are_refused_in_one_line(tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--max-restarts", "1",
        str(SCRIPT), *recipe_args(tmp_path, *SHARED),
    ]  # fmt: skip
    returncode, _, stderr = finish(start(command))
    assert returncode != 0
    assert "error: torchrun --max-restarts 1 with a rendezvous store shared by the workers" in stderr, stderr[-3000:]
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in stderr
    assert not (tmp_path / "checkpoints").exists()


def scontrol_stub(folder: Path) -> Path:
    """An `scontrol` that records its arguments (there is no SLURM here)."""
    folder.mkdir()
    executable(folder / "scontrol", f'#!/bin/sh\necho "$@" >> {folder / "calls.txt"}\n')
    return folder / "calls.txt"


@pytest.mark.parametrize("signal_name", ["USR1", pytest.param("TERM", marks=pytest.mark.matrix)])
def test_a_signal_saves_the_current_step_requeues_and_the_rerun_resumes_exactly(
    tmp_path: Path, reference: tuple, signal_name: str
) -> None:
    expected_losses, expected_weights = reference
    calls = scontrol_stub(tmp_path / "bin")
    out_dir = tmp_path / "run"
    path = f"{calls.parent}{os.pathsep}{os.environ['PATH']}"
    # The last rank alone gets the signal after step 5 (SLURM may signal only some ranks).
    fault = f"signal-at-step:5:{signal_name}"
    returncode, _, stderr = train(out_dir, TRAIN_FAULT=fault, SLURM_JOB_ID="4242", PATH=path)
    assert returncode == ExitCode.REQUEUE, stderr[-3000:]
    assert f"preempted by SIG{signal_name} at step 6, checkpoint saved; requeued SLURM job 4242" in stderr
    assert "Traceback" not in stderr
    assert calls.read_text() == "requeue 4242\n"
    assert find_latest(out_dir / "checkpoints").name == "step-00000006"  # every rank saved the step it stopped at

    returncode, stdout, stderr = train(out_dir)
    assert returncode == 0, stderr[-3000:]
    assert "Resumed from" in stdout and "at step 6" in stdout
    before, after = losses_by_run(out_dir)
    assert before == {step: expected_losses[step] for step in range(1, 7)}
    assert after == {step: expected_losses[step] for step in range(7, MAX_STEPS + 1)}
    assert_same_weights(final_weights(out_dir, MAX_STEPS), expected_weights)


def test_a_dead_worker_makes_the_other_node_exit_within_bounded_time(tmp_path: Path) -> None:
    # Two nodes started by Fabric itself; the worker of node 1 dies after step 2, the other must not hang.
    port, started = str(free_port()), time.monotonic()
    args = recipe_args(tmp_path, *SHARED, "--devices", "1", "--num_nodes", "2", "--strategy.timeout_minutes", "1")
    launches = [
        start(
            [sys.executable, "-m", PACKAGE, "train", *args],
            NODE_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            TRAIN_FAULT="crash-once-at-step:2",
        )
        for rank in (0, 1)
    ]
    results = [finish(launch, timeout=120) for launch in launches]
    seconds = time.monotonic() - started
    assert results[1][0] == 1 and "rank 1 crashes after step 2" in results[1][2]
    assert results[0][0] != 0, results[0][2][-2000:]  # the survivor failed instead of waiting forever
    assert seconds < 90, f"took {seconds:.0f} s"


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.matrix), "fsdp2"])
def test_a_nan_loss_on_one_rank_stops_the_run_naming_the_step(tmp_path: Path, strategy: str) -> None:
    returncode, _, stderr = train(tmp_path, "--strategy.name", strategy, TRAIN_FAULT="nan-at-step:3")
    assert returncode == 3, stderr[-3000:]
    assert "stopped: loss is NaN or infinite at step 3 (train.on_nonfinite_loss=stop)" in stderr
    assert "Traceback" not in stderr
    assert find_latest(tmp_path / "checkpoints") is None  # nothing saved past the last good checkpoint
    assert [sorted(losses) for losses in losses_by_run(tmp_path)] == [[1, 2]]  # the logs up to the stop are kept


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.matrix), "fsdp2"])
def test_a_nan_loss_on_one_rank_skips_that_update_on_every_rank(
    tmp_path: Path, reference: tuple, strategy: str
) -> None:
    expected_losses, _ = reference
    skip = ("--strategy.name", strategy, "--train.on_nonfinite_loss", "skip")
    returncode, stdout, stderr = train(tmp_path, *skip, TRAIN_FAULT="nan-at-step:3")
    assert returncode == 0, stderr[-3000:]
    assert "Skipped the update of step 3" in stdout
    (losses,) = losses_by_run(tmp_path)
    assert [losses[1], losses[2]] == pytest.approx([expected_losses[1], expected_losses[2]], abs=1e-4)
    assert losses[3] != losses[3]  # NaN: logged as it was
    # Had any rank applied the NaN gradients, every later loss would be NaN.
    assert all(torch.isfinite(torch.tensor(losses[step])) for step in range(4, MAX_STEPS + 1))
    rows = read_csv_metrics(tmp_path)
    skipped = [float(row["train/skipped_updates"]) for row in rows if row.get("train/skipped_updates")]
    assert skipped == [1.0]
    weights = final_weights(tmp_path, MAX_STEPS)
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())
