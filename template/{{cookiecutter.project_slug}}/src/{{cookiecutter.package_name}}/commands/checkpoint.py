"""`<project> checkpoint list|inspect|consolidate|compare`: the checkpoints of a run, what one holds, its weights as
one file, where two differ.

A CHECKPOINT argument is read by checkpoint/layout.py's `resolve_checkpoint` (a step folder, or a run: its
newest complete checkpoint), as `sample` and `export` read theirs. Listing reads only folders and
meta.json (no torch); inspecting, consolidating and comparing load the state. `compare --fingerprints` compares
two runs' per-step fingerprints (training/fingerprint.py) instead: the first step where they part.
"""

from __future__ import annotations

from pathlib import Path

from jsonargparse import ArgumentParser

from ..checkpoint.layout import (
    checkpoints_folder,
    read_meta,
    resolve_checkpoint,
    scan_checkpoints,
    step_of,
)
from ..checkpoint.provenance import PROVENANCE, describe, recorded
from ..errors import RecipeError
from ..progress import working
from ..tasks import task_class
from . import as_subcommand, choose_a_command, parse_arguments

PACKAGE = __name__.partition(".")[0]  # this package's import name
HELP = "Checkpoints of a run."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`checkpoint`'s subcommands."""
    parser.description = "List, inspect and consolidate checkpoints."
    actions = parser.add_subcommands(dest="action")
    listing = ArgumentParser(exit_on_error=False)
    listing.add_argument("run", help="A run's out_dir or its checkpoints folder.")
    actions.add_subcommand("list", listing, help="Steps, sizes, complete or not.")
    inspect = ArgumentParser(exit_on_error=False)
    inspect.add_argument("path", help="A checkpoint folder (step-N), or a run: its newest.")
    actions.add_subcommand("inspect", inspect, help="What a checkpoint holds.")
    consolidate = ArgumentParser(exit_on_error=False)
    consolidate.add_argument("path", help="A checkpoint folder (step-N), or a run: its newest.")
    consolidate.add_argument("output", help="File to write the model weights to.")
    consolidate.add_argument("--force", action="store_true", help="Replace the output file if it exists.")
    actions.add_subcommand("consolidate", consolidate, help="One weights file for plain PyTorch.")
    compare = ArgumentParser(exit_on_error=False)
    compare.add_argument("first", help="A checkpoint folder (step-N), or a run: its newest.")
    compare.add_argument("second", help="The checkpoint (or run) to compare it with.")
    compare.add_argument("--tolerance", type=float, default=0.0, help="Largest absolute difference taken as equal.")
    compare.add_argument(
        "--fingerprints",
        action="store_true",
        help="Compare two runs' fingerprints.jsonl (logger.fingerprint): the first step where they part.",
    )
    actions.add_subcommand(
        "compare", compare, help="The first tensor (or step) where two checkpoints (or runs) differ; exit 1 if any."
    )


def run(argv: list[str], prog: str) -> None:
    """Run a `checkpoint` subcommand; without one, show the choices."""
    if not argv:
        choose_a_command(as_subcommand(prog, "checkpoint", add_arguments), ["checkpoint"])
    args = parse_arguments(prog, "checkpoint", add_arguments, argv)
    if args.action == "list":
        list_checkpoint_folders(args.list.run)
    elif args.action == "inspect":
        inspect_checkpoint(args.inspect.path)
    elif args.action == "consolidate":
        consolidate_checkpoint(args.consolidate.path, args.consolidate.output, args.consolidate.force)
    else:
        compare = args.compare
        compare_checkpoints_or_runs(compare.first, compare.second, compare.tolerance, compare.fingerprints)


def folder_size(path: Path) -> int:
    """Bytes under a folder (or of a file)."""
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def list_checkpoint_folders(run: str) -> None:
    """Print every checkpoint folder of a run: step, size, complete or why not."""
    root = checkpoints_folder(Path(run))
    if not root.is_dir():
        raise RecipeError(f"{run!r}: no such run or checkpoints folder")
    complete, not_complete = scan_checkpoints(root)
    problems: dict[Path, str | None] = {**dict.fromkeys(complete), **not_complete}
    rows = []
    for path in sorted(folder for folder in problems if folder.is_dir()):
        problem = problems[path]
        status = "complete" if problem is None else f"INCOMPLETE: {problem}"
        rows.append(f"{path.name:<24} step {step_of(path):>8}  {folder_size(path) / 2**20:>10.1f} MiB  {status}")
    print("\n".join(rows) if rows else f"no checkpoints in {root}")


def inspect_checkpoint(name: str) -> None:
    """Print what a checkpoint holds."""
    path = resolve_checkpoint(name)
    from ..checkpoint.load import load_full_state  # imports torch: once the path is checked

    meta = read_meta(path, needs=("strategy",))
    with working(f"Reading {path}"):
        state = load_full_state(path)
    weights = state["model"]
    print(f"checkpoint   {path}")
    task = task_class(meta["task"]) if "task" in meta else None
    units = f"{meta.get('units_seen', 0):,} {task.unit if task else 'unit'}s seen"
    print(f"step         {step_of(path)}  ({units})")
    print(f"saved by     {meta['strategy']} on {meta.get('world_size', '?')} process(es)")
    print(f"size         {folder_size(path) / 2**20:.1f} MiB in {len(meta['files'])} files")
    print(f"parameters   {sum(t.numel() for t in weights.values()):,} in {len(weights)} tensors")
    print(f"data         {state['data']}")
    print(f"scheduler    last_epoch={state['scheduler']['last_epoch']}")
    print(f"config       {path / 'config.yaml'}")
    provenance = recorded(meta.get(PROVENANCE))
    if provenance:
        print("\n".join(describe(provenance)))
    else:
        print(f"provenance   {'not readable' if PROVENANCE in meta else 'not recorded (saved by an older version)'}")


def consolidate_checkpoint(name: str, output: str, force: bool = False) -> None:
    """Write a checkpoint's weights as one plain PyTorch file."""
    path = resolve_checkpoint(name)
    from ..checkpoint.load import consolidate  # imports torch: once the path is checked

    with working(f"Consolidating {path}"):
        weights = consolidate(path, Path(output), force)
    print(f"Wrote {len(weights)} tensors ({sum(t.numel() for t in weights.values()):,} parameters) to {output}")
    print(
        f"Load: model = task_for(load_recipe('{path / 'config.yaml'}')).build_model()  # {PACKAGE}.tasks, .recipe.load"
    )
    print(f"      model.load_state_dict(torch.load('{output}', weights_only=True))")


def compare_checkpoints_or_runs(first: str, second: str, tolerance: float, fingerprints: bool) -> None:
    """Print where two checkpoints (or, with `fingerprints`, two runs' steps) first differ; exit 1 when they do."""
    if not tolerance >= 0:
        raise RecipeError(f"--tolerance={tolerance}: must be 0 (bitwise) or a positive absolute difference")
    if fingerprints:
        from ..training.fingerprint import divergence_lines

        lines, same = divergence_lines(first, second, tolerance)
    else:
        paths = resolve_checkpoint(first), resolve_checkpoint(second)
        from ..checkpoint.compare import compare_checkpoints  # imports torch: once the paths are checked

        with working(f"Comparing {paths[0]} with {paths[1]}"):
            comparison = compare_checkpoints(*paths, tolerance)
        lines, same = comparison.lines(*paths), not comparison.differences
    print("\n".join(lines))
    if not same:
        raise SystemExit(1)  # like diff and cmp: 0 the same, 1 different, 2 bad input
