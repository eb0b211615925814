"""Context parallel against whole sequences: the activations a rank holds for backward, and the step time.

    python benchmarks/context_parallel.py --json cp2.json --context_parallel_size 2   # 2 CPU processes
    python benchmarks/context_parallel.py --json cp1.json --context_parallel_size 1   # 1 process, whole sequences

cpu-cp-debug's Llama on the same sequences (one data-parallel rank either way, so both read the same samples):
each rank holds 1 / cp of every sequence and attends over the keys and values gathered from its group, so what its
forward pass keeps for backward (every storage an operation made that is still alive when the forward ends,
counted exactly as training_defaults.py does, the attention's mask included) should be about 1 / cp of
the whole sequences'. The step (forward, backward, optimizer step) is timed after two warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from training_defaults import ForwardStorages

from {{ cookiecutter.package_name }}.errors import exit_process
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.strategies.context_parallel import split_sequences
from {{ cookiecutter.package_name }}.training.run import Run, setup

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-cp-debug.yaml"


def held_bytes(run: Run, batch: tuple[torch.Tensor, ...], size: int) -> int:
    """Bytes this rank's forward pass leaves held for backward on its part of `batch`; runs the backward after."""
    with split_sequences(run.fabric, batch, size) as part:
        inputs, targets = run.task.split_batch(part)
        with ForwardStorages() as storages:
            loss = run.task.loss(run.model(inputs), targets)
        held = storages.alive_bytes()
        run.fabric.backward(loss)
    run.optimizer.zero_grad(set_to_none=True)
    return held


def step_seconds(run: Run, batch: tuple[torch.Tensor, ...], steps: int) -> list[float]:
    """Seconds of each of `steps` whole optimizer steps on `batch` (the strategy splits it as training does)."""
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        run.strategy.forward_backward(run.fabric, run.model, batch, 1, lambda loss: loss)
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="File to write the figures to (rank 0).")
    parser.add_argument("--context_parallel_size", type=int, default=2, help="Processes splitting every sequence.")
    parser.add_argument("--steps", type=int, default=8, help="Timed steps (after 2 warm-up steps).")
    parser.add_argument("--quick", action="store_true", help="Tiny sizes.")
    args = parser.parse_args()

    size = args.context_parallel_size
    block_size, n_layer = (128, 1) if args.quick else (1024, 2)
    overrides = {"devices": size, "strategy.fsdp2.context_parallel_size": size, "model.block_size": block_size}
    overrides |= {"model.n_layer": n_layer, "train.micro_batch_size": 2, "logger.name": "none"}
    overrides |= {"checkpoint.resume": "null", "out_dir": tempfile.gettempdir()}
    argv = ["--config", str(RECIPE)] + [item for key, value in overrides.items() for item in (f"--{key}", str(value))]
    run = setup(parse_recipe(argv))
    batch = run.fabric.to_device(run.batches.next_step()[0])
    held = held_bytes(run, batch, size)
    seconds = step_seconds(run, batch, args.steps + 2)[2:]
    largest = run.fabric.all_reduce(torch.tensor(float(held)), reduce_op="max")
    if run.fabric.global_rank == 0:
        result = {
            "context_parallel_size": size,
            "processes": run.fabric.world_size,
            "sequence_length": block_size,
            "held_bytes_per_rank": float(largest),
            "seconds_per_step": statistics.median(seconds),
            "seconds": seconds,
        }
        Path(args.json).write_text(json.dumps(result, indent=2))
    exit_process(0)  # leave the process group as the command line does


if __name__ == "__main__":
    main()
