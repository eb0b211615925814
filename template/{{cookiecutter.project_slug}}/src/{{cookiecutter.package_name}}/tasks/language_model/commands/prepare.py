"""`<project> prepare INPUTS --out FOLDER`: tokenize .txt/.jsonl/.parquet/saved datasets into token shards (data/prepare.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from ....commands import parse_arguments

HELP = "Text -> token shards (data.source=prepared)."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`prepare`'s arguments: the inputs, the folder to write and how to tokenize."""
    parser.description = "Tokenize .txt/.jsonl/.parquet files and Hugging Face datasets into token shards."
    parser.add_argument(
        "inputs", nargs="+",
        help="Folders, files or globs of .txt, .jsonl and .parquet files, folders of datasets' save_to_disk, or URLs"
        " of any of these (hf://datasets/..., s3://...).",
    )  # fmt: skip
    parser.add_argument(
        "--out", required=True, help="Folder or URL (s3://...) to write (must not exist); data.path of the recipe."
    )
    parser.add_argument(
        "--tokenizer", default=None,
        help="A Hugging Face tokenizer.json to tokenize with (--format sft: or a tokenizer folder with its chat template).",
    )  # fmt: skip
    parser.add_argument("--train_tokenizer", type=int, default=None, help="Train a byte-level BPE of this size.")
    parser.add_argument("--text_field", default="text", help="Text field of .jsonl records / column of .parquet.")
    parser.add_argument("--val_fraction", type=float, default=0.01, help="Share of tokens held out.")
    parser.add_argument("--workers", type=int, default=None, help="Tokenizing processes (default: every core).")
    parser.add_argument("--shard_tokens", type=int, default=1 << 28, help="Tokens per shard file.")
    parser.add_argument(
        "--engine", default="local", help="Where tokenizing runs: local (--workers processes) or ray (a Ray cluster)."
    )
    parser.add_argument("--tasks", type=int, default=None, help="Ray tasks (--engine ray; default: one per file).")
    parser.add_argument(
        "--format", default="text",
        help="text (documents -> a token stream) or sft (.jsonl chat records with 'messages' or 'prompt'/'response'"
        " -> examples whose loss counts the replies only; train with data.format: sft).",
    )  # fmt: skip
    parser.add_argument(
        "--chat_template", default=None,
        help="--format sft: plain (the project's plain template); default: the tokenizer folder's chat_template if it"
        " has one, else plain.",
    )  # fmt: skip


def run(argv: list[str], prog: str) -> None:
    """Tokenize the inputs into a prepared folder and say how to train on it."""
    args = parse_arguments(prog, "prepare", add_arguments, argv)
    from ..data.prepare import prepare  # imports tokenizers and numpy, not torch

    manifest = prepare(
        args.inputs, args.out, args.tokenizer, args.train_tokenizer, args.text_field, args.val_fraction,
        args.workers, args.shard_tokens, engine=args.engine, tasks=args.tasks, format=args.format,
        chat_template=args.chat_template,
    )  # fmt: skip
    vocab = manifest["tokenizer"]["vocab_size"]
    what = "examples" if "sft" in manifest else "documents"
    print(
        f"Prepared {manifest['documents']:,} {what}, {manifest['tokens']:,} tokens ({manifest['dtype']}) in"
        f" {len(manifest['shards'])} shard(s) at {args.out}; validation: {manifest['validation']['tokens']:,} tokens"
    )
    sft = ", data.format: sft" if "sft" in manifest else ""
    print(f"Train on it: data.source: prepared, data.path: {args.out}{sft}, model.vocab_size: >= {vocab}")
