"""What every rank must decide together about a step, agreed in one small all_reduce per step.

Three decisions must be the same on every rank or the ranks fall out of step (a rank that skips an
update or stops alone diverges or hangs the next collective):
- the loss is NaN/inf on some rank: skip the update or stop the run (loss_guard.py);
- a stop signal reached some rank: save this step and stop (preemption.py);
- the time-based checkpoint interval has passed on some rank: save this step (checkpoint.py).
Each is a max over ranks, so they travel in one tensor: one collective and one host sync per step
instead of one each (`benchmarks/step_sync.py` measures the difference).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from lightning.fabric import Fabric


@dataclass(frozen=True)
class StepAgreement:
    """The answers every rank shares for one step."""

    nonfinite_loss: bool  # the loss is NaN or infinite on some rank
    stop_signal: int  # the highest signal number caught on any rank; 0 when none
    save_due: bool  # the time-based checkpoint interval has passed on some rank


def agree(fabric: Fabric, loss: torch.Tensor, stop_signal: int, save_due: bool) -> StepAgreement:
    """Max over ranks of (loss not finite, signal caught, save due): one all_reduce, one host sync.

    The loss check runs on the device; nothing is copied to the host before the collective.
    """
    flags = torch.tensor([0.0, float(stop_signal), float(save_due)], device=fabric.device)
    flags[0] = (~torch.isfinite(loss)).any().float()
    nonfinite, signal, due = cast(torch.Tensor, fabric.all_reduce(flags, reduce_op="max")).tolist()
    return StepAgreement(nonfinite_loss=nonfinite > 0, stop_signal=int(signal), save_due=due > 0)
