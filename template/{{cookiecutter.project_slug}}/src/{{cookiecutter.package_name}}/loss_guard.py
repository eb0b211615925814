"""What a step whose loss is NaN or infinite on any rank does: stop the run, or skip its update (train.on_nonfinite_loss)."""

from __future__ import annotations

from lightning.fabric import Fabric

from {{ cookiecutter.package_name }}.errors import TrainingStopped

NONFINITE_EXIT_CODE = 3


class LossGuard:
    """Checks each step's loss on every rank; all ranks get the same answer, so they skip or stop together."""

    def __init__(self, fabric: Fabric, policy: str) -> None:
        self.fabric = fabric
        self.policy = policy

    def verdict(self, step: int, nonfinite_on_some_rank: bool, skipped_so_far: int) -> str:
        """update, skip (this step's optimizer update) or stop (the run).

        `nonfinite_on_some_rank` must be the same on every rank (step_sync.agree): a NaN on one rank must
        stop or skip every rank, or the replicas diverge.
        """
        if not nonfinite_on_some_rank:
            return "update"
        if self.policy == "stop":
            return "stop"
        self.fabric.print(
            f"Skipped the update of step {step}: loss is NaN or infinite on some rank"
            f" (train.on_nonfinite_loss=skip; {skipped_so_far + 1} skipped so far)"
        )
        self.fabric.log_dict({"train/skipped_steps": float(skipped_so_far + 1)}, step=step)
        return "skip"

    @staticmethod
    def stopped(step: int) -> TrainingStopped:
        """The exception a run stopped by a non-finite loss exits with (code 3)."""
        return TrainingStopped(
            f"loss is NaN or infinite at step {step} (train.on_nonfinite_loss=stop): lower train.learning_rate or"
            " raise train.warmup_steps, then resume from the last checkpoint; or set train.on_nonfinite_loss=skip",
            NONFINITE_EXIT_CODE,
        )
