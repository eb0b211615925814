"""Fault injection for tests of preemption and crash recovery; inert unless TRAIN_FAULT is set.

TRAIN_FAULT=<kind>:<step>[:<signal>] where kind is
  kill-at-step        SIGKILL the whole job (every rank, as a lost node would) right after that optimizer step
  kill-in-save        SIGKILL the whole job while the checkpoint of that step is being written
  crash-once-at-step  the last rank exits with code 1 after that step (one dead worker), the first time only:
                      a marker file in <out_dir>/faults/ survives the restart, so a restarted job runs through
  signal-at-step      the last rank sends itself a signal after that step (default USR1, e.g.
                      `signal-at-step:5:TERM`), as SLURM does before a time limit
  nan-at-step         the last rank's loss becomes NaN in that step (its gradients too), or that of the rank
                      given (`nan-at-step:3:0`: under a V pipeline schedule rank 0 holds the last stage)
  hang-at-step        the last rank never finishes that step (a hung data source, a stuck kernel): only the
                      stop deadline (checkpoint.stop_deadline_seconds) or a second signal ends the run
  hang-in-phase       the last rank blocks for good, silently, as it enters that phase of that step (a phase the
                      loop names in its heartbeat: `hang-in-phase:3:step-decision`, `hang-in-phase:4:checkpoint-save`):
                      only the hang watchdog (checkpoint.hang_timeout_minutes) or the stop deadline ends the run
  slow-rank           the last rank sleeps before the step's decision in that step and every later one (default
                      1 second, e.g. `slow-rank:3:0.5`): a straggler
kill-* kill through the process group, so start such a job in a new session (setsid or
`subprocess.Popen(..., start_new_session=True)`).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..checkpoint.io import WRITTEN_HOOKS
from ..cluster.watchdog import BEAT_HOOKS

ENV = "TRAIN_FAULT"
# The loop's points and the faults injected at each.
POINTS = {
    "step-end": ("kill-at-step", "crash-once-at-step", "signal-at-step", "hang-at-step"),
    "in-save": ("kill-in-save",),
    "before-sync": ("slow-rank",),
}


def _wanted() -> tuple[str, int | None, str]:
    """(kind, step, argument) that TRAIN_FAULT asks for; step None when it asks for nothing."""
    kind, _, rest = os.environ.get(ENV, "").partition(":")
    at, _, argument = rest.partition(":")
    return kind, int(at) if at.isdigit() else None, argument


def _rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fault_point(where: str, step: int, out_dir: str | Path = ".") -> None:
    """Inject the fault TRAIN_FAULT asks for if it belongs at this point of the loop and this step."""
    kind, at, argument = _wanted()
    if at is None or kind not in POINTS[where] or (step < at if kind == "slow-rank" else step != at):
        return
    rank, size = _rank_and_size()
    if kind in ("kill-at-step", "kill-in-save"):
        # Rank 0 pulls the trigger once it has logged the step; the others wait for it in the next collective.
        if rank == 0:
            os.killpg(os.getpgid(0), signal.SIGKILL)
    elif rank == size - 1 and kind == "slow-rank":
        time.sleep(float(argument or 1))
    elif rank == size - 1 and kind == "signal-at-step":
        os.kill(os.getpid(), signal.Signals[f"SIG{argument or 'USR1'}"])
    elif rank == size - 1 and kind == "hang-at-step":
        print(f"{ENV}: rank {rank} hangs after step {step}", file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    elif rank == size - 1 and kind == "crash-once-at-step":
        marker = Path(out_dir) / "faults" / f"crash-once-at-step-{step}"
        if not marker.exists():
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
            print(f"{ENV}: rank {rank} crashes after step {step}", file=sys.stderr, flush=True)
            os._exit(1)


def _in_save(step: int, out_dir: str) -> None:
    fault_point("in-save", step, out_dir)


WRITTEN_HOOKS.append(_in_save)  # the checkpoint layer calls it between writing a checkpoint and showing it


def _hang_in_phase(step: int, phase: str) -> None:
    """TRAIN_FAULT=hang-in-phase:<step>:<phase>: the last rank blocks for good as it enters that phase."""
    _, at, wanted = _wanted()
    rank, size = _rank_and_size()
    if step == at and phase == wanted and rank == size - 1:
        threading.Event().wait()  # no output, no end: what a stuck data source or a lost peer looks like


if _wanted()[0] == "hang-in-phase":  # consulted at every heartbeat, so registered only when asked for
    BEAT_HOOKS.append(_hang_in_phase)


def poison_loss(loss: torch.Tensor, step: int) -> torch.Tensor:
    """The loss, made NaN on the last rank (or the rank given) when TRAIN_FAULT=nan-at-step:<step>[:<rank>]."""
    kind, at, argument = _wanted()
    rank, size = _rank_and_size()
    if kind == "nan-at-step" and at == step and rank == (int(argument) if argument else size - 1):
        return loss * float("nan")
    return loss
