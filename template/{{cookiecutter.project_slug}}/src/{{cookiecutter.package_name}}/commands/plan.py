"""`<project> plan [RECIPE] [options] [recipe overrides]`: memory, communication and a step-time bound of every
strategy for a model on a cluster, and the one to pick (planner/). Imports no torch.

Its own options are split from the recipe overrides (recipe/load.py's `split_command_line`): every recipe
field is an override too (`--model.n_layer 48`, `--devices 8`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from jsonargparse import ArgumentParser

from ..errors import RecipeError
from ..recipe.library import find_recipe, recipe_for_layout
from ..recipe.load import parse_recipe, split_command_line
from ..recipe.schema import Recipe, TrainConfig, field_path
from ..tasks import task_for
from . import first_line

if TYPE_CHECKING:
    from ..planner.plan import Device  # plan imports sizing: only when planning

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
PLAN_FLAGS = ("--parameters", "--gpu", "--gpu_memory_gib", "--interconnect", "--margin", "--host_memory_gib", "--write")


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`plan`'s own options; every recipe field is an override as well (`--model.n_layer 48`, `--devices 8`)."""
    from ..planner.hardware import GPUS, INTERCONNECTS

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


def plan_device(options: Any, recipe: Recipe) -> Device:
    """The device the plan assumes: a row of the hardware table (or a CPU process), its memory overridable."""
    from ..planner.hardware import GPUS, PCIE_PEER_GB_S, gpu_model
    from ..planner.plan import Device
    from ..precision import table_column

    memory = int(options.gpu_memory_gib * 2**30) if options.gpu_memory_gib else None
    if recipe.accelerator == "cpu":
        name = "CPU" + ("" if memory else " (16 GiB per process assumed; set --gpu_memory_gib)")
        return Device(name, memory or 16 * 2**30, None, 0.0)
    row = gpu_model(options.gpu)
    if row is None:
        known = ", ".join(name for name, gpu in GPUS.items() if gpu.memory_mib)
        raise RecipeError(f"--gpu={options.gpu}: not in the table (choose {known}, or another row of hardware.py)")
    gpu = GPUS[row]
    if memory is None and gpu.memory_mib is None:
        raise RecipeError(f"--gpu={options.gpu}: the table has no memory figure for the {row} (add --gpu_memory_gib)")
    name = f"{row} ({options.gpu_memory_gib:g} GiB)" if memory else row
    peak = gpu.peaks.get(table_column(recipe.precision))
    return Device(name, memory or (gpu.memory_mib or 0) * 2**20, peak, gpu.intra_node_gb_s or PCIE_PEER_GB_S)


def run(argv: list[str], prog: str) -> None:
    """`plan [RECIPE] [options] [recipe overrides]`: print (or --write, --json) the plan."""
    import dataclasses
    import json
    import sys

    import yaml

    from ..planner.hardware import INTERCONNECTS
    from ..planner.plan import plan, plan_inputs
    from ..planner.report import library_recipe, render, to_json, written_recipe

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
    base = ["--config", str(find_recipe(name))] if name else list(PLAN_DEFAULTS)
    if options.parameters and not name:  # a bare count: plan it on the task's nearest reference shape
        task = task_for(parse_recipe([*base, *overrides], f"{prog} plan"))
        reference = (task.reference_model(options.parameters) or {}).items()
        base += [arg for key, value in reference for arg in (f"--{key}", str(value))]
    recipe = parse_recipe([*base, *overrides], f"{prog} plan")
    cost = task_for(recipe).model_cost()
    if cost is None:
        raise RecipeError(f"plan: task={recipe.task} has no size formulas (Task.model_cost), so plan cannot tell")
    device = plan_device(options, recipe)
    parameters = int(options.parameters) if options.parameters else cost.parameters()
    host = options.host_memory_gib * 2**30 if options.host_memory_gib else None
    inputs = plan_inputs(recipe, cost, parameters, device, INTERCONNECTS[options.interconnect], options.margin, host)
    result = plan(inputs)
    if options.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        print(render(result))
    if options.write:
        if result.recommended is None:
            raise RecipeError(f"--write {options.write}: {result.reason}")
        target = Path(options.write)
        if target.exists():
            raise RecipeError(f"--write {target}: the file exists (choose another name)")
        # The library recipe the strategy names, else the one planned, else one of the same layout.
        start = library_recipe(result.recommended.candidate, result.inputs) or name
        inputs = result.inputs
        path = find_recipe(start) if start else recipe_for_layout(inputs.cpu, inputs.num_nodes > 1)
        library = yaml.safe_load(path.read_text())
        recipe_dict = written_recipe(library, dataclasses.asdict(recipe.model), result)
        header = f"# Written by `{prog} plan`: {result.reason}\n"
        target.write_text(header + yaml.safe_dump(recipe_dict, sort_keys=False))
        print(f"wrote {target}", file=sys.stderr if options.json else sys.stdout)
