"""Ranks started before the imports: `<project> train` on one node starts its other ranks first thing.

Fabric's own launcher (`fabric.launch()`) starts a node's other ranks only once the first has imported torch
and Lightning and built its Fabric, so every start pays the imports twice in a row: a relaunch's rendezvous
took 6.5-7.4 s on a 2-core machine, against 0.5 s under torchrun, whose ranks import side by side. Here the
first process starts the others as soon as the recipe is read and checked (no torch yet), with Fabric's
command line and LOCAL_RANK; they import beside it, then wait for its word before doing anything else:
- when it launches (`release`, just before `start_processes`), it sends them what Fabric's launcher would have put in
  their environment (MASTER_ADDR, MASTER_PORT, NODE_RANK, WORLD_SIZE), takes LOCAL_RANK=0 itself so that
  Fabric starts nobody, and watches them with Fabric's own observer (one failed rank ends them all);
- when it refuses the run instead (data missing, out_dir in use, a checkpoint that does not fit, ...), it
  exits, and the waiting ranks read the pipe's end and exit without a word: a refusal stays one line.
The waiting ranks die with the first whenever it ends (cluster/lifecycle.py).

Only where Fabric would start the ranks itself (not under `fabric run`, torchrun, srun or Ray), for the
command line that is running (`<project> train ...`, which the ranks rerun), and for a layout this machine
can hold by a count that needs no torch (its cores, or the GPUs the driver lists): a recipe that asks for
more is refused by rank 0 alone, with nothing started. `TRAIN_PRESTART=0` in the environment turns it off.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..recipe.schema import Recipe
from .launchers import launched_by_fabric_run, launched_by_ray
from .lifecycle import mark_launcher

if TYPE_CHECKING:
    from lightning.fabric import Fabric

RELEASE_FD = "TRAIN_PRESTART_FD"  # in a waiting rank: the pipe its first rank's word comes through
SWITCH = "TRAIN_PRESTART"  # "0": Fabric's launcher starts the ranks, after the imports
RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE")
# CPU training processes one node may start per core it can use: beyond that the processes only wait on each
# other (the tests run 4 on 2 cores), and a typo like devices=64 would exhaust the machine.
CPU_PROCESSES_PER_CORE = 4

_waiting: list[tuple[subprocess.Popen[bytes], int]] = []  # the ranks started here, with their pipe's write end


def cpu_process_limit() -> int:
    """The most CPU training processes this machine starts per node."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return CPU_PROCESSES_PER_CORE * cores


def listed_gpus() -> int:
    """The NVIDIA GPUs this process may use, counted without torch: CUDA_VISIBLE_DEVICES's entries, else the
    driver's list (0 without a driver)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([device for device in visible.split(",") if device.strip() and not device.strip().startswith("-")])
    gpus = Path("/proc/driver/nvidia/gpus")
    return len(list(gpus.iterdir())) if gpus.is_dir() else 0


def fits_this_machine(recipe: Recipe) -> bool:
    """Whether this node can hold the recipe's ranks, by the counts `check_machine` applies once torch is loaded."""
    gpus = listed_gpus()
    if recipe.accelerator == "cuda" or (recipe.accelerator == "auto" and gpus):
        return recipe.devices <= gpus
    return recipe.devices <= cpu_process_limit()


def should_start_early(recipe: Recipe, argv: list[str]) -> bool:
    """Whether this process is a node's first rank that Fabric would launch the others from, for this command line."""
    launched = "LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_NTASKS" in os.environ
    return (
        recipe.devices > 1
        and os.environ.get(SWITCH, "1") != "0"
        and not (launched or launched_by_fabric_run() or launched_by_ray())
        and sys.argv[1:] == ["train", *argv]  # the ranks rerun this process's command line
        and fits_this_machine(recipe)
    )


def start_other_ranks(recipe: Recipe, argv: list[str]) -> None:
    """On a node's first rank, where it applies (`should_start_early`): start ranks 1..devices-1 now, waiting."""
    if not should_start_early(recipe, argv):
        return
    mark_launcher()  # they die with this process
    for local_rank in range(1, recipe.devices):
        read_end, write_end = os.pipe()
        env = {**os.environ, "LOCAL_RANK": str(local_rank), RELEASE_FD: str(read_end)}
        rank = subprocess.Popen(_rank_command(), env=env, pass_fds=(read_end,))
        os.close(read_end)
        _waiting.append((rank, write_end))


def wait_for_release() -> None:
    """In a rank started early: wait for the first rank's word, then take its rendezvous settings; if it ended
    without one (it refused the run, or died), end quietly: it has said what there is to say."""
    descriptor = os.environ.pop(RELEASE_FD, None)
    if descriptor is None:
        return
    try:
        with os.fdopen(int(descriptor), "rb") as pipe:
            word = pipe.readline()
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the first one says so
        os._exit(128 + signal.SIGINT)
    if not word:
        os._exit(0)
    os.environ.update(json.loads(word))


def release(fabric: Fabric) -> None:
    """On the first rank, at launch: the waiting ranks get the rendezvous settings and go; this rank becomes local
    rank 0 of a group whose processes exist, so `fabric.launch()` starts none. Nothing waiting: nothing to do."""
    if not _waiting:
        return
    from lightning.fabric.strategies.launchers.subprocess_script import (
        _launch_process_observer,
        _SubprocessScriptLauncher,
    )

    ranks, launcher = [rank for rank, _ in _waiting], getattr(fabric.strategy, "launcher", None)
    if not isinstance(launcher, _SubprocessScriptLauncher):
        _dismiss()  # a strategy that starts its processes otherwise: Fabric does it, as without this module
        return
    environment = launcher.cluster_environment
    settings = {
        "MASTER_ADDR": environment.main_address,
        "MASTER_PORT": str(environment.main_port),
        "NODE_RANK": str(environment.node_rank()),
        "WORLD_SIZE": str(launcher.num_processes * launcher.num_nodes),
    }
    os.environ.update(settings, LOCAL_RANK="0")
    word = (json.dumps(settings) + "\n").encode()
    for _, write_end in _waiting:
        os.write(write_end, word)
        os.close(write_end)
    _waiting.clear()
    _launch_process_observer(ranks)  # Fabric's: a rank that fails ends the others and this one


def _dismiss() -> None:
    """Let the waiting ranks go without a word (they exit) and wait for them."""
    for rank, write_end in _waiting:
        os.close(write_end)
        rank.wait()
    _waiting.clear()


def _rank_command() -> list[str]:
    """This process's command line, as Fabric's launcher reruns it for the other ranks."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    return [sys.executable, "-m", spec.name, *sys.argv[1:]]
