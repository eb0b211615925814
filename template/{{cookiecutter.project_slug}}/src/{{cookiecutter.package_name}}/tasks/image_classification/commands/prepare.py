"""`<project> prepare FOLDER --out PREPARED`: an image folder (a subfolder per class) -> uint8 shards (prepare.py)."""

from __future__ import annotations

from jsonargparse import ArgumentParser

from ....commands import parse_arguments

HELP = "Image folder -> uint8 image shards (data.source=prepared)."


def add_arguments(parser: ArgumentParser, prog: str) -> None:
    """`prepare`'s arguments: the image folder, the folder to write, the size and the split."""
    parser.description = "Decode, resize and shard an image folder: one subfolder per class of PNG/JPEG files."
    parser.add_argument("folder", help="The image folder: FOLDER/<class>/<image>.png|jpg|jpeg.")
    parser.add_argument("--out", required=True, help="Folder to write (must not exist); data.path of the recipe.")
    parser.add_argument("--image_size", type=int, required=True, help="Pixels per side (model.image_size).")
    parser.add_argument("--channels", type=int, choices=[1, 3], default=3, help="1: grey, 3: RGB (model.channels).")
    parser.add_argument("--val_fraction", type=float, default=0.05, help="Share of images held out.")
    parser.add_argument("--shard_images", type=int, default=None, help="Images per shard file (default: ~512 MiB).")
    parser.add_argument("--workers", type=int, default=None, help="Decoding processes (default: every core).")


def run(argv: list[str], prog: str) -> None:
    """Prepare an image folder and say how to train on it."""
    args = parse_arguments(prog, "prepare", add_arguments, argv)
    from ..prepare import prepare_images  # numpy, Pillow

    manifest = prepare_images(
        args.folder, args.out, args.image_size, args.channels, args.val_fraction, args.shard_images, args.workers
    )
    print(f"Prepared {manifest['images']:,} images of {len(manifest['classes'])} classes at {args.out}")
    if ignored := manifest["sources"]["ignored_files"]:
        print(f"note: {ignored:,} files that are not PNG or JPEG were skipped")
    print(
        f"Train on it: data.source: prepared, data.path: {args.out}, model.image_size: {args.image_size},"
        f" model.channels: {args.channels}, model.num_classes: >= {len(manifest['classes'])}"
    )
