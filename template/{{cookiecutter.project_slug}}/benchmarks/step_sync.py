"""Per-step agreement between ranks: one fused all_reduce (step_decision.decide) against one collective per decision.

    python benchmarks/step_sync.py                     # tiny GPT, FSDP2 on 2 CPU processes (gloo)
    python benchmarks/step_sync.py --n_layer 4 --n_embd 256 --steps 60

The loop agrees on three things every step (NaN/inf loss, stop signal, time-based save). Deciding
them one by one costs a collective and a host sync each: the loss check before the optimizer step,
the signal check after it (on a GPU this also holds the host until the optimizer step has run), and
with `checkpoint.save_every_minutes` a broadcast of rank 0's clock. The last variant is the fused
all_reduce behind a barrier, as Fabric's `all_reduce` issues it (the loop calls torch's directly). Every
variant trains the same model in this one run, alternating in rounds so that drift of the machine hits
each alike; the figures are medians of the rounds' mean step times.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.errors import exit_process
from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.training.run import setup
from {{ cookiecutter.package_name }}.training.step_decision import Update, decide

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "cpu-debug.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--n_layer", type=int, default=2)
    parser.add_argument("--n_embd", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="Steps per round and variant.")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", default=None, help="Also write every round's step times to this file (rank 0).")
    args = parser.parse_args()

    recipe = load_recipe(RECIPE)
    recipe.devices, recipe.logger.name = args.devices, "none"
    recipe.model.n_layer, recipe.model.n_embd, recipe.model.n_head = args.n_layer, args.n_embd, 2
    recipe.model.block_size, recipe.train.micro_batch_size = 64, 4
    recipe.train.seed, recipe.checkpoint.resume = 0, None
    run = setup(recipe)
    fabric, model, optimizer, batches = run.fabric, run.model, run.optimizer, run.batches

    def forward_backward() -> torch.Tensor:
        inputs, targets = fabric.to_device(batches.next_step()[0])
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        fabric.backward(loss)
        return loss.detach()

    def max_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)  # as decide: no barrier before it
        return tensor

    def per_decision(time_based_save: bool) -> None:
        loss = forward_backward()
        nonfinite = torch.tensor(float(not bool(torch.isfinite(loss).all())), device=fabric.device)
        if max_over_ranks(nonfinite).item() == 0:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        signal = max_over_ranks(torch.tensor(0.0, device=fabric.device)).item()
        save_due = fabric.broadcast(False) if time_based_save else False  # rank 0's clock decides
        assert signal == 0 and not save_due

    def fused() -> None:
        decision = decide(fabric, forward_backward(), "skip", 0, False)
        if decision.update is Update.APPLY:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert not decision.preempted and not decision.save_due

    def fused_behind_a_barrier() -> None:
        fabric.barrier()  # what Fabric's all_reduce does before reducing
        fused()

    def mean_step_seconds(step: Callable[[], None]) -> float:
        fabric.barrier()
        if fabric.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        if fabric.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.steps

    variants = {
        "2 all_reduces (loss; signal)": lambda: per_decision(time_based_save=False),
        "2 all_reduces + broadcast(bool)": lambda: per_decision(time_based_save=True),
        "1 fused all_reduce (decide)": fused,
        "1 fused + barrier (Fabric's)": fused_behind_a_barrier,
    }
    for step in variants.values():  # warm up each
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, step in variants.items():
            times[name].append(mean_step_seconds(step))
    if fabric.global_rank == 0:
        median = {name: statistics.median(values) for name, values in times.items()}
        base = median["2 all_reduces (loss; signal)"]
        print(
            f"step time, {fabric.world_size} processes on {fabric.device.type},"
            f" {args.rounds} rounds x {args.steps} steps, model n_layer={args.n_layer} n_embd={args.n_embd}"
        )
        for name, seconds in median.items():
            print(f"  {name:<34} {seconds * 1e3:8.2f} ms/step  = {seconds / base:.3f}x the first")
        if args.json:
            rounds = [
                {"per_decision": per_decision, "fused": fused}
                for per_decision, fused in zip(
                    times["2 all_reduces (loss; signal)"], times["1 fused all_reduce (decide)"], strict=True
                )
            ]
            Path(args.json).write_text(json.dumps({"rounds": rounds}, indent=2))
    exit_process(0)  # leave the process group as the command line does


if __name__ == "__main__":
    main()
