"""Fault injection for tests of preemption and crash recovery; inert unless TRAIN_FAULT is set.

TRAIN_FAULT=<kind>:<step> where kind is
  kill-at-step   SIGKILL the whole job (every rank, as a lost node would) right after that optimizer step
  kill-in-save   SIGKILL the whole job while the checkpoint of that step is being written
The job is killed through its process group, so start it in a new session (setsid or
`subprocess.Popen(..., start_new_session=True)`).
"""

from __future__ import annotations

import os
import signal

from lightning.fabric.utilities.rank_zero import rank_zero_only

ENV = "TRAIN_FAULT"


def fault_point(kind: str, step: int) -> None:
    """Kill the job here if TRAIN_FAULT asks for this kind of fault at this step."""
    spec = os.environ.get(ENV, "")
    wanted, _, at = spec.partition(":")
    # Rank 0 pulls the trigger once it has logged the step; the others wait for it in the next collective.
    if wanted == kind and at.isdigit() and int(at) == step and rank_zero_only.rank == 0:
        os.killpg(os.getpgid(0), signal.SIGKILL)
