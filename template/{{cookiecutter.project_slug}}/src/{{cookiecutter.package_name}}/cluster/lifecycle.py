"""No orphans: a process the run starts ends when the process that started it dies, by any signal.

A training rank that Fabric's launcher started, or a worker of `prepare`, would otherwise live on
after its parent is SIGKILLed (an OOM kill, `kill -9`, a lost SSH session), holding a GPU, a port
and a half-written file. Linux ends it with SIGKILL the moment its parent dies (prctl's
PR_SET_PDEATHSIG); torchrun's and SLURM's ranks are ended by their own agents. Not the first
process: a run started with nohup must outlive the shell that started it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

LAUNCHER_PID = "TRAIN_LAUNCHER_PID"  # set by the launching rank for the ranks it starts
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def end_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this process when `parent_pid`, its parent, dies; exit now if it already has."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a seccomp sandbox): nothing more can be done from inside
    if os.getppid() != parent_pid:  # it died before the line above: nothing would signal us any more
        os._exit(128 + signal.SIGKILL)


def mark_launcher() -> None:
    """Before launching the other ranks: they will end with this process (`end_with_launcher`)."""
    os.environ[LAUNCHER_PID] = str(os.getpid())


def end_with_launcher() -> None:
    """In a rank that this project's launcher started (its parent marked itself): end with that parent."""
    launcher = os.environ.get(LAUNCHER_PID, "")
    if launcher.isdigit() and os.getppid() == int(launcher):
        end_with_parent(int(launcher))
