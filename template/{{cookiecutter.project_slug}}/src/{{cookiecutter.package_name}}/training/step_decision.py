"""What every rank decides together at the end of a step, from one small all_reduce.

Three things must be the same on every rank or the ranks fall out of step (a rank that skips an
update or stops alone diverges or hangs the next collective):
- the loss is NaN/inf on some rank: apply no update (skip) or stop the run (`train.on_nonfinite_loss`);
- a stop signal (SIGUSR1/SIGTERM) reached some rank: save this step and stop (preemption.py);
- the time-based checkpoint interval has passed on some rank: save this step (checkpoint.py).
Each is a max over ranks, so they travel in one tensor: one collective and one host sync per step
instead of one each (`benchmarks/step_sync.py` measures the difference).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from lightning.fabric import Fabric

from ..errors import ExitCode, TrainingStopped


class Update(Enum):
    """What happens to this step's optimizer update."""

    APPLY = "apply"
    SKIP = "skip"  # a non-finite loss under on_nonfinite_loss=skip: every rank drops this step's gradients
    STOP = "stop"  # a non-finite loss under on_nonfinite_loss=stop: the run ends with exit code 3


@dataclass(frozen=True)
class StepDecision:
    """The answers every rank shares for one step."""

    update: Update
    stop_signal: int  # the highest signal number caught on any rank; 0 when none
    save_due: bool  # the time-based checkpoint interval has passed on some rank

    @property
    def preempted(self) -> bool:
        """A stop signal reached some rank: save this step and stop."""
        return self.stop_signal > 0


def decide(
    fabric: Fabric, loss: torch.Tensor, on_nonfinite_loss: str, stop_signal: int, save_due: bool
) -> StepDecision:
    """Max over ranks of (loss not finite, signal caught, save due): one all_reduce, one host sync.

    The loss check runs on the device; nothing is copied to the host before the collective.
    """
    flags = torch.tensor([0.0, float(stop_signal), float(save_due)], device=fabric.device)
    flags[0] = (~torch.isfinite(loss)).any().float()
    if fabric.world_size > 1:  # torch's own: Fabric's all_reduce waits at a barrier first, a second collective
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
    nonfinite, signal, due = flags.tolist()
    update = Update.APPLY
    if nonfinite > 0:
        update = Update.STOP if on_nonfinite_loss == "stop" else Update.SKIP
    return StepDecision(update=update, stop_signal=int(signal), save_due=due > 0)


def nonfinite_loss_stop(step: int, report: bool = True) -> TrainingStopped:
    """The exception a run stopped by a non-finite loss exits with (code 3)."""
    return TrainingStopped(
        f"loss is NaN or infinite at step {step} (train.on_nonfinite_loss=stop): lower train.learning_rate or"
        " raise train.warmup_steps, then resume from the last checkpoint; or set train.on_nonfinite_loss=skip",
        ExitCode.NONFINITE_LOSS,
        report,
    )
