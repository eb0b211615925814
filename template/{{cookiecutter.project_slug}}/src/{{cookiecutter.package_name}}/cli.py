"""Command line: `train`, `recipes list|show|copy|validate`, `plan`, `checkpoint list|inspect|consolidate`, `slurm`,
`prepare`, `sample`.

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
        if recipe.data.source == "prepared":
            from {{ cookiecutter.package_name }}.data.sources import describe_prepared  # imports numpy only

            print(f"    {describe_prepared(recipe.data, recipe.model)}")


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

    planner = ArgumentParser(exit_on_error=False, description="GPU memory of the training state per strategy.")
    planner.add_argument("recipe", help="Recipe name or path: its model, precision, devices and nodes.")
    planner.add_argument("--gpu_memory_gib", type=float, default=80.0, help="Memory of one GPU in GiB.")
    planner.add_argument("--headroom", type=float, default=0.3, help="Fraction of it kept for activations.")
    commands.add_subcommand("plan", planner, help="Which strategy fits a recipe's model on its GPUs.")

    slurm = ArgumentParser(exit_on_error=False, description="Print an sbatch script for a recipe (nodes, tasks, GPUs).")
    slurm.add_argument("recipe", help="Recipe name or path.")
    slurm.add_argument("--time", default="24:00:00", help="Time limit (HH:MM:SS or D-HH:MM:SS).")
    slurm.add_argument("--partition", default=None, help="SLURM partition.")
    slurm.add_argument("--account", default=None, help="SLURM account.")
    slurm.add_argument("--job_name", default=PROG, help="Job name.")
    slurm.add_argument("--cpus_per_task", type=int, default=8, help="CPU cores per task (data loading, threads).")
    commands.add_subcommand("slurm", slurm, help=f"Write an sbatch script: {PROG} slurm RECIPE > job.sbatch.")

    preparer = ArgumentParser(exit_on_error=False, description="Tokenize .txt/.jsonl/.parquet files into token shards.")
    preparer.add_argument("inputs", nargs="+", help="Folders, files or globs of .txt, .jsonl and .parquet files.")
    preparer.add_argument("--out", required=True, help="Folder to write (must not exist); data.path of the recipe.")
    preparer.add_argument("--tokenizer", default=None, help="A Hugging Face tokenizer.json to tokenize with.")
    preparer.add_argument("--train-tokenizer", type=int, default=None, help="Train a byte-level BPE of this size.")
    preparer.add_argument("--text-field", default="text", help="Text field of .jsonl records / column of .parquet.")
    preparer.add_argument("--val-fraction", type=float, default=0.01, help="Share of tokens held out.")
    preparer.add_argument("--workers", type=int, default=None, help="Tokenizing processes (default: every core).")
    preparer.add_argument("--shard-tokens", type=int, default=1 << 28, help="Tokens per shard file.")
    commands.add_subcommand("prepare", preparer, help="Text -> token shards (data.source=prepared).")

    sampler = ArgumentParser(exit_on_error=False, description="Continue a prompt with a trained checkpoint.")
    sampler.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    sampler.add_argument("--prompt", default="", help="Text to continue (empty: start a new document).")
    sampler.add_argument("--max-new-tokens", type=int, default=200, help="Tokens to generate.")
    sampler.add_argument("--temperature", type=float, default=0.8, help="Sampling temperature (0: greedy).")
    sampler.add_argument("--top-k", type=int, default=200, help="Sample among the k most likely tokens only.")
    sampler.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")
    commands.add_subcommand("sample", sampler, help="Print what a checkpoint's model writes after a prompt.")
    return parser


def prepare_data(args: Any) -> None:
    """Tokenize the inputs into a prepared folder and say how to train on it."""
    from {{ cookiecutter.package_name }}.data.prepare import prepare  # imports tokenizers and numpy, not torch

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


def print_sample(args: Any) -> None:
    """Print a checkpoint's continuation of a prompt."""
    from {{ cookiecutter.package_name }}.sample import sample  # imports torch

    print(sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))


def print_plan(args: Any) -> None:
    """Print the training state per GPU of every strategy for a recipe's model and layout, and a recommendation."""
    from {{ cookiecutter.package_name }}.model import count_parameters  # imports torch
    from {{ cookiecutter.package_name }}.plan import plan

    if args.gpu_memory_gib <= 0:
        raise RecipeError(f"--gpu_memory_gib={args.gpu_memory_gib:g} must be > 0")
    if not 0 <= args.headroom < 1:
        raise RecipeError(f"--headroom={args.headroom:g} must be in [0, 1): the fraction of GPU memory kept free")
    recipe = load_recipe(find_recipe(args.recipe))
    lines, verdict = plan(recipe, count_parameters(recipe.model), args.gpu_memory_gib, args.headroom)
    print("\n".join([*lines, "", verdict]))


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
    try:
        args = build_parser().parse_args(argv)
    except Exception as error:  # jsonargparse's ArgumentError spans lines; keep the first
        raise RecipeError(str(error).strip().splitlines()[0]) from None
    if args.command == "slurm":
        print_sbatch(args.slurm)
        return
    if args.command == "prepare":
        prepare_data(args.prepare)
        return
    if args.command == "sample":
        print_sample(args.sample)
        return
    if args.command == "plan":
        print_plan(args.plan)
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
