"""The training defaults against what they replace or sit beside: AdamW's kernel, and activation checkpointing.

    python benchmarks/training_defaults.py --json out.json            # what benchmarks/run.py runs (one process)
    python benchmarks/training_defaults.py --json out.json --quick    # tiny sizes (a run, not a measurement)

- AdamW: one optimizer step over the GPT's parameters, the project's optimizer (training/optim.py: the fused
  kernel on CPU and CUDA) against torch's default AdamW (the same groups, no kernel chosen: one tensor at a
  time on CPU, foreach on CUDA) and against foreach.
- Activation checkpointing of every block: none, full and selective (strategies/checkpointing.py), the time of a
  forward and backward pass, and the bytes the forward pass leaves held for backward: every storage an operation
  of the forward pass made that is still alive when it ends (counted exactly, not sampled).

Variants alternate within each repeat so that the machine's drift hits them alike.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from {{ cookiecutter.package_name }}.recipe.schema import StrategyConfig, TrainConfig
from {{ cookiecutter.package_name }}.strategies.base import prepare_blocks
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model
from {{ cookiecutter.package_name }}.training.optim import build_optimizer

CHECKPOINTING = ("none", "full", "selective")


class ForwardStorages(TorchDispatchMode):
    """Records a weak reference to the storage of every tensor an operation makes while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        output = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                storage = leaf.untyped_storage()
                self.made.setdefault(storage._cdata, (StorageWeakRef(storage), storage.nbytes()))
        return output

    def alive_bytes(self) -> int:
        """Bytes of the recorded storages that are still alive."""
        gc.collect()
        return sum(size for weak, size in self.made.values() if not weak.expired())


def adamw_seconds(model: torch.nn.Module, steps: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per optimizer step of each AdamW variant, per repeat."""
    for param in model.parameters():
        param.grad = torch.randn_like(param)
    groups = [
        {"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    config = TrainConfig()
    variants: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "project": lambda: build_optimizer(model, config),
        "torch_default": lambda: torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95)),
        "foreach": lambda: torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95), foreach=True),
    }
    optimizers = {name: make() for name, make in variants.items()}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(repeats):
        for name, optimizer in optimizers.items():
            for _ in range(2):
                optimizer.step()
            start = time.perf_counter()
            for _ in range(steps):
                optimizer.step()
            seconds[name].append((time.perf_counter() - start) / steps)
    return seconds


def checkpointing_figures(base: torch.nn.Module, tokens: torch.Tensor, steps: int, repeats: int) -> dict[str, Any]:
    """Seconds per forward and backward pass, and the bytes the forward pass keeps for backward, per policy."""
    models = {}
    for policy in CHECKPOINTING:
        model = copy.deepcopy(base)
        if policy != "none":
            prepare_blocks(model, StrategyConfig(activation_checkpointing=True, activation_checkpointing_policy=policy))
        models[policy] = model

    def forward(model: torch.nn.Module) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    held = {}
    for policy, model in models.items():
        with ForwardStorages() as storages:
            loss = forward(model)
        held[policy] = storages.alive_bytes()
        loss.backward()
        model.zero_grad(set_to_none=True)
    seconds: dict[str, list[float]] = {policy: [] for policy in CHECKPOINTING}
    for _ in range(repeats):
        for policy, model in models.items():
            start = time.perf_counter()
            for _ in range(steps):
                forward(model).backward()
                model.zero_grad(set_to_none=True)
            seconds[policy].append((time.perf_counter() - start) / steps)
    return {"seconds_per_step": seconds, "bytes_held_for_backward": held}


def gpt(layers: int, width: int, sequence: int) -> Any:
    """The project's GPT (with GPT-2's biases, as cpu-debug) of this size."""
    config = ModelConfig(n_layer=layers, n_embd=width, n_head=max(1, width // 64), block_size=sequence, bias=True)
    return build_model(config)


def parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="Write the measurements to this file.")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="Tiny sizes: a run, not a measurement.")
    args = parser.parse_args()
    torch.manual_seed(0)
    # AdamW over a 6 x 384 GPT (11 M parameters); checkpointing on a 4 x 256 GPT, 4 sequences of 256 tokens.
    adamw_size, checkpointing_size = ((2, 64, 32), (2, 64, 32)) if args.quick else ((6, 384, 256), (4, 256, 256))
    batch, steps = (2, 2) if args.quick else (4, 4)
    adamw_model = gpt(*adamw_size)
    adamw = adamw_seconds(adamw_model, steps=steps * 2, repeats=args.repeats)
    model = gpt(*checkpointing_size)
    tokens = torch.randint(0, model.config.vocab_size, (batch, checkpointing_size[2] + 1))
    checkpointing = checkpointing_figures(model, tokens, steps=max(1, steps // 2), repeats=args.repeats)
    sizes = {"adamw": adamw_size, "checkpointing": checkpointing_size}
    result = {
        "models": {
            name: {"n_layer": size[0], "n_embd": size[1], "block_size": size[2], "parameters": parameters(gpt(*size))}
            for name, size in sizes.items()
        },
        "micro_batch": batch,
        "adamw_seconds_per_step": adamw,
        **checkpointing,
    }
    for name, values in adamw.items():
        print(f"  AdamW {name:<14} {statistics.median(values) * 1e3:8.2f} ms/step", flush=True)
    for policy in CHECKPOINTING:
        step = statistics.median(checkpointing["seconds_per_step"][policy])
        held = checkpointing["bytes_held_for_backward"][policy] / 2**20
        print(f"  checkpointing {policy:<9} {step * 1e3:8.1f} ms/step, {held:8.1f} MiB held for backward", flush=True)
    Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
