"""`<project> export CHECKPOINT OUT_DIR`: a checkpoint as a folder transformers' ViTForImageClassification loads."""

from __future__ import annotations

from pathlib import Path

from jsonargparse import ArgumentParser

from ....checkpoint.layout import checkpoint_recipe, resolve_checkpoint
from ....commands import parse_arguments

HELP = "Checkpoint -> transformers' from_pretrained folder (ViTForImageClassification)."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`export`'s arguments: the checkpoint, the folder to write, the format and the largest file."""
    parser.description = "Write a checkpoint as a Hugging Face model folder."
    parser.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    parser.add_argument("out_dir", help="Folder to write (new or empty).")
    parser.add_argument("--format", choices=["hf"], default="hf", help="hf: config.json + safetensors + preprocessor.")
    parser.add_argument("--max_shard_bytes", type=int, default=5 * 10**9, help="Largest safetensors file.")


def run(argv: list[str], prog: str) -> None:
    """Write a checkpoint as a Hugging Face model folder and say how to load it."""
    args = parse_arguments(prog, "export", add_arguments, argv)
    path = resolve_checkpoint(args.checkpoint)
    from ..export import export_hf  # imports torch
    from ..prepare import class_names

    labels = class_names(checkpoint_recipe(path).data)
    done = export_hf(path, Path(args.out_dir), args.max_shard_bytes, labels)
    print(
        f"Wrote {done['architecture']} ({done['tensors']} tensors, {done['bytes'] / 2**20:,.1f} MiB of {done['dtype']}"
        f" in {done['files']} safetensors file(s), {len(labels)} labels) from {path} to {args.out_dir}"
    )
    print(f"Load: transformers.ViTForImageClassification.from_pretrained('{args.out_dir}')")
