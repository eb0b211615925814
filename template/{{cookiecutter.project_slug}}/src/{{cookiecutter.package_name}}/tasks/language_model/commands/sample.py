"""`<project> sample CHECKPOINT --prompt TEXT`: print what a checkpoint's model writes after a prompt (sample.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from ....commands import parse_arguments

HELP = "Print what a checkpoint's model writes after a prompt."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`sample`'s arguments: the checkpoint, the prompt and how to sample."""
    parser.description = "Continue a prompt with a trained checkpoint."
    parser.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    parser.add_argument("--prompt", default="", help="Text to continue (empty: start a new document).")
    parser.add_argument("--max_new_tokens", type=int, default=200, help="Tokens to generate.")
    parser.add_argument("--temperature", type=float, default=0.8, help="Sampling temperature (0: greedy).")
    parser.add_argument("--top_k", type=int, default=200, help="Sample among the k most likely tokens only.")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the sampling.")


def run(argv: list[str], prog: str) -> None:
    """Print a checkpoint's continuation of a prompt."""
    args = parse_arguments(prog, "sample", add_arguments, argv)
    from ..sample import sample  # imports torch

    print(sample(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed))
