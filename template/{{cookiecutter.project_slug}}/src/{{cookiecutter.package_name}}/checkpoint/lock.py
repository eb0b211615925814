"""One run per out_dir: the process that becomes global rank 0 holds an exclusive lock on `<out_dir>/run.lock`.

Two runs writing one out_dir interleave their checkpoints: one's weights under the other's
config.yaml, a `.partial` deleted under a running save, a resume from the other run's step. So a
run takes the lock before it launches anything, holds it for its lifetime, and a second run is
refused in one line naming the holder (the file records its host, pid, SLURM job and start time).
The kernel releases the lock when the holder exits for any reason (SIGKILL and a node crash
included; on NFS when the client's lease expires), so a lock left by a dead job is simply taken
over: only a live holder refuses. A requeued SLURM job starts after the old one has ended.

No torch here: `train` takes the lock before torch loads in the launched processes.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import IO

LOCK_FILE = "run.lock"
_held: list[IO[str]] = []  # the open lock files of this process: the lock lasts while they stay open


def launched_rank() -> int:
    """This process's global rank as launchers set it, before any process group exists (0 for the first process).

    Fabric's own launcher gives its children LOCAL_RANK (and NODE_RANK on other nodes); torchrun sets RANK;
    srun sets SLURM_PROCID.
    """
    for variable in ("RANK", "SLURM_PROCID"):
        if variable in os.environ:
            return int(os.environ[variable])
    node, local = int(os.environ.get("NODE_RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    return 0 if (node, local) == (0, 0) else 1 + local  # only "is it 0" matters before launch


def out_dir_in_use(out_dir: Path) -> str | None:
    """Why a run must not start in out_dir (a live run holds its lock), or None; reads only, writes nothing."""
    if launched_rank() != 0:
        return None
    try:
        handle = (out_dir / LOCK_FILE).open()
    except OSError:  # no lock file, no out_dir yet: nobody holds it (lock_out_dir says what else is wrong)
        return None
    with handle:  # closing it releases the lock this check took
        return _refusal(out_dir, handle)


def lock_out_dir(out_dir: Path) -> str | None:
    """Take out_dir's lock for the rest of this process's life (launched rank 0; other ranks return None).

    Returns why the run must not start (another live run holds the lock), or None when this process holds it.
    A filesystem without locks gets a warning, and the run goes on unguarded.
    """
    if launched_rank() != 0:
        return None
    handle = (out_dir / LOCK_FILE).open("a+")  # "a+": never truncates what a live holder wrote
    if refusal := _refusal(out_dir, handle):
        handle.close()
        return refusal
    handle.seek(0)
    handle.truncate()
    holder = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }
    handle.write(json.dumps(holder) + "\n")
    handle.flush()
    _held.append(handle)
    return None


def _refusal(out_dir: Path, handle: IO[str]) -> str | None:
    """Take the lock on `handle`'s file; why not, naming the live holder, or None once taken."""
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        return (
            f"out_dir={str(out_dir)!r} is in use by another run ({_describe(handle.read(4096))}): two runs in one"
            " out_dir mix their checkpoints; wait for it to end, stop it, or choose another out_dir"
        )
    except OSError as error:  # ENOLCK/ENOTSUP: e.g. Lustre mounted without flock
        print(
            f"warning: cannot lock {handle.name} ({error.strerror}): a second run in this out_dir would not be refused",
            file=sys.stderr,
        )
    return None


def _describe(record: str) -> str:
    """The holder's record as words: `pid 123 on host node7, SLURM job 45, since 2026-01-01 12:00:00 UTC`."""
    try:
        holder = json.loads(record)
        said = f"pid {int(holder['pid'])} on host {str(holder['host'])[:100]}"
        if holder.get("slurm_job"):
            said += f", SLURM job {str(holder['slurm_job'])[:40]}"
        return f"{said}, since {str(holder['started'])[:40]}"
    except (ValueError, KeyError, TypeError):  # written by something else, or not yet written
        return f"see {LOCK_FILE}"
