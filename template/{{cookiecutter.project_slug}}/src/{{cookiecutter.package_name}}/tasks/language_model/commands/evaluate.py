"""`<project> evaluate CHECKPOINT --tasks NAME[,NAME...]`: lm-evaluation-harness tasks on a checkpoint (evaluate.py)."""

from __future__ import annotations

from pathlib import Path

from jsonargparse import ArgumentParser

from ....checkpoint.layout import resolve_checkpoint
from ....commands import parse_arguments
from ..task_folder import check_task_folder

HELP = "Score a checkpoint on lm-evaluation-harness tasks."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`evaluate`'s arguments: the checkpoint, the tasks and how to run them."""
    parser.description = (
        "Score a checkpoint's model on lm-evaluation-harness tasks (pip install .[eval]), offline: lm-eval's tasks"
        " whose data sets are in the local Hugging Face cache, or YAML tasks with local data files (--include_path; a"
        " task that runs the folder's own Python only with --allow_code_in_tasks)."
    )
    parser.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    parser.add_argument("--tasks", required=True, help="lm-eval task (or group) names, separated by commas.")
    parser.add_argument("--include_path", default=None, help="A folder of lm-eval task YAML files.")
    parser.add_argument(
        "--allow_code_in_tasks",
        type=bool,
        default=False,
        help="Let the --include_path folder's YAML run its own Python (`!function`): only for a folder you trust.",
    )
    parser.add_argument("--limit", type=float, default=None, help="Examples per task (a fraction below 1).")
    parser.add_argument("--batch_size", type=int, default=8, help="Sequences per forward pass.")
    parser.add_argument("--device", default="cpu", help="Where the model runs: cpu, cuda, cuda:1, ...")
    parser.add_argument("--log_samples", type=bool, default=False, help="Also write each example's scores.")
    parser.add_argument("--out", default=None, help="JSON file to write (default: CHECKPOINT.eval.json beside it).")


def run(argv: list[str], prog: str) -> None:
    """Evaluate a checkpoint, print each task's scores and where the results are."""
    args = parse_arguments(prog, "evaluate", add_arguments, argv)
    if args.include_path is not None:  # before anything else: the folder's YAML decides what lm-eval would run
        check_task_folder(args.include_path, args.allow_code_in_tasks, "--include_path", "--allow_code_in_tasks")
    path = resolve_checkpoint(args.checkpoint)
    from ..evaluate import evaluate_checkpoint, scores  # imports torch

    results, written = evaluate_checkpoint(
        path,
        [name.strip() for name in args.tasks.split(",") if name.strip()],
        include_path=args.include_path,
        allow_code=args.allow_code_in_tasks,
        limit=args.limit,
        batch_size=args.batch_size,
        device=args.device,
        log_samples=args.log_samples,
        out=Path(args.out) if args.out else None,
    )
    for name, value in scores(results).items():
        print(f"{name} {value:.4f}")
    print(f"Wrote {written}")
