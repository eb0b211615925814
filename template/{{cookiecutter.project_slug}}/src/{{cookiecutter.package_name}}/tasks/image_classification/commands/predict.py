"""`<project> predict CHECKPOINT IMAGE...`: the classes a checkpoint's model gives image files (predict.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from ....commands import parse_arguments

HELP = "Print the top classes a checkpoint's model gives image files."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`predict`'s arguments: the checkpoint, the images and how many classes to show."""
    parser.description = "Classify image files (PNG, JPEG) with a trained checkpoint."
    parser.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    parser.add_argument("images", nargs="+", help="Image files; resized as `prepare` resizes.")
    parser.add_argument("--top", type=int, default=3, help="Classes to print per image, most likely first.")


def run(argv: list[str], prog: str) -> None:
    """Print each image's most likely classes and their probabilities."""
    args = parse_arguments(prog, "predict", add_arguments, argv)
    from ..predict import predict  # imports torch

    for image, top in predict(args.checkpoint, args.images, args.top):
        print(f"{image}: " + ", ".join(f"{label} {probability:.3f}" for label, probability in top))
