"""What Fabric needs in a Ray Train worker of `<project> ray` (cluster/ray.py): the ranks as Ray gave them, and a
logger that reports each logging step to Ray. training/run.py adds both when cluster/launchers.py says it runs there.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.loggers import Logger
from lightning.fabric.plugins.environments import TorchElasticEnvironment


class RayTrainEnvironment(TorchElasticEnvironment):
    """The ranks Ray Train gave this worker: torchrun's variables, and the node's rank in NODE_RANK.

    Given explicitly: Fabric's detection would take a Ray worker on Kubernetes for a Kubeflow job (it
    sees KUBERNETES_PORT and RANK), and one inside a SLURM allocation for a SLURM task.
    """

    @staticmethod
    def detect() -> bool:
        """Never detected: chosen by cluster/launchers.py in a Ray Train worker."""
        return False

    def node_rank(self) -> int:
        """This worker's node, as Ray numbered them."""
        return int(os.environ.get("NODE_RANK", "0"))


class RayReport(Logger):
    """Report each logging step's metrics to Ray Train (`ray.train.report`); every rank calls it, as Ray requires.

    Only the training metrics of a logging step are reported, on every rank alike: each report is a barrier
    across the workers, so all must make the same calls. Ray keeps rank 0's.
    """

    @property
    def name(self) -> str:
        """The logger's name."""
        return "ray"

    @property
    def version(self) -> str:
        """Ray Train keeps its own run folder."""
        return ""

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        """Nothing: the recipe is logged by the run's own loggers."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Hand Ray the step, the loss and the rest of a training step's metrics."""
        if "train/loss" not in metrics:
            return
        import ray.train

        ray.train.report({"step": step, "loss": metrics["train/loss"], **metrics})
