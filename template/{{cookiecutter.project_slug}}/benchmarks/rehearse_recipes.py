"""Every GPU recipe of the library rehearsed at its own size, beside `plan`: the README's measured-versus-planned table.

    python benchmarks/rehearse_recipes.py                          # rank 0 of each recipe, a markdown table
    python benchmarks/rehearse_recipes.py --ranks 0,-1 fsdp2-node  # chosen recipes and ranks

For each recipe it runs `rehearse RECIPE --ranks ... --json` (each rank a process on torch's fake process group
with fake tensors, one optimizer step) and prints, per rehearsed rank: whether its parameters, gradients and optimizer
state equal plan's to the byte, its measured peak beside plan's and their ratio, whether its collectives per step
equal the counts of plan's communication model, and the seconds the recipe took per rehearsed rank.
Recipes `rehearse` refuses (DeepSpeed, FSDP1: built for CUDA only) are listed with the reason.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from {{ cookiecutter.package_name }}.recipe.library import recipes_on

GIB = 2**30


def rehearse(recipe: str, ranks: str) -> tuple[dict | None, str, float]:
    """(the rehearsal's JSON or None, the refusal's line, seconds) of one recipe."""
    command = [sys.executable, "-m", "{{ cookiecutter.package_name }}", "rehearse", recipe, "--ranks", ranks, "--json"]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"exit {done.returncode}", seconds
    return json.loads(done.stdout), "", seconds


def row(recipe: str, rank: dict, plan: dict | None, seconds: float) -> str:
    """One table row: model states against plan's, the peak and its ratio, the collectives, seconds per rank."""
    states = ("parameters", "gradients", "optimizer")
    if plan is None:
        return f"| {recipe} | {rank['rank']} | no plan | {rank['peak_bytes'] / GIB:.1f} | - | - | - | {seconds:.0f} |"
    equal = all(rank[f"{key}_bytes"] == round(plan[f"{key}_bytes"]) for key in states)
    counted = plan.get("collectives")
    collectives = "-" if counted is None else "equal" if all(
        rank["collectives"].get(name) == count for name, count in counted.items()
    ) else "differ"  # fmt: skip
    peak, planned = rank["peak_bytes"], plan["peak_bytes"]
    return (
        f"| {recipe} | {rank['rank']} | {'to the byte' if equal else 'differ'} | {peak / GIB:.1f} | {planned / GIB:.1f}"
        f" | {peak / planned:.2f} | {collectives} | {seconds:.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recipes", nargs="*", default=recipes_on("cuda"), help="Default: the library's GPU recipes.")
    parser.add_argument("--ranks", default="0", help="Ranks of each recipe (rehearse --ranks).")
    options = parser.parse_args()
    print("| recipe | rank | params, grads, optim vs plan | peak GiB | plan GiB | ratio | collectives | s/rank |")
    print("|---|---|---|---|---|---|---|---|")
    for recipe in options.recipes:
        result, refusal, seconds = rehearse(recipe, options.ranks)
        if result is None:
            print(f"| {recipe} | - | {refusal.removeprefix('error: ')} | | | | | |")
            continue
        for rank in result["ranks"]:
            print(row(recipe, rank, result["plan"], seconds / len(result["ranks"])), flush=True)


if __name__ == "__main__":
    main()
