"""Command line: `train`, `recipes list|show|copy|validate`, `plan`, `checkpoint list|inspect|consolidate`, `slurm`.

Every user error ends in one line on stderr naming what is wrong and what is allowed, exit code 2.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

from jsonargparse import ArgumentParser

from {{ cookiecutter.package_name }}.config import Recipe, RecipeError, load_recipe, needs_gpu, parse_recipe, recipe_parser
from {{ cookiecutter.package_name }}.errors import TrainingStopped

PROG = "{{ cookiecutter.project_slug }}"


def recipes_dir() -> Path:
    """The project's recipe library: `recipes/` at the project root, else in the current folder."""
    beside_source = Path(__file__).resolve().parents[2] / "recipes"
    return beside_source if beside_source.is_dir() else Path.cwd() / "recipes"


def find_recipe(name: str) -> Path:
    """A recipe by library name (`cpu-debug`) or by path."""
    path = Path(name)
    if path.is_file():
        return path
    candidate = recipes_dir() / f"{name.removesuffix('.yaml')}.yaml"
    if candidate.is_file():
        return candidate
    available = ", ".join(p.stem for p in sorted(recipes_dir().glob("*.yaml"))) or "none"
    raise RecipeError(f"recipe {name!r} not found (library recipes: {available})")


def summary(path: Path) -> str:
    """The first header comment line of a recipe: when to choose it."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def describe(recipe: Recipe) -> str:
    """Where a recipe runs, in words; says so when it needs GPUs this machine does not have."""
    hardware = "GPU" if needs_gpu(recipe) else ("CPU" if recipe.accelerator == "cpu" else "GPU, or CPU if none")
    text = (
        f"{recipe.world_size} process(es) = {recipe.devices} device(s) x {recipe.num_nodes} node(s),"
        f" {hardware}, strategy {recipe.strategy.name}, precision {recipe.precision}"
    )
    if needs_gpu(recipe):
        import torch  # only for recipes that need GPUs: listing and checking stay fast

        if not torch.cuda.is_available():
            text += f" (needs CUDA GPUs: {gpu_reason(recipe)}; this machine has none, so train it on a GPU machine)"
    return text


def gpu_reason(recipe: Recipe) -> str:
    """Why a recipe needs GPUs, in a few words."""
    if recipe.strategy.name in ("fsdp", "deepspeed"):
        return f"Fabric runs strategy {recipe.strategy.name} only on GPUs"
    if recipe.strategy.float8:
        return "float8 needs compute capability 8.9+"
    return "accelerator=cuda"


def list_recipes() -> None:
    """Print the library, one line per recipe."""
    recipes = sorted(recipes_dir().glob("*.yaml"))
    width = max((len(p.stem) for p in recipes), default=0)
    for path in recipes:
        print(f"{path.stem:<{width}}  {summary(path)}")


def show_recipe(name: str) -> None:
    """Print a recipe file as it is."""
    print(find_recipe(name).read_text(), end="")


def copy_recipe(name: str, dest: str, force: bool = False) -> None:
    """Copy a library recipe to a new file to edit."""
    source, target = find_recipe(name), Path(dest)
    if target.is_dir():
        target = target / source.name
    if target.exists() and not force:
        raise RecipeError(f"{target} already exists (choose another destination or pass --force)")
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    print(f"Copied {source.stem} to {target}; edit it, then: {PROG} train --config {target}")


def validate_recipes(files: list[str]) -> None:
    """Check recipe files; raises on the first invalid one."""
    for name in files:
        path = find_recipe(name)
        recipe = load_recipe(path)
        print(f"ok: {path}: {describe(recipe)}")


def folder_size(path: Path) -> int:
    """Bytes under a folder (or of a file)."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_checkpoint_folders(run: str) -> None:
    """Print every checkpoint folder of a run: step, size, complete or why not."""
    from {{ cookiecutter.package_name }}.checkpoint import STEP_DIR, problem_with

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
    from {{ cookiecutter.package_name }}.checkpoint import load_full_state, problem_with, read_meta

    path = Path(name)
    if problem := problem_with(path) if path.is_dir() else "no such folder":
        raise RecipeError(f"{name!r}: not a complete checkpoint: {problem}")
    meta = read_meta(path)
    state = load_full_state(path)
    weights = state["model"]
    print(f"checkpoint   {path}")
    print(f"step         {meta['step']}  (tokens seen {meta['tokens_seen']:,})")
    print(f"saved by     {meta['strategy']} on {meta['world_size']} process(es)")
    print(f"size         {folder_size(path) / 2**20:.1f} MiB in {len(meta['files'])} files")
    print(f"parameters   {sum(t.numel() for t in weights.values()):,} in {len(weights)} tensors")
    print(f"data         {state['data']}")
    print(f"scheduler    last_epoch={state['scheduler']['last_epoch']}")
    print(f"config       {path / 'config.yaml'}")


def consolidate_checkpoint(name: str, output: str) -> None:
    """Write a checkpoint's weights as one plain PyTorch file."""
    from {{ cookiecutter.package_name }}.checkpoint import consolidate, problem_with

    path = Path(name)
    if problem := problem_with(path) if path.is_dir() else "no such folder":
        raise RecipeError(f"{name!r}: not a complete checkpoint: {problem}")
    weights = consolidate(path, Path(output))
    print(f"Wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} parameters) to {output}")
    print(f"Load: model = GPT(ModelConfig(**yaml.safe_load(open('{path / 'config.yaml'}'))['model']))")
    print(f"      model.load_state_dict(torch.load('{output}', weights_only=True))")


def build_parser() -> ArgumentParser:
    """The top-level parser and its subcommands."""
    parser = ArgumentParser(prog=PROG, exit_on_error=False, description="Distributed training with Lightning Fabric.")
    commands = parser.add_subcommands(dest="command")
    commands.add_subcommand("train", recipe_parser(f"{PROG} train"), help="Train with a recipe and overrides.")

    recipes = ArgumentParser(exit_on_error=False, description="Browse, copy and check the recipe library.")
    commands.add_subcommand("recipes", recipes, help="The recipe library.")
    recipe_commands = recipes.add_subcommands(dest="action")
    recipe_commands.add_subcommand("list", ArgumentParser(exit_on_error=False), help="One line per recipe.")
    show = ArgumentParser(exit_on_error=False)
    show.add_argument("name", help="Recipe name or path.")
    recipe_commands.add_subcommand("show", show, help="Print a recipe.")
    copy = ArgumentParser(exit_on_error=False)
    copy.add_argument("name", help="Recipe name or path.")
    copy.add_argument("dest", help="File (or folder) to write.")
    copy.add_argument("--force", action="store_true", help="Overwrite an existing file.")
    recipe_commands.add_subcommand("copy", copy, help="Copy a recipe to edit.")
    validate = ArgumentParser(exit_on_error=False)
    validate.add_argument("files", nargs="+", help="Recipe files or names.")
    recipe_commands.add_subcommand("validate", validate, help="Check recipes and say where they run.")

    checkpoints = ArgumentParser(exit_on_error=False, description="List, inspect and consolidate checkpoints.")
    commands.add_subcommand("checkpoint", checkpoints, help="Checkpoints of a run.")
    checkpoint_commands = checkpoints.add_subcommands(dest="action")
    listing = ArgumentParser(exit_on_error=False)
    listing.add_argument("run", help="A run's out_dir or its checkpoints folder.")
    checkpoint_commands.add_subcommand("list", listing, help="Steps, sizes, complete or not.")
    inspect = ArgumentParser(exit_on_error=False)
    inspect.add_argument("path", help="A checkpoint folder (step-N).")
    checkpoint_commands.add_subcommand("inspect", inspect, help="What a checkpoint holds.")
    consolidate = ArgumentParser(exit_on_error=False)
    consolidate.add_argument("path", help="A checkpoint folder (step-N).")
    consolidate.add_argument("output", help="File to write the model weights to.")
    checkpoint_commands.add_subcommand("consolidate", consolidate, help="One weights file for plain PyTorch.")

    commands.add_subcommand("plan", plan_parser(), help="Which strategy for a model on a cluster.")

    slurm = ArgumentParser(exit_on_error=False, description="Print an sbatch script for a recipe (nodes, tasks, GPUs).")
    slurm.add_argument("recipe", help="Recipe name or path.")
    slurm.add_argument("--time", default="24:00:00", help="Time limit (HH:MM:SS or D-HH:MM:SS).")
    slurm.add_argument("--partition", default=None, help="SLURM partition.")
    slurm.add_argument("--account", default=None, help="SLURM account.")
    slurm.add_argument("--job_name", default=PROG, help="Job name.")
    slurm.add_argument("--cpus_per_task", type=int, default=8, help="CPU cores per task (data loading, threads).")
    commands.add_subcommand("slurm", slurm, help=f"Write an sbatch script: {PROG} slurm RECIPE > job.sbatch.")
    return parser


def plan_parser() -> ArgumentParser:
    """`plan`'s own options; every recipe field is an override as well (`--model.n_layer 48`, `--devices 8`)."""
    from {{ cookiecutter.package_name }}.hardware import GPUS, INTERCONNECTS

    planner = ArgumentParser(
        prog=f"{PROG} plan",
        exit_on_error=False,
        description="Memory per device, communication and a step-time bound of every strategy, and the one to pick."
        " Every recipe field is an override too: --model.n_layer, --model.block_size (sequence length),"
        " --devices, --num_nodes, --precision, --train.micro_batch_size, ...",
    )
    planner.add_argument("recipe", nargs="?", default=None, help="Recipe name or path (first); none: 8 GPUs, bf16.")
    planner.add_argument("--parameters", type=float, default=None, help="A bare parameter count, e.g. 70e9.")
    planner.add_argument("--gpu", default="H100", help=f"One of {', '.join(GPUS)}.")
    planner.add_argument("--gpu_memory_gib", type=float, default=None, help="Memory per device instead of the table's.")
    planner.add_argument("--interconnect", default="infiniband", help=f"Between nodes: {', '.join(INTERCONNECTS)}.")
    planner.add_argument("--margin", type=float, default=0.1, help="Fraction of device memory kept free.")
    planner.add_argument("--host_memory_gib", type=float, default=None, help="Host RAM per node, for CPU offload.")
    planner.add_argument("--write", default=None, help="Write the recommended recipe to this file.")
    planner.add_argument("--json", action="store_true", help="Print the plan as JSON (schema in the README).")
    return planner


# With no recipe, `plan` starts from a node of 8 GPUs training in bf16-mixed, one sequence per micro-batch.
PLAN_DEFAULTS = (
    "--accelerator",
    "cuda",
    "--devices",
    "8",
    "--precision",
    "bf16-mixed",
    "--train.micro_batch_size",
    "1",
)
PLAN_FLAGS = ("--parameters", "--gpu", "--gpu_memory_gib", "--interconnect", "--margin", "--host_memory_gib", "--write")


def print_plan(argv: list[str]) -> None:
    """`plan [RECIPE] [options] [recipe overrides]`: print (or --write, --json) the plan. Imports no torch."""
    import dataclasses
    import json

    import yaml

    from {{ cookiecutter.package_name }}.hardware import GPUS, INTERCONNECTS, Gpu
    from {{ cookiecutter.package_name }}.plan import plan, plan_inputs
    from {{ cookiecutter.package_name }}.plan_report import library_recipe, reference_model, render, to_json, written_recipe
    from {{ cookiecutter.package_name }}.sizing import gpt_parameters

    name = argv[0] if argv and not argv[0].startswith("-") else None
    own, overrides, rest = [], [], argv[1:] if name else argv
    while rest:
        token, rest = rest[0], rest[1:]
        if token.split("=")[0] in PLAN_FLAGS and "=" not in token and rest:
            own, rest = [*own, token, rest[0]], rest[1:]
        elif token.split("=")[0] in (*PLAN_FLAGS, "--json", "-h", "--help"):
            own.append(token)
        else:
            overrides.append(token)
    try:
        options = plan_parser().parse_args([*own] + ([name] if name else []))
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(str(error).strip().splitlines()[0]) from None
    if options.gpu not in GPUS:
        raise RecipeError(f"--gpu={options.gpu}: not in the table (choose {', '.join(GPUS)}, or add --gpu_memory_gib)")
    if options.interconnect not in INTERCONNECTS:
        raise RecipeError(f"--interconnect={options.interconnect}: choose {', '.join(INTERCONNECTS)}")
    for flag in ("gpu_memory_gib", "parameters", "host_memory_gib"):
        if getattr(options, flag) is not None and getattr(options, flag) <= 0:
            raise RecipeError(f"--{flag}={getattr(options, flag):g} must be > 0")
    if not 0 <= options.margin < 1:
        raise RecipeError(f"--margin={options.margin:g} must be in [0, 1): the fraction of device memory kept free")
    base = ["--config", str(find_recipe(name))] if name else list(PLAN_DEFAULTS)
    if options.parameters and not name:  # a bare count: plan it on the nearest reference shape
        reference = reference_model(options.parameters).items()
        base += [arg for key, value in reference for arg in (f"--model.{key}", str(value))]
    recipe = parse_recipe([*base, *overrides], recipe_parser(f"{PROG} plan"))
    gpu = GPUS[options.gpu]
    if options.gpu_memory_gib:
        memory = int(options.gpu_memory_gib * 2**30)
        gpu = dataclasses.replace(gpu, name=f"{gpu.name} ({options.gpu_memory_gib:g} GiB)", memory_bytes=memory)
    elif recipe.accelerator == "cpu":
        gpu = Gpu("CPU (16 GiB per process assumed; set --gpu_memory_gib)", 16 * 2**30, 0.0, 0.0, 0.0)
    parameters = int(options.parameters) if options.parameters else gpt_parameters(recipe.model)
    host = options.host_memory_gib * 2**30 if options.host_memory_gib else None
    result = plan(plan_inputs(recipe, parameters, gpu, INTERCONNECTS[options.interconnect], options.margin, host))
    if options.json:
        print(json.dumps(to_json(result), indent=2))
    else:
        model = recipe.model
        shape = f"n_layer={model.n_layer}, n_embd={model.n_embd}, n_head={model.n_head}, vocab_size={model.vocab_size}"
        print(render(result, shape))
    if options.write:
        if result.recommended is None:
            raise RecipeError(f"--write {options.write}: {result.reason}")
        target = Path(options.write)
        if target.exists():
            raise RecipeError(f"--write {target}: the file exists (choose another name)")
        library = yaml.safe_load(find_recipe(library_recipe(result.recommended.candidate, result.inputs)).read_text())
        recipe_dict = written_recipe(library, dataclasses.asdict(recipe.model), result)
        header = f"# Written by `{PROG} plan`: {result.reason}\n"
        target.write_text(header + yaml.safe_dump(recipe_dict, sort_keys=False))
        print(f"wrote {target}", file=sys.stderr if options.json else sys.stdout)


def print_sbatch(args: Any) -> None:
    """Print the sbatch script for a recipe; its counts come from the recipe."""
    from {{ cookiecutter.package_name }}.slurm import sbatch_script

    path = find_recipe(args.recipe)
    recipe = load_recipe(path)
    if args.cpus_per_task < 1:
        raise RecipeError(f"--cpus_per_task={args.cpus_per_task} must be >= 1")
    print(
        sbatch_script(recipe, str(path), args.time, args.partition, args.account, args.job_name, args.cpus_per_task),
        end="",
    )


def run(argv: list[str]) -> None:
    """Dispatch a command line; raises RecipeError for user errors."""
    if argv[:1] == ["train"]:
        recipe = parse_recipe(argv[1:], recipe_parser(f"{PROG} train"))
        from {{ cookiecutter.package_name }}.train import train  # imports torch: only when training

        train(recipe)
        return
    if argv[:1] == ["plan"]:
        print_plan(argv[1:])
        return
    try:
        args = build_parser().parse_args(argv)
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(str(error).strip().splitlines()[0]) from None
    if args.command == "slurm":
        print_sbatch(args.slurm)
        return
    if args.command == "checkpoint":
        sub = args.checkpoint
        if sub.action == "list":
            list_checkpoint_folders(sub.list.run)
        elif sub.action == "inspect":
            inspect_checkpoint(sub.inspect.path)
        else:
            consolidate_checkpoint(sub.consolidate.path, sub.consolidate.output)
        return
    action = args.recipes.action
    if action == "list":
        list_recipes()
    elif action == "show":
        show_recipe(args.recipes.show.name)
    elif action == "copy":
        copy_recipe(args.recipes.copy.name, args.recipes.copy.dest, args.recipes.copy.force)
    elif action == "validate":
        validate_recipes(args.recipes.validate.files)


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    code = 0
    try:
        run(sys.argv[1:] if argv is None else argv)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        code = 2
    except TrainingStopped as stopped:  # preempted (exit 75: requeued) or a non-finite loss (exit 3)
        from {{ cookiecutter.package_name }}.train import report_stop

        code = report_stop(stopped)
    exit_process(code)


def exit_process(code: int) -> None:
    """End with exit code `code`; a process that joined a process group leaves it and skips interpreter teardown.

    Gloo's worker threads can still be releasing the last collective's tensors while the interpreter
    tears down; the thread then cannot take the GIL and the process aborts ("terminate called without
    an active exception", SIGABRT), replacing the exit code (3, 75) that launchers and the SLURM
    script act on. By now checkpoints are written and loggers finished, so only streams need flushing.
    """
    distributed = sys.modules.get("torch.distributed")  # imported only if this process trained
    if distributed is not None and distributed.is_available() and distributed.is_initialized():
        distributed.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
