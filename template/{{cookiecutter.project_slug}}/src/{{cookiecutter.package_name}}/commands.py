"""What the commands other than `train` do: check recipes, list/inspect/consolidate checkpoints, plan, slurm.

The command line (cli.py) parses and dispatches to these; each raises RecipeError for a user error.
Modules that import torch are imported inside the functions that need them, so listing and checking stay fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.checks import needs_gpu
from {{ cookiecutter.package_name }}.recipe.library import find_recipe
from {{ cookiecutter.package_name }}.recipe.load import load_recipe
from {{ cookiecutter.package_name }}.recipe.schema import Recipe
from {{ cookiecutter.package_name }}.strategies import strategy_for


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
    print(f"Load: model = build_model(ModelConfig(**yaml.safe_load(open('{path / 'config.yaml'}'))['model']))")
    print(f"      model.load_state_dict(torch.load('{output}', weights_only=True))")


def print_plan(args: Any) -> None:
    """Print the training state per GPU of every strategy for a recipe's model and layout, and a recommendation."""
    from {{ cookiecutter.package_name }}.plan import plan

    if args.gpu_memory_gib <= 0:
        raise RecipeError(f"--gpu_memory_gib={args.gpu_memory_gib:g} must be > 0")
    if not 0 <= args.headroom < 1:
        raise RecipeError(f"--headroom={args.headroom:g} must be in [0, 1): the fraction of GPU memory kept free")
    recipe = load_recipe(find_recipe(args.recipe))
    lines, verdict = plan(recipe, recipe.model.parameter_count(), args.gpu_memory_gib, args.headroom)
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
