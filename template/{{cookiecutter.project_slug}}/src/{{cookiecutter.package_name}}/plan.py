"""`plan RECIPE`: how much GPU memory the training state needs per GPU under each strategy, and which to pick.

The training state is parameters, gradients and AdamW's two moments: 16 bytes per parameter in fp32
or with fp32 master weights (bf16-mixed, 16-mixed), 8 with bf16-true, and DeepSpeed's bf16 keeps bf16
weights and gradients beside fp32 master weights and moments (16 + 2 + 2). Each strategy holds a
different part of it on a GPU:

    ddp                   everything, on every GPU
    zero1                 optimizer state / data-parallel ranks
    zero2, SHARD_GRAD_OP  gradients and optimizer state / ranks
    fsdp2, zero3          everything / ranks (hsdp: / GPUs of a node)
    + offload to cpu      optimizer state (zero1-3) and parameters (zero3) in host RAM instead

Activations are not included: they depend on batch, sequence length and activation checkpointing,
so the plan leaves `headroom` of the GPU for them and for the framework's buffers. The choice follows
the rules of thumb in the README: ddp when it fits, FSDP2 when it does not, DeepSpeed ZeRO-3 with CPU
offload when even that does not fit; tensor parallelism is for layers too large or FSDP that stops
scaling, which memory alone does not show.
"""

from __future__ import annotations

from dataclasses import dataclass

from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.strategies import REGISTRY, PlanOption, strategy_class

GIB = 2**30


@dataclass(frozen=True)
class StateBytes:
    """Bytes of training state one GPU holds (and what lives in host RAM instead)."""

    parameters: float
    gradients: float
    optimizer: float
    host: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer


# Every strategy family says how it holds the state (strategies/*.py `plan_options`).
OPTIONS: tuple[PlanOption, ...] = tuple(
    option for name in REGISTRY for option in strategy_class(name)(Recipe()).plan_options()
)


def state_bytes(parameters: int, precision: str, option: PlanOption, ranks: int) -> StateBytes:
    """Training state per GPU for `parameters` parameters trained with AdamW by `option` over `ranks` ranks."""
    if option.fp32_master_in_optimizer and precision.startswith(("bf16", "16")):
        weight, grad, optim = 2, 2, 16  # low-precision weights and gradients; fp32 master weights and moments
    elif precision == "bf16-true":
        weight, grad, optim = 2, 2, 4
    else:
        weight, grad, optim = 4, 4, 8
    sizes: list[float] = [parameters * weight, parameters * grad, parameters * optim]
    sizes = [size / ranks if sharded else size for size, sharded in zip(sizes, option.shards, strict=True)]
    offload_params, offload_optimizer = option.offload
    host = (sizes[0] if offload_params else 0) + (sizes[2] if offload_optimizer else 0)
    return StateBytes(
        parameters=0.0 if offload_params else sizes[0],
        gradients=sizes[1],
        optimizer=0.0 if offload_optimizer else sizes[2],
        host=host,
    )


def plan(recipe: Recipe, parameters: int, gpu_memory_gib: float, headroom: float) -> tuple[list[str], str]:
    """The table of every option for the recipe's model and layout, and the recommendation (lines of text)."""
    ranks = recipe.world_size
    budget = gpu_memory_gib * (1 - headroom) * GIB
    lines = [
        f"model: {parameters / 1e9:.2f} B parameters (n_layer={recipe.model.n_layer}, n_embd={recipe.model.n_embd},"
        f" vocab_size={recipe.model.vocab_size}), AdamW, precision {recipe.precision}",
        f"layout: {recipe.devices} GPU(s) x {recipe.num_nodes} node(s) = {ranks} data-parallel ranks;"
        f" {gpu_memory_gib:g} GiB per GPU, {budget / GIB:.1f} GiB for training state"
        f" ({headroom:.0%} left for activations and buffers)",
        "",
        f"{'strategy':<30} {'params':>8} {'grads':>8} {'optim':>8} {'GiB/GPU':>8} {'host/node':>10}  fits",
    ]
    fitting = []
    for option in OPTIONS:
        state = state_bytes(parameters, recipe.precision, option, ranks)
        fits = state.total <= budget
        if fits:
            fitting.append(option)
        host = state.host * recipe.devices / GIB
        lines.append(
            f"{option.label:<30} {state.parameters / GIB:8.2f} {state.gradients / GIB:8.2f}"
            f" {state.optimizer / GIB:8.2f} {state.total / GIB:8.2f} {host:10.1f}  {'yes' if fits else 'no'}"
        )
    return lines, recommendation(recipe, fitting)


def recommendation(recipe: Recipe, fitting: list[PlanOption]) -> str:
    """The preferred strategy that fits (ddp -> fsdp2 -> ZeRO-3 with CPU offload), and why."""
    candidates = sorted((option for option in fitting if option.why), key=lambda option: option.preference)
    if not candidates:
        return (
            "nothing fits: add GPUs or nodes (the sharded state shrinks with every rank), or offload to NVMe"
            " (recipe deepspeed-zero3-nvme-node)"
        )
    best = candidates[0]
    return f"recommended: {best.title or best.label} (recipe {best.recipes[recipe.num_nodes > 1]}): {best.why}"
