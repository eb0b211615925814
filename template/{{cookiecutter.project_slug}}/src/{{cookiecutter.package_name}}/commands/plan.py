"""`<project> plan [RECIPE] [options] [recipe overrides]`: memory, communication and a step-time bound of every
strategy for a model on a cluster, and the one to pick (planner/).

A task with size formulas (`Task.model_cost`) is planned without torch. A task without them is measured: its model
built on the meta device here, one step of the recipe on one rank without sharding rehearsed in a process of its own
(`rehearse`'s), and the plan weighs the data-parallel candidates from that (planner/measured.py). `--write` rehearses
the recipe it is about to write, rank by rank as `rehearse` does, and writes it only when every rank builds, steps and
peaks within the device's memory.

`--mtbf 8h` adds the checkpoint interval that maximises goodput for the recommended layout and the expected goodput
(planner/interval.py): from the save cost a previous run measured (`--from_run OUT_DIR`), else from the bytes a rank
writes at `--write_gb_s`; `--write` puts it in the recipe as checkpoint.save_every_minutes.

Its own options are split from the recipe overrides (recipe/load.py's `split_command_line`): every recipe
field is an override too (`--model.n_layer 48`, `--devices 8`).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from jsonargparse import ArgumentParser

from ..errors import RecipeError
from ..planner.device import plan_device
from ..recipe.library import find_recipe, recipe_for_layout
from ..recipe.load import parse_recipe, split_command_line
from ..recipe.schema import Recipe, TrainConfig, field_path
from ..tasks import task_for
from . import first_line

if TYPE_CHECKING:  # plan imports every strategy family: only when planning
    from ..planner.interval import IntervalPlan, SaveCost
    from ..planner.measured import MeasuredCost
    from ..planner.plan import Device, Plan
    from ..tasks import Task

__all__ = ["HELP", "add_arguments", "plan_device", "run"]

HELP = "Which strategy for a model on a cluster."
# With no recipe, `plan` starts from a node of 8 GPUs training in bf16-mixed, one sequence per micro-batch.
PLAN_DEFAULTS = [
    "--accelerator",
    "cuda",
    "--devices",
    "8",
    "--precision",
    "bf16-mixed",
    f"--{field_path(TrainConfig, 'micro_batch_size')}",
    "1",
]
PLAN_FLAGS = (
    "--parameters",
    "--gpu",
    "--gpu_memory_gib",
    "--interconnect",
    "--margin",
    "--host_memory_gib",
    "--write",
    "--mtbf",
    "--restart",
    "--from_run",
    "--write_gb_s",
)
NO_INTERVAL = (
    "Checkpoint interval: not estimated: nothing fits, so no rank's bytes to write (--from_run gives measured saves)"
)
SAVE_SECONDS = "time/checkpoint_save_seconds"  # what a run logs of each save (training/monitor.py)


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`plan`'s own options; every recipe field is an override as well (`--model.n_layer 48`, `--devices 8`)."""
    from ..planner.hardware import GPUS, INTERCONNECTS
    from ..planner.interval import DEFAULT_RESTART, DEFAULT_WRITE_GB_S

    parser.description = (
        "Memory per device, communication and a step-time bound of every strategy, and the one to pick."
        " Every recipe field is an override too: --model.n_layer, --model.block_size (sequence length),"
        " --devices, --num_nodes, --precision, --train.micro_batch_size, ..."
    )
    known = ", ".join(name for name, gpu in GPUS.items() if gpu.memory_mib)
    parser.add_argument("recipe", nargs="?", default=None, help="Recipe name or path (first); none: 8 GPUs, bf16.")
    parser.add_argument("--parameters", type=float, default=None, help="A bare parameter count, e.g. 70e9.")
    parser.add_argument("--gpu", default="H100", help=f"A GPU of the table in hardware.py: {known}, ...")
    parser.add_argument("--gpu_memory_gib", type=float, default=None, help="Memory per device instead of the table's.")
    parser.add_argument("--interconnect", default="infiniband", help=f"Between nodes: {', '.join(INTERCONNECTS)}.")
    parser.add_argument("--margin", type=float, default=0.1, help="Fraction of device memory kept free.")
    parser.add_argument("--host_memory_gib", type=float, default=None, help="Host RAM per node, for CPU offload.")
    parser.add_argument("--write", default=None, help="Write the recommended recipe to this file.")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON (its fields: docs/strategies.md).")
    parser.add_argument("--mtbf", default=None, help="Mean time between failures (8h, 90m, 3600s): adds the interval.")
    parser.add_argument(
        "--restart", default=None, help=f"Time a restart takes, for goodput (default {DEFAULT_RESTART})."
    )
    parser.add_argument("--from_run", default=None, help="A run's out_dir: the save cost its CSV metrics measured.")
    parser.add_argument(
        "--write_gb_s", type=float, default=None, help=f"Write GB/s per rank (default {DEFAULT_WRITE_GB_S:g})."
    )


def rehearse_one_rank(recipe: Recipe, checkpointing: bool) -> dict[str, Any]:
    """One step of the recipe's task, model, data, precision and micro batch on one rank with nothing sharded (plan's
    candidate of ZeRO stage 0 in one process: no wrapper, no collective), rehearsed; what the rank held, as JSON."""
    from ..planner.measured import estimated
    from ..planner.plan import CANDIDATES
    from ..planner.report import strategy_section
    from .rehearse import rehearse_ranks

    whole = next(c for c in CANDIDATES if c.option.stage == 0 and estimated(c.option) and c.option.runs_on_cpu)
    resolved = recipe.to_dict()
    strategy = {**resolved["strategy"], "compile": False}
    one_rank = {
        "task": recipe.task,
        "accelerator": recipe.accelerator,
        "devices": 1,
        "num_nodes": 1,
        "precision": recipe.precision,
        "strategy": strategy_section(
            whole, strategy, checkpointing=checkpointing, cpu=True, micro_batch=recipe.train.micro_batch_size
        ),
        "model": resolved["model"],
        "data": resolved["data"],
        "train": {**resolved["train"], "grad_accum_steps": 1},  # the peak of one micro-batch's step
    }
    with tempfile.TemporaryDirectory(prefix="plan-measure-") as folder:
        path = Path(folder) / "one-rank.yaml"
        path.write_text(yaml.safe_dump(one_rank, sort_keys=False))
        try:
            return rehearse_ranks(["--config", str(path)], [0])[0]
        except RecipeError as error:
            raise RecipeError(
                f"plan: task={recipe.task} has no size formulas (Task.model_cost) and rehearsing one step to measure"
                f" it failed: {error}"
            ) from None


def measured_cost(recipe: Recipe, task: Task) -> MeasuredCost:
    """What plan weighs for a task without size formulas: its model's sizes (a meta build) and one rehearsed step on
    one rank (planner/measured.py)."""
    from concurrent.futures import ThreadPoolExecutor

    from ..planner.measured import MeasuredCost, beyond_model_states, model_sizes

    with ThreadPoolExecutor(1) as pool:  # the rehearsal's process starts while this one builds the model
        rehearsed = pool.submit(rehearse_one_rank, recipe, checkpointing=False)
        sizes = model_sizes(task)
        buffers, activations = beyond_model_states(rehearsed.result())
    flops = (task.flops_per_unit() or 0.0) * task.units_per_sample()
    return MeasuredCost(sizes, recipe.train.micro_batch_size, buffers, activations, None, flops)


def with_checkpointing_measured(recipe: Recipe, cost: MeasuredCost) -> MeasuredCost:
    """`cost` with what the step holds when every block is checkpointed, rehearsed too."""
    from ..planner.measured import beyond_model_states

    _, activations = beyond_model_states(rehearse_one_rank(recipe, checkpointing=True))
    return dataclasses.replace(cost, checkpointed_measured=activations)


def rehearsed_before_writing(text: str, target: Path, device: Device) -> str:
    """Rehearse the default ranks of the recipe `text` about to be written to `target` (`rehearse`'s: the first, the
    last, the first of each pipeline stage). A RecipeError, and nothing written, when the recipe checks refuse it, a
    rank fails, or one peaks above the device's memory; otherwise what to say of it beside 'wrote'."""
    from ..planner.units import size
    from ..strategies import strategy_for
    from .rehearse import default_ranks, rehearse_ranks

    with tempfile.TemporaryDirectory(prefix="plan-write-") as folder:
        path = Path(folder) / target.name
        path.write_text(text)
        argv = ["--config", str(path)]
        try:
            written = parse_recipe(argv, "plan --write")
            problem = strategy_for(written).rehearsal_problem()
            if problem:  # DeepSpeed builds for CUDA only: what plan weighs it by is DeepSpeed's own estimator
                return problem
            ranks = default_ranks(written)
            results = rehearse_ranks(argv, ranks)
        except RecipeError as error:
            raise RecipeError(f"--write {target}: not written: {error}") from None
    worst = max(results, key=lambda rank: rank["peak_bytes"])
    peak, memory = worst["peak_bytes"], device.memory_bytes
    if peak > memory:
        raise RecipeError(
            f"--write {target}: not written: rehearsed, rank {worst['rank']} peaks at {size(peak)}, above the"
            f" {device.name}'s {size(memory)} (more than plan estimated: raise --margin, or see `rehearse` for each"
            " rank's figures)"
        )
    return f"rehearsed ranks {', '.join(str(rank) for rank in ranks)}: peak {size(peak)} of {size(memory)}"


def measured_save_cost(out_dir: str) -> SaveCost:
    """The save cost a run measured: the seconds its saves blocked training, from the CSV metrics under `out_dir`."""
    from ..planner.interval import measured_save
    from .report import read_segments

    try:
        segments = read_segments(Path(out_dir))
    except RecipeError as error:
        raise RecipeError(f"--from_run {out_dir}: {str(error).removeprefix('report: ')}") from None
    seconds = [value for segment in segments for _, value, _ in segment.series.get(SAVE_SECONDS, [])]
    if not seconds:
        raise RecipeError(f"--from_run {out_dir}: its CSV metrics hold no {SAVE_SECONDS} (it saved no checkpoint yet)")
    return measured_save(seconds, out_dir)


def checkpoint_interval(result: Plan, recipe: Recipe, options: Any, measured: SaveCost | None) -> IntervalPlan | None:
    """The interval for `--mtbf`: from the run's measured saves, else from the bytes a rank of the recommended layout
    writes; None when there is neither (nothing fits)."""
    from ..planner.interval import (
        DEFAULT_RESTART,
        DEFAULT_WRITE_GB_S,
        checkpoint_bytes_per_rank,
        estimated_save,
        interval_plan,
        parse_duration,
    )

    best = result.recommended
    cost = measured
    if cost is None and best is not None and best.sizes is not None:
        per_rank = checkpoint_bytes_per_rank(best.sizes, best.candidate.option.stage)
        cost = estimated_save(per_rank, recipe.checkpoint.async_save, options.write_gb_s or DEFAULT_WRITE_GB_S)
    if cost is None:
        return None
    restart = parse_duration(options.restart or DEFAULT_RESTART, "--restart")
    return interval_plan(cost, parse_duration(options.mtbf, "--mtbf"), restart)


def check_interval_options(options: Any) -> SaveCost | None:
    """Refuse bad --mtbf, --restart, --from_run and --write_gb_s values before anything is measured; the save cost
    --from_run names, if any."""
    from ..planner.interval import parse_duration

    if options.mtbf is None:
        given = [flag for flag in ("restart", "from_run", "write_gb_s") if getattr(options, flag) is not None]
        if given:
            raise RecipeError(f"--{given[0]} needs --mtbf: the mean time between failures the interval is chosen for")
        return None
    parse_duration(options.mtbf, "--mtbf")
    if options.restart is not None:
        parse_duration(options.restart, "--restart")
    if options.write_gb_s is not None and not options.write_gb_s > 0:
        raise RecipeError(f"--write_gb_s={options.write_gb_s:g} must be > 0")
    return measured_save_cost(options.from_run) if options.from_run else None


def write_plan(
    result: Plan,
    recipe: Recipe,
    name: str | None,
    target: Path,
    device: Device,
    prog: str,
    interval: IntervalPlan | None = None,
) -> str:
    """Write the recommended recipe to `target` once its rehearsal passes (`rehearsed_before_writing`); the line that
    says so. It starts from the planned recipe (file and overrides: its task, model, data, train and the rest), or
    without one from a library recipe of the recommended layout, and takes plan's layout, precision, micro batch and
    strategy, and the checkpoint interval when one was planned (`--mtbf`)."""
    from ..planner.report import library_recipe, written_recipe

    if result.recommended is None:
        raise RecipeError(f"--write {target}: {result.reason}")
    if target.exists():
        raise RecipeError(f"--write {target}: the file exists (choose another name)")
    if name:
        base = recipe.to_dict()
    else:
        inputs = result.inputs
        start = library_recipe(result.recommended.candidate, inputs)
        path = find_recipe(start) if start else recipe_for_layout(inputs.cpu, inputs.num_nodes > 1)
        base = yaml.safe_load(path.read_text())
    recipe_dict = written_recipe(base, dataclasses.asdict(recipe.model), result)
    if interval is not None:  # in minutes, as the recipe takes it
        interval_minutes = max(0.01, round(interval.interval_seconds / 60, 2))
        recipe_dict.setdefault("checkpoint", {})["save_every_minutes"] = interval_minutes
    text = f"# Written by `{prog} plan`: {result.reason}\n" + yaml.safe_dump(recipe_dict, sort_keys=False)
    said = rehearsed_before_writing(text, target, device)
    try:
        target.write_text(text)
    except OSError as error:
        raise RecipeError(f"--write {target}: cannot write it ({error.strerror})") from None
    return f"wrote {target} ({said})"


def run(argv: list[str], prog: str) -> None:
    """`plan [RECIPE] [options] [recipe overrides]`: print (or --write, --json) the plan."""
    import json
    import sys

    from ..planner.hardware import INTERCONNECTS
    from ..planner.interval import render_interval
    from ..planner.measured import NOT_ESTIMATED, estimated
    from ..planner.plan import CANDIDATES, plan, plan_inputs
    from ..planner.report import render, to_json
    from ..planner.supported import refused_candidates

    name, own, overrides = split_command_line(argv, PLAN_FLAGS, ("--json",))
    parser = ArgumentParser(prog=f"{prog} plan", exit_on_error=False)
    add_arguments(parser, prog)
    try:
        options = parser.parse_args([*own] + ([name] if name else []))
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(first_line(error)) from None
    if options.interconnect not in INTERCONNECTS:
        raise RecipeError(f"--interconnect={options.interconnect}: choose {', '.join(INTERCONNECTS)}")
    for flag in ("gpu_memory_gib", "parameters", "host_memory_gib"):
        if getattr(options, flag) is not None and getattr(options, flag) <= 0:
            raise RecipeError(f"--{flag}={getattr(options, flag):g} must be > 0")
    if not 0 <= options.margin < 1:
        raise RecipeError(f"--margin={options.margin:g} must be in [0, 1): the fraction of device memory kept free")
    if options.write and Path(options.write).exists():  # before any measuring
        raise RecipeError(f"--write {options.write}: the file exists (choose another name)")
    measured_save = check_interval_options(options)
    base = ["--config", str(find_recipe(name))] if name else list(PLAN_DEFAULTS)
    if options.parameters and not name:  # a bare count: plan it on the task's nearest reference shape
        task = task_for(parse_recipe([*base, *overrides], f"{prog} plan"))
        reference = (task.reference_model(options.parameters) or {}).items()
        base += [arg for key, value in reference for arg in (f"--{key}", str(value))]
    recipe = parse_recipe([*base, *overrides], f"{prog} plan")
    task = task_for(recipe)
    device = plan_device(options, recipe)
    cost = task.model_cost()
    measured = measured_cost(recipe, task) if cost is None else None
    refused = refused_candidates(recipe, CANDIDATES)
    if measured is not None:  # what one rank without sharding cannot tell
        refused |= {c.name: NOT_ESTIMATED for c in CANDIDATES if not estimated(c.option)}
        if not measured.flops_per_sample:  # no FLOPs: no step-time bound
            device = dataclasses.replace(device, peak_tflops=None)
    cost = cost or measured
    assert cost is not None
    trained = task.trained_parameters()  # adapters: beside the model's own parameters
    parameters = int(options.parameters) if options.parameters else cost.parameters() + (trained or 0)
    host = options.host_memory_gib * 2**30 if options.host_memory_gib else None
    link = INTERCONNECTS[options.interconnect]
    inputs = plan_inputs(recipe, cost, parameters, device, link, options.margin, host, trained)
    inputs = dataclasses.replace(inputs, refused=refused)
    result = plan(inputs)
    if measured is not None:
        if result.recommended is None or result.micro_batch != inputs.micro_batch:
            # Nothing fits at the recipe's micro batch without checkpointing: what checkpointing saves decides.
            result = plan(dataclasses.replace(inputs, cost=with_checkpointing_measured(recipe, measured)))
        # The candidates a measurement does not estimate are left out of the table.
        result = dataclasses.replace(result, estimates=[e for e in result.estimates if estimated(e.candidate.option)])
    interval = checkpoint_interval(result, recipe, options, measured_save) if options.mtbf else None
    if options.json:
        planned = to_json(result)
        if options.mtbf:  # null when nothing fits and no run measured a save
            planned["checkpoint_interval"] = interval.to_json() if interval else None
        print(json.dumps(planned, indent=2))
    else:
        print(render(result))
        if options.mtbf:
            print(render_interval(interval) if interval else NO_INTERVAL)
    if options.write:
        wrote = write_plan(result, recipe, name, Path(options.write), device, prog, interval)
        print(wrote, file=sys.stderr if options.json else sys.stdout)
