"""`<project> export CHECKPOINT OUT_DIR`: a checkpoint as a folder transformers' from_pretrained loads (export.py)."""

from __future__ import annotations

from pathlib import Path

from jsonargparse import ArgumentParser

from ....checkpoint.layout import resolve_checkpoint
from ....commands import parse_arguments

HELP = "Checkpoint -> transformers' from_pretrained folder (or a peft adapter folder)."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`export`'s arguments: the checkpoint, the folder to write, the format and the largest file."""
    parser.description = "Write a checkpoint as a Hugging Face model folder."
    parser.add_argument("checkpoint", help="A checkpoint folder, or a run: its newest.")
    parser.add_argument("out_dir", help="Folder to write (new or empty).")
    parser.add_argument(
        "--format",
        choices=["hf", "peft"],
        default="hf",
        help="hf: config.json + safetensors (+ tokenizer), LoRA adapters merged in; peft: a LoRA checkpoint's"
        " adapters as a peft adapter folder for the base model.init_from names.",
    )
    parser.add_argument("--max_shard_bytes", type=int, default=5 * 10**9, help="Largest safetensors file.")


def run(argv: list[str], prog: str) -> None:
    """Write a checkpoint as a Hugging Face model folder and say how to load it."""
    args = parse_arguments(prog, "export", add_arguments, argv)
    path = resolve_checkpoint(args.checkpoint)
    if args.format == "peft":
        from ..export import export_adapters  # imports torch

        adapters = export_adapters(path, Path(args.out_dir))
        print(
            f"Wrote {adapters['tensors']} adapter tensors ({adapters['bytes'] / 2**20:,.1f} MiB) from {path} to"
            f" {args.out_dir}"
        )
        base = f"transformers.AutoModelForCausalLM.from_pretrained('{adapters['base']}')"
        print(f"Load: peft.PeftModel.from_pretrained({base}, '{args.out_dir}')")
        return
    from ..export import export_hf  # imports torch

    done = export_hf(path, Path(args.out_dir), args.max_shard_bytes)
    tokenizer = ", tokenizer" if done["tokenizer"] else ""
    print(
        f"Wrote {done['architecture']} ({done['tensors']} tensors, {done['bytes'] / 2**20:,.1f} MiB of {done['dtype']}"
        f" in {done['files']} safetensors file(s){tokenizer}) from {path} to {args.out_dir}"
    )
    print(f"Load: transformers.AutoModelForCausalLM.from_pretrained('{args.out_dir}')")
    if done["tokenizer"]:
        print(f"      transformers.AutoTokenizer.from_pretrained('{args.out_dir}')")
    if done["newline_prefix"] is not None:  # bytes: no token ends a document, lm-eval needs one to start a text with
        print(f"lm-eval: --model hf --model_args pretrained={args.out_dir},prefix_token_id={done['newline_prefix']}")
