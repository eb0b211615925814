"""The model families by name: `model.arch` in a recipe selects one.

Each family's module carries its own parallel facts, so strategies never need to know it: the model
exposes `blocks` (the repeated block that FSDP shards, activation checkpointing recomputes and
torch.compile compiles), `tensor_parallel_plan()` (how one block is split), `reset_parameters()` and
`init_parameter(name, param)` (its init, for meta-device and ZeRO-3 builds).
"""

from __future__ import annotations

import torch
from lightning.fabric.utilities.throughput import measure_flops
from torch import nn

from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import gpt, llama

FAMILIES: dict[str, tuple[type[nn.Module], type[nn.Module]]] = {  # arch -> (model, block)
    "gpt": (gpt.GPT, gpt.Block),
    "llama": (llama.Llama, llama.Block),
}


def build_model(config: ModelConfig) -> nn.Module:
    """The model a config describes, on the current default device."""
    return FAMILIES[config.arch][0](config)


def count_parameters(config: ModelConfig) -> int:
    """Number of parameters of the model a config describes, without building it."""
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(config).parameters())


def training_flops_per_token(config: ModelConfig) -> int:
    """Model FLOPs of one forward and backward pass per token, counted once on a meta-device copy.

    These are model FLOPs (what MFU is defined on): recomputation by activation checkpointing is not
    counted, and attention is counted over the full block as if it were not causal, which gives the
    usual 6 * (matmul parameters) + 12 * n_layer * n_embd * block_size for the GPT and the Llama (grouped-query
    attention shares keys and values, not the attention matmuls: every query head still attends).
    """
    with torch.device("meta"):
        model = build_model(config)
        tokens = torch.zeros(1, config.block_size, dtype=torch.long)
    return measure_flops(model, lambda: model(tokens), lambda logits: logits.sum()) // config.block_size
