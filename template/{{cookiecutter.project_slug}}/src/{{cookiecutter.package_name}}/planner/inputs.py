"""What `plan` is asked about (a model's sizes, a layout, a device and its links) and what it weighs (`Candidate`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..strategies import TrainingStrategy
from ..tasks.base import ModelCost
from .options import PlanOption


@dataclass(frozen=True)
class Candidate:
    """One strategy the plan weighs: an option a strategy family declared, and that family."""

    strategy: TrainingStrategy
    option: PlanOption

    @property
    def name(self) -> str:
        return self.option.name

    @property
    def tensor_parallel(self) -> int:
        return self.option.tensor_parallel


@dataclass(frozen=True)
class Device:
    """One device as the plan assumes it."""

    name: str
    memory_bytes: int
    peak_tflops: float | None  # dense, at the plan's precision; None: no step-time bound
    intra_node_gb_s: float


@dataclass(frozen=True)
class Inputs:
    """What the plan is asked about: a model, a layout, a device and its links."""

    cost: ModelCost  # the task's size formulas for its model
    task: str  # the recipe's task: plan names a library recipe of its layout only when it is of that task
    parameters: int
    precision: str
    devices: int
    num_nodes: int
    micro_batch: int
    grad_accum: int
    gpu: Device
    inter_node_gb_s: float
    margin: float = 0.1
    cpu: bool = False
    host_memory_bytes: float | None = None
    refused: dict[str, str] | None = None  # candidate name -> why the task's recipe cannot run it
    trained: float = 1.0  # the share of the parameters that train (adapters: a small one), the rest frozen

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def budget(self) -> float:
        return self.gpu.memory_bytes * (1 - self.margin)
