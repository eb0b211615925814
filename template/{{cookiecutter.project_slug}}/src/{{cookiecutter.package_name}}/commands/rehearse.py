"""`<project> rehearse RECIPE [--ranks R,...] [--gpu NAME] [--json] [overrides]`: the recipe's run built on this
machine, rank by rank, as `train` would build it on `num_nodes x devices` ranks, each rank in a process of its own on
torch's fake process group with fake tensors (training/rehearsal.py), one whole optimizer step each; per rank what it
holds and sends, beside what `plan` says for the same recipe.

By default the ranks that differ are rehearsed: the first and the last, and the first of each pipeline stage.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jsonargparse import ArgumentParser

from ..checkpoint.layout import resolve_resume
from ..errors import RecipeError
from ..planner.device import plan_device
from ..recipe.checks import check_package
from ..recipe.library import find_recipe
from ..recipe.load import parse_recipe, split_command_line
from ..recipe.schema import Recipe
from ..strategies import strategy_for
from ..tasks import task_for
from . import first_line

if TYPE_CHECKING:
    from ..planner.plan import Device

HELP = "Build a recipe's run rank by rank on fake tensors, one step each: what each rank holds, beside plan."
FLAGS = ("--ranks", "--gpu", "--gpu_memory_gib")


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`rehearse`'s own options; every recipe field is an override too (`--num_nodes 64`)."""
    parser.description = (
        "Build the recipe's run as train would on num_nodes x devices ranks, each rehearsed rank in a process of"
        " its own on torch's fake process group with fake tensors, run one optimizer step, and print per rank its"
        " mesh coordinates, parameters, gradients, optimizer state, the step's peak and its collectives, beside"
        " plan's figures. Every recipe field is an override too."
    )
    parser.add_argument("recipe", help="Recipe name or path.")
    parser.add_argument("--ranks", default=None, help="Ranks to rehearse, e.g. 0,5,-1 (default: the ones that differ).")
    parser.add_argument("--gpu", default="H100", help="The GPU plan's figures assume (plan --gpu).")
    parser.add_argument("--gpu_memory_gib", type=float, default=None, help="Memory per device instead of the table's.")
    parser.add_argument("--json", action="store_true", help="Print the ranks' figures as JSON.")


def check_rehearsable(recipe: Recipe) -> None:
    """Refuse, in one line, a recipe whose run cannot be built on the CPU's fake tensors, or without a package it
    needs (float8's torchao)."""
    strategy = strategy_for(recipe)
    if problem := strategy.rehearsal_problem():
        raise RecipeError(problem)
    check_package(strategy.gpu_requirement())


def default_ranks(recipe: Recipe) -> list[int]:
    """The first and last rank and the first rank of each pipeline stage (the mesh is (pipeline, data, tensor))."""
    strategy = strategy_for(recipe)
    stages = getattr(strategy, "pipeline_parallel_size", 1)
    per_stage = recipe.world_size // stages
    return sorted({0, recipe.world_size - 1, *(stage * per_stage for stage in range(stages))})


def chosen_ranks(text: str | None, recipe: Recipe) -> list[int]:
    """`--ranks` read against the run's size (negative: from the end), or the default ranks."""
    if text is None:
        return default_ranks(recipe)
    world = recipe.world_size
    try:
        ranks = [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise RecipeError(f"--ranks={text}: expected integers separated by commas, e.g. 0,5,-1") from None
    if not ranks or any(not -world <= rank < world for rank in ranks):
        raise RecipeError(f"--ranks={text}: each rank must be in [{-world}, {world - 1}] (the run has {world} ranks)")
    return sorted({rank % world for rank in ranks})


def rehearse_ranks(recipe_argv: list[str], ranks: list[int]) -> list[dict[str, Any]]:
    """Each rank in a process of its own (as many at once as there are cores), forked from one that imported torch
    and the rehearsal once (seconds a rank need not spend again); their results in rank order. The processes are
    started from this thread alone: started from several, the fork server mixes up whose exit is whose."""
    from multiprocessing.connection import wait

    processes = multiprocessing.get_context("forkserver")
    processes.set_forkserver_preload([f"{__package__.rsplit('.', 1)[0]}.training.rehearsal"])
    results: dict[int, dict[str, Any]] = {}
    waiting = list(ranks)
    running: dict[Any, tuple[int, Any, Path, Path]] = {}  # by the process's sentinel: its rank, process and files
    with tempfile.TemporaryDirectory(prefix="rehearsal-") as folder:
        try:
            while waiting or running:
                while waiting and len(running) < (os.cpu_count() or 1):
                    rank = waiting.pop(0)
                    out, log = Path(folder) / f"rank-{rank}.json", Path(folder) / f"rank-{rank}.log"
                    process = processes.Process(target=rank_process, args=(rank, out, log, recipe_argv))
                    process.start()
                    running[process.sentinel] = rank, process, out, log
                for ended in wait(list(running)):
                    rank, process, out, log = running.pop(ended)
                    process.join()
                    if process.exitcode != 0 or not out.is_file():
                        why = last_error(log.read_text() if log.is_file() else "", process.exitcode)
                        raise RecipeError(f"rank {rank}: the rehearsal failed: {why}")
                    results[rank] = json.loads(out.read_text())
        finally:
            for _, process, _, _ in running.values():  # the others, when one failed
                process.terminate()
                process.join()
    return [results[rank] for rank in ranks]


def rank_process(rank: int, out: Path, log: Path, recipe_argv: list[str]) -> None:
    """One rank's process: what it prints goes to `log`, its figures to `out`."""
    with log.open("w") as sink:
        os.dup2(sink.fileno(), sys.stdout.fileno())
        os.dup2(sink.fileno(), sys.stderr.fileno())
    from ..training.rehearsal import rehearse_to_file

    rehearse_to_file(rank, out, recipe_argv)


def last_error(output: str, exitcode: int | None) -> str:
    """What says why a rank failed: its last exception (without torch's `[rankN]:` prefix), or how it ended."""
    lines = [re.sub(r"^\[rank\d+\]:", "", line).strip() for line in output.splitlines()]
    errors = [line for line in lines if re.match(r"^[\w.]+(Error|Exception): \S", line)]
    if errors:
        return errors[-1]
    return f"killed by signal {-exitcode}" if exitcode is not None and exitcode < 0 else f"exit code {exitcode}"


def planned(recipe: Recipe, device: Device, pipeline_rank: int | None = None) -> dict[str, Any] | None:
    """What plan says one rank of this recipe holds (torch's split of the model states) and the collectives of its
    step (where plan's communication model counts them, with the step decision's all_reduce), or None without
    size formulas or a plan option for the recipe's layout; under a pipeline, of its worst rank or of the ranks of
    pipeline rank `pipeline_rank`."""
    from ..planner.context import recipe_option
    from ..planner.hardware import INTERCONNECTS
    from ..planner.plan import Candidate, estimate, plan_inputs
    from ..precision import torch_model_states

    strategy, task = strategy_for(recipe), task_for(recipe)
    cost, option = task.model_cost(), strategy.recipe_plan_option()
    if cost is None or option is None:
        return None
    option = recipe_option(option, strategy)  # with the recipe's context-parallel degree
    link, trained = INTERCONNECTS["infiniband"], task.trained_parameters()  # adapters: beside the model's own
    inputs = plan_inputs(recipe, cost, cost.parameters() + (trained or 0), device, link, 0, trained_parameters=trained)
    result = estimate(Candidate(strategy, option), inputs, recipe.train.micro_batch_size, pipeline_rank)
    assert result.sizes is not None  # every estimate has them
    shares = result.sizes
    states = torch_model_states(shares.parameters, recipe.precision, option.stage, shares.data_parallel, shares.trained)
    checkpointed = recipe.strategy.activation_checkpointing
    activations = result.activations.checkpointed_peak if checkpointed else result.activations.peak
    collectives = step_collectives(
        recipe, strategy, cost, option, shares, result.pipeline.rank if result.pipeline else 0
    )
    # A count scaled by a float ratio (LoRA's adapters beside the model) carries float noise (4e-6 of a byte), which
    # rounding drops; an even share of the bytes may be a fraction of one (plan spreads them evenly).
    return {
        "parameters_bytes": round(states.parameters, 3),
        "gradients_bytes": round(states.gradients, 3),
        "optimizer_bytes": round(states.optimizer, 3),
        "peak_bytes": states.total + result.runtime_extra + activations,
        "collectives": collectives,
    }


def step_collectives(
    recipe: Recipe, strategy: Any, cost: Any, option: Any, sizes: Any, pipeline_rank: int
) -> dict[str, int] | None:
    """The collectives plan's communication model counts for one step of a rank of pipeline rank `pipeline_rank`
    (planner/collectives.py): the strategy's, the task's layers' (tensor parallel, experts, context) and the step
    decision's all_reduce; None where the model gives no count (under a pipeline, for a mixture of experts whose
    every block does not hold experts: which stage holds them is not modelled)."""
    from ..planner.collectives import rank_step
    from ..planner.context import context_collectives
    from ..planner.experts import (
        expert_collectives,
        expert_layers,
        expert_units,
        replicated_expert_units,
        sharded_apart,
    )

    config, micro_batches = recipe.strategy, recipe.train.grad_accum_steps
    pipelined, experts = option.pipeline_parallel > 1, expert_layers(cost) > 0 and sharded_apart(option)
    if pipelined and experts and expert_layers(cost) != cost.n_layer:
        return None
    every = config.activation_checkpointing_every if config.activation_checkpointing else 0
    pieces = strategy.options.pipeline_microbatches if pipelined else 1
    step = rank_step(cost, option, micro_batches, pieces, pipeline_rank, recipe.train.grad_clip > 0, every)

    def share(layers: int) -> int:  # the model's, or under a pipeline the rank's (every block a mixture of experts)
        return layers * step.blocks // cost.n_layer if pipelined else layers

    apart = share(expert_units(cost, option, sizes.data_parallel))
    step = dataclasses.replace(step, expert_units=apart, expert_mesh=experts)
    collectives = strategy.plan_collectives(option, sizes, step)
    if collectives is None:
        return None
    collectives = {name: count for name, count in collectives.items() if count}
    layers = share(expert_layers(cost))  # all-to-alls: planner/experts.py
    collectives |= expert_collectives(cost, option, step.passes, step.checkpointed, layers)
    for name, count in context_collectives(cost, option, step.passes, step.blocks).items():  # keys, values
        collectives[name] = collectives.get(name, 0) + count
    plain = cost.tensor_parallel_all_reduces(False)
    per_block = cost.tensor_parallel_all_reduces(True) - plain
    tensor_parallel = (step.blocks * plain + step.checkpointed * per_block) * step.passes
    # the step decision's one fused all_reduce, tensor parallel's, and hsdp's of experts held whole in a node
    replicated = share(replicated_expert_units(cost, option, sizes.data_parallel))
    collectives["allreduce"] = (
        collectives.get("allreduce", 0) + 1 + (tensor_parallel if option.tensor_parallel > 1 else 0) + replicated
    )
    return collectives


def render(recipe: Recipe, ranks: list[dict[str, Any]], plan: dict[str, Any] | None) -> str:
    """One block per rank: its mesh, each figure beside plan's, its collectives."""
    from ..planner.units import size

    lines = [
        f"{recipe.num_nodes} node(s) x {recipe.devices} device(s) = {recipe.world_size} ranks, {recipe.precision},"
        f" {strategy_for(recipe).describe()}; one optimizer step of {recipe.train.grad_accum_steps} micro-batch(es)"
        f" of {recipe.train.micro_batch_size}, on fake tensors",
        f"{'bytes':<12}{'measured':>11}{'plan':>11}{'ratio':>8}",
    ]
    for rank in ranks:
        mesh = ", ".join(f"{name} {index}" for name, index in rank["mesh"].items())
        blocks = f": blocks {spans(rank['blocks'])}" if rank.get("blocks") else ""
        lines.append(f"rank {rank['rank']} ({mesh}){blocks}")
        for key, label in (("parameters", "params"), ("gradients", "grads"), ("optimizer", "optim"), ("peak", "peak")):
            measured, expected = rank[f"{key}_bytes"], (rank.get("plan") or plan or {}).get(f"{key}_bytes")
            ratio = f"{measured / expected:.3f}" if expected else "-"
            planned_text = size(expected) if expected is not None else "-"
            lines.append(f"  {label:<10}{size(measured):>11}{planned_text:>11}{ratio:>8}")  # "1011.1 MiB" and a space
        sent, counted = rank["collective_bytes"], (rank.get("plan") or plan or {}).get("collectives") or {}
        collectives = ", ".join(
            f"{count} {name} ({size(sent[name])}" + (f"; plan {counted[name]})" if name in counted else ")")
            for name, count in rank["collectives"].items()
        )
        lines.append(f"  collectives per step: {collectives or 'none'}")
    if plan is None:
        lines.append("plan: the task has no size formulas or plan no option for this layout: measured figures only")
    return "\n".join(lines)


def spans(indices: list[int]) -> str:
    """Block indices as runs: [0, 1, 2, 6, 7] -> 0-2, 6-7."""
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


def run(argv: list[str], prog: str) -> None:
    """`rehearse RECIPE [options] [overrides]`: rehearse the ranks, print them beside plan (or as JSON)."""
    name, own, overrides = split_command_line(argv, FLAGS, ("--json",))
    parser = ArgumentParser(prog=f"{prog} rehearse", exit_on_error=False)
    add_arguments(parser, prog)
    try:
        options = parser.parse_args([*own] + ([name] if name else []))
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(first_line(error)) from None
    recipe_argv = ["--config", str(find_recipe(options.recipe)), *overrides]
    recipe = parse_recipe(recipe_argv, f"{prog} rehearse")
    from ..planner.units import size

    check_rehearsable(recipe)
    resolve_resume(recipe)  # a checkpoint to resume that is missing, damaged, of another model or unreadable here
    ranks = chosen_ranks(options.ranks, recipe)
    device = plan_device(options, recipe)
    plan = planned(recipe, device)
    results = rehearse_ranks(recipe_argv, ranks)
    if (stages := getattr(strategy_for(recipe), "pipeline_parallel_size", 1)) > 1 and plan is not None:
        for result in results:  # plan sizes each pipeline rank: beside each, its own (the mesh's outer dimension)
            result["plan"] = planned(recipe, device, result["rank"] // (recipe.world_size // stages))
    if options.json:
        print(json.dumps({"world_size": recipe.world_size, "plan": plan, "ranks": results}, indent=2))
    else:
        print(render(recipe, results, plan))
    over = [rank for rank in results if rank["peak_bytes"] > device.memory_bytes]
    if over:
        worst = max(over, key=lambda rank: rank["peak_bytes"])
        raise RecipeError(
            f"rank {worst['rank']} peaks at {size(worst['peak_bytes'])}, above the {device.name}'s"
            f" {size(device.memory_bytes)} ({len(over)} of the rehearsed ranks are over): the run would run out of"
            " memory (see plan for a layout that fits; --gpu, --gpu_memory_gib for another device)"
        )
