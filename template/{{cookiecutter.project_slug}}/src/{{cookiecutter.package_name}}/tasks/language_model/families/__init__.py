"""The model families by name: `model.arch` in a recipe selects one.

A family is a folder: model.py (the torch module), hf.py (its Hugging Face layout) and sizing.py (its
shape for the size formulas `plan` uses); hf.py and sizing.py import no torch. Each model carries its
own parallel facts, so strategies never need to know it (tasks/base.py's model contract): `blocks`
(the repeated block that FSDP shards, activation checkpointing recomputes and torch.compile compiles),
`tensor_parallel_plan()` (how one block is split) and `init_parameter(name, param)` (its init, for
meta-device and ZeRO-3 builds). A new family is a folder here and a line in FAMILIES.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType
from typing import TYPE_CHECKING

from ..config import ModelConfig

if TYPE_CHECKING:
    from torch import nn

FAMILIES = {"gpt": "GPT", "llama": "Llama"}  # model.arch -> the class in families/<arch>/model.py


def family_part(arch: str, part: str) -> ModuleType:
    """families/<arch>/<part>.py: model (torch), hf (the Hugging Face layout) or sizing (the shape)."""
    return import_module(f"{__name__}.{arch}.{part}")


def build_model(config: ModelConfig) -> nn.Module:
    """The model a config describes, on the current default device."""
    model_class: type[nn.Module] = getattr(family_part(config.arch, "model"), FAMILIES[config.arch])
    return model_class(config)


def count_parameters(config: ModelConfig) -> int:
    """Number of parameters of the model a config describes, without building it."""
    import torch

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config).parameters())


def training_flops_per_token(config: ModelConfig) -> int:
    """Model FLOPs of one forward and backward pass per token, counted once on a meta-device copy.

    These are model FLOPs (what MFU is defined on): recomputation by activation checkpointing is not
    counted, and attention is counted over the full block as if it were not causal, which gives the
    usual 6 * (matmul parameters) + 12 * n_layer * n_embd * block_size for the GPT and the Llama (grouped-query
    attention shares keys and values, not the attention matmuls: every query head still attends).
    """
    import torch
    from lightning.fabric.utilities.throughput import measure_flops

    with torch.device("meta"):
        model = build_model(config)
        tokens = torch.zeros(1, config.block_size, dtype=torch.long)
    return measure_flops(model, lambda: model(tokens), lambda logits: logits.sum()) // config.block_size
