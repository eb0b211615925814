"""What the commands other than `train` do: check recipes, list/inspect/consolidate checkpoints, plan, slurm,
prepare, sample, export.

The command line (cli.py) parses and dispatches to these; each raises RecipeError for a user error.
Modules that import torch are imported inside the functions that need them, so listing and checking stay fast.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jsonargparse import ArgumentParser

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.checks import needs_gpu
from {{ cookiecutter.package_name }}.recipe.library import find_recipe
from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.strategies import strategy_for
from {{ cookiecutter.package_name }}.tasks import task_class, task_for

if TYPE_CHECKING:
    from {{ cookiecutter.package_name }}.planner.plan import Device  # plan imports sizing: only when planning


def describe(recipe: Recipe) -> str:
    """Where a recipe runs, in words; says so when it needs GPUs this machine does not have."""
    strategy = strategy_for(recipe)
    gpu_only = needs_gpu(recipe)
    hardware = "GPU" if gpu_only else ("CPU" if recipe.accelerator == "cpu" else "GPU, or CPU if none")
    text = (
        f"{recipe.world_size} process(es) = {recipe.devices} device(s) x {recipe.num_nodes} node(s),"
        f" {hardware}, {strategy.describe()}, precision {recipe.precision}"
    )
    if gpu_only:
        import torch  # only for recipes that need GPUs: listing and checking stay fast

        if not torch.cuda.is_available():
            requirement = strategy.gpu_requirement()
            reason = requirement.why if requirement is not None else "accelerator=cuda"
            text += f" (needs CUDA GPUs: {reason}; this machine has none, so train it on a GPU machine)"
    return text


def validate_recipes(files: list[str]) -> None:
    """Check recipe files; raises on the first invalid one."""
    for name in files:
        path = find_recipe(name)
        recipe = load_recipe(path)
        print(f"ok: {path}: {describe(recipe)}")
        if data := task_for(recipe).describe():
            print(f"    {data}")


def folder_size(path: Path) -> int:
    """Bytes under a folder (or of a file)."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_checkpoint_folders(run: str) -> None:
    """Print every checkpoint folder of a run: step, size, complete or why not."""
    from {{ cookiecutter.package_name }}.checkpoint.layout import STEP_DIR, problem_with

    root = Path(run)
    root = root / "checkpoints" if (root / "checkpoints").is_dir() else root
    if not root.is_dir():
        raise RecipeError(f"{run!r}: no such run or checkpoints folder")
    rows = []
    for path in sorted(root.iterdir()):
        match = STEP_DIR.match(path.name.removesuffix(".partial"))
        if not match or not path.is_dir():
            continue
        problem = "unfinished save" if path.name.endswith(".partial") else problem_with(path)
        status = "complete" if problem is None else f"INCOMPLETE: {problem}"
        rows.append(f"{path.name:<24} step {int(match.group(1)):>8}  {folder_size(path) / 2**20:>10.1f} MiB  {status}")
    print("\n".join(rows) if rows else f"no checkpoints in {root}")


def inspect_checkpoint(name: str) -> None:
    """Print what a checkpoint holds."""
    from {{ cookiecutter.package_name }}.checkpoint.io import load_full_state
    from {{ cookiecutter.package_name }}.checkpoint.layout import problem_with, read_meta

    path = Path(name)
    if problem := problem_with(path) if path.is_dir() else "no such folder":
        raise RecipeError(f"{name!r}: not a complete checkpoint: {problem}")
    meta = read_meta(path)
    state = load_full_state(path)
    weights = state["model"]
    print(f"checkpoint   {path}")
    task = task_class(meta["task"]) if "task" in meta else None
    units = f"{meta.get('units_seen', 0):,} {task.unit if task else 'unit'}s seen"
    print(f"step         {meta['step']}  ({units})")
    print(f"saved by     {meta['strategy']} on {meta['world_size']} process(es)")
    print(f"size         {folder_size(path) / 2**20:.1f} MiB in {len(meta['files'])} files")
    print(f"parameters   {sum(t.numel() for t in weights.values()):,} in {len(weights)} tensors")
    print(f"data         {state['data']}")
    print(f"scheduler    last_epoch={state['scheduler']['last_epoch']}")
    print(f"config       {path / 'config.yaml'}")


def consolidate_checkpoint(name: str, output: str) -> None:
    """Write a checkpoint's weights as one plain PyTorch file."""
    from {{ cookiecutter.package_name }}.checkpoint.io import consolidate
    from {{ cookiecutter.package_name }}.checkpoint.layout import problem_with

    path = Path(name)
    if problem := problem_with(path) if path.is_dir() else "no such folder":
        raise RecipeError(f"{name!r}: not a complete checkpoint: {problem}")
    weights = consolidate(path, Path(output))
    print(f"Wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} parameters) to {output}")
    print(f"Load: model = build_model(ModelConfig(**yaml.safe_load(open('{path / 'config.yaml'}'))['model']))")
    print(f"      model.load_state_dict(torch.load('{output}', weights_only=True))")


def plan_parser(prog: str) -> ArgumentParser:
    """`plan`'s own options; every recipe field is an override as well (`--model.n_layer 48`, `--devices 8`)."""
    from {{ cookiecutter.package_name }}.planner.hardware import GPUS, INTERCONNECTS

    planner = ArgumentParser(
        prog=f"{prog} plan",
        exit_on_error=False,
        description="Memory per device, communication and a step-time bound of every strategy, and the one to pick."
        " Every recipe field is an override too: --model.n_layer, --model.block_size (sequence length),"
        " --devices, --num_nodes, --precision, --train.micro_batch_size, ...",
    )
    known = ", ".join(name for name, gpu in GPUS.items() if gpu.memory_mib)
    planner.add_argument("recipe", nargs="?", default=None, help="Recipe name or path (first); none: 8 GPUs, bf16.")
    planner.add_argument("--parameters", type=float, default=None, help="A bare parameter count, e.g. 70e9.")
    planner.add_argument("--gpu", default="H100", help=f"A GPU of the table in hardware.py: {known}, ...")
    planner.add_argument("--gpu_memory_gib", type=float, default=None, help="Memory per device instead of the table's.")
    planner.add_argument("--interconnect", default="infiniband", help=f"Between nodes: {', '.join(INTERCONNECTS)}.")
    planner.add_argument("--margin", type=float, default=0.1, help="Fraction of device memory kept free.")
    planner.add_argument("--host_memory_gib", type=float, default=None, help="Host RAM per node, for CPU offload.")
    planner.add_argument("--write", default=None, help="Write the recommended recipe to this file.")
    planner.add_argument("--json", action="store_true", help="Print the plan as JSON (schema in the README).")
    return planner


# With no recipe, `plan` starts from a node of 8 GPUs training in bf16-mixed, one sequence per micro-batch.
PLAN_DEFAULTS = [
    "--accelerator",
    "cuda",
    "--devices",
    "8",
    "--precision",
    "bf16-mixed",
    "--train.micro_batch_size",
    "1",
]
PLAN_FLAGS = ("--parameters", "--gpu", "--gpu_memory_gib", "--interconnect", "--margin", "--host_memory_gib", "--write")


def plan_device(options: Any, recipe: Recipe) -> Device:
    """The device the plan assumes: a row of the hardware table (or a CPU process), its memory overridable."""
    from {{ cookiecutter.package_name }}.planner.hardware import GPUS, PCIE_PEER_GB_S, gpu_model
    from {{ cookiecutter.package_name }}.planner.plan import Device
    from {{ cookiecutter.package_name }}.precision import table_column

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


def print_plan(argv: list[str], prog: str) -> None:
    """`plan [RECIPE] [options] [recipe overrides]`: print (or --write, --json) the plan. Imports no torch."""
    import dataclasses
    import json
    import sys

    import yaml

    from {{ cookiecutter.package_name }}.planner.hardware import INTERCONNECTS
    from {{ cookiecutter.package_name }}.planner.plan import plan, plan_inputs
    from {{ cookiecutter.package_name }}.planner.report import library_recipe, render, to_json, written_recipe
    from {{ cookiecutter.package_name }}.recipe.load import parse_recipe, split_command_line

    name, own, overrides = split_command_line(argv, PLAN_FLAGS, ("--json",))
    try:
        options = plan_parser(prog).parse_args([*own] + ([name] if name else []))
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(str(error).strip().splitlines()[0]) from None
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
        base += [arg for key, value in reference for arg in (f"--model.{key}", str(value))]
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
        library = yaml.safe_load(find_recipe(library_recipe(result.recommended.candidate, result.inputs)).read_text())
        recipe_dict = written_recipe(library, dataclasses.asdict(recipe.model), result)
        header = f"# Written by `{prog} plan`: {result.reason}\n"
        target.write_text(header + yaml.safe_dump(recipe_dict, sort_keys=False))
        print(f"wrote {target}", file=sys.stderr if options.json else sys.stdout)


def print_sbatch(args: Any) -> None:
    """Print the sbatch script for a recipe; its counts come from the recipe."""
    from {{ cookiecutter.package_name }}.cluster.slurm import check_job_options, sbatch_script

    path = find_recipe(args.recipe)
    recipe = load_recipe(path)
    check_job_options(args.time, args.cpus_per_task)
    # Relative to the folder sbatch is run from (the job starts there), so the script works on any clone.
    relative = os.path.relpath(path.resolve())
    recipe_path = str(path.resolve()) if relative.startswith("..") else relative
    print(
        sbatch_script(recipe, recipe_path, args.time, args.partition, args.account, args.job_name, args.cpus_per_task),
        end="",
    )


def prepare_data(args: Any) -> None:
    """Tokenize the inputs into a prepared folder and say how to train on it."""
    from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare  # imports tokenizers and numpy, not torch

    manifest = prepare(
        args.inputs, args.out, args.tokenizer, args.train_tokenizer, args.text_field, args.val_fraction,
        args.workers, args.shard_tokens,
    )  # fmt: skip
    vocab = manifest["tokenizer"]["vocab_size"]
    print(
        f"Prepared {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}) in"
        f" {len(manifest['shards'])} shard(s) at {args.out}; validation: {manifest['validation']['tokens']:,} tokens"
    )
    print(f"Train on it: data.source: prepared, data.path: {args.out}, model.vocab_size: >= {vocab}")


def export_checkpoint(args: Any) -> None:
    """Write a checkpoint as a Hugging Face model folder and say how to load it."""
    from {{ cookiecutter.package_name }}.tasks.language_model.export import export_hf  # imports torch
    from {{ cookiecutter.package_name }}.tasks.language_model.sample import resolve_checkpoint

    path = resolve_checkpoint(args.checkpoint)
    done = export_hf(path, Path(args.out_dir), args.max_shard_bytes)
    tokenizer = ", tokenizer" if done["tokenizer"] else ""
    print(
        f"Wrote {done['architecture']} ({done['tensors']} tensors, {done['bytes'] / 2**20:,.1f} MiB of {done['dtype']}"
        f" in {done['files']} safetensors file(s){tokenizer}) from {path} to {args.out_dir}"
    )
    print(f"Load: transformers.AutoModelForCausalLM.from_pretrained('{args.out_dir}')")


def print_sample(args: Any) -> None:
    """Print a checkpoint's continuation of a prompt."""
    from {{ cookiecutter.package_name }}.tasks.language_model.sample import sample  # imports torch

    print(sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
