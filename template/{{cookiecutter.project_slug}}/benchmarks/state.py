"""Training state per rank (parameters, gradients, AdamW moments) under a strategy, after one optimizer step.

    python benchmarks/state.py --json ddp.json --strategy ddp       # 2 CPU processes
    python benchmarks/state.py --json fsdp2.json --strategy fsdp2   # FSDP2 holds about 1/2 of ddp's

The bytes are counted, not timed: what each process holds as its local shards (observe.py).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.errors import exit_process
from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.training.memory import local_training_state_bytes
from {{ cookiecutter.package_name }}.training.run import setup

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-debug.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True, help="File to write the sizes to (rank 0).")
    parser.add_argument("--strategy", default="fsdp2")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="Tiny sizes.")
    args = parser.parse_args()

    n_layer, n_embd = (1, 64) if args.quick else (4, 256)
    overrides = {"devices": args.devices, "strategy.name": args.strategy, "model.n_layer": n_layer}
    overrides |= {"model.n_embd": n_embd, "model.n_head": 2, "model.block_size": 64, "train.micro_batch_size": 2}
    overrides |= {"logger.name": "none", "checkpoint.resume": "null", "out_dir": tempfile.gettempdir()}
    argv = ["--config", str(RECIPE)] + [item for key, value in overrides.items() for item in (f"--{key}", str(value))]
    run = setup(parse_recipe(argv))
    fabric, model, optimizer = run.fabric, run.model, run.optimizer
    inputs, targets = fabric.to_device(run.batches.next_step()[0])
    fabric.backward(F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()))
    optimizer.step()  # AdamW's moments exist from the first step on; gradients are kept for the count
    sizes = local_training_state_bytes(model, optimizer)
    largest = fabric.all_reduce(torch.tensor(float(sum(sizes.values()))), reduce_op="max")
    if fabric.global_rank == 0:
        result = {"strategy": args.strategy, "processes": fabric.world_size, "bytes_per_rank": float(largest), **sizes}
        Path(args.json).write_text(json.dumps(result, indent=2))
    exit_process(0)  # leave the process group as the command line does


if __name__ == "__main__":
    main()
