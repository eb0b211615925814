"""`prepare` for images: a folder of class subfolders -> uint8 shards at the model's image size, labels, manifest.

    prepare data/flowers --image_size 224 --channels 3 --out data/flowers-224

The input holds one subfolder per class: the classes are the sorted subfolder names and a label is
its class's index. Their .png, .jpg and .jpeg files (any case, at any depth) are the images; other files
are ignored and counted. Each image is decoded with Pillow, converted to RGB or grey, resized so its
shorter side is image_size (bicubic) and centre-cropped to a square. Decoding runs in `workers`
processes and images are written in input order, so the bytes do not depend on the number of workers.
The validation images are drawn here, per class and seeded, and written to shards of their own: every
run and every recipe on the folder holds out the same images.

    manifest.json                 task, format, kind, image_size, channels, classes, counts, the shards of each
                                  split (file, labels, images, sha256 of both), the split, sources; written last
    train-NNNNN.bin               pixels: uint8 (images, image_size, image_size, channels), numpy `tofile`
    train-NNNNN.labels.bin        labels: int64 little-endian (images,)
    validation-NNNNN[.labels].bin the held-out images, the same way

Everything is written to `OUT.partial` and renamed to `OUT` after the manifest; a folder is read only
when its manifest is complete and every file matches it, so an interrupted prepare or a damaged shard is
refused before training. Imports numpy, not torch (`recipes validate` uses `describe_prepared`).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from ...checkpoint.layout import new_partial, removed_unless_finished
from ...cluster.lifecycle import end_with_parent
from ...data.shards import Listed, ShardWriter, check_files, load_manifest, write_manifest
from ...errors import RecipeError
from ...progress import Meter
from ...recipe.typecheck import check_values
from .config import DATA_PATH, ImageDataConfig, ViTConfig

FORMAT = 1
KIND = "images"  # a token folder of the language model has a manifest too
TASK = "image_classification"  # the manifest's "task": `data verify` reads the folder with this task's code
SPLITS = ("train", "validation")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
LABEL_DTYPE = np.dtype("<i8")
SHARD_BYTES = 1 << 29  # 512 MiB of pixels per shard by default: few files, each stays memory-mapped
BATCH_IMAGES = 64  # images per task sent to a worker
DIGITS_SHAPE = (8, 1)  # image_size, channels of scikit-learn's digits
DIGITS_CLASSES = [str(digit) for digit in range(10)]
DIGITS_SPLIT_SEED = 0  # fixed: train.seed must not move images between the splits


def check_data(data: ImageDataConfig, model: ViTConfig) -> None:
    """Refuse data settings the model cannot train on, without reading the data."""
    check_values(data)  # its bounds, also where data is loaded without a parsed recipe
    if not 0 <= data.crop_padding < model.image_size:
        raise RecipeError(f"data.crop_padding={data.crop_padding} must be in [0, model.image_size)")
    if data.source == "prepared" and not data.path:
        raise RecipeError("data.path is required when data.source=prepared")
    if data.source == "digits" and (model.image_size, model.channels) != DIGITS_SHAPE:
        raise RecipeError(
            f"data.source=digits holds 8x8 grey images: model.image_size must be 8 and model.channels 1"
            f" (this recipe has {model.image_size} and {model.channels})"
        )
    if data.source == "digits" and model.num_classes < len(DIGITS_CLASSES):
        raise RecipeError(f"model.num_classes={model.num_classes} is too small for data.source=digits (10 classes)")


def class_names(data: ImageDataConfig) -> list[str]:
    """The class of each label: "0".."9" for the digits, the class folders' names for a prepared folder."""
    if data.source == "digits":
        return list(DIGITS_CLASSES)
    return list(read_manifest(Path(data.path or ""))["classes"])


def stratified_holdout(labels: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Which samples are held out: round(fraction * n) of each class's n, drawn from (seed, class); at least
    one of a class of two or more, never a whole class."""
    held_out = np.zeros(len(labels), dtype=bool)
    for label in np.unique(labels):
        members = np.flatnonzero(labels == label)
        count = min(len(members) - 1, max(1, round(len(members) * fraction)))
        held_out[np.random.default_rng([seed, int(label)]).permutation(members)[:count]] = True
    return held_out


# --- writing ----------------------------------------------------------------------------------------------


def find_images(folder: Path) -> tuple[list[str], list[tuple[Path, int]], int]:
    """(classes, every (image file, label) in a fixed order, files ignored) of an image folder."""
    if not folder.is_dir():
        raise RecipeError(f"input {str(folder)!r}: no such folder (give a folder with one subfolder per class)")
    class_folders = sorted(path for path in folder.iterdir() if path.is_dir() and not path.name.startswith("."))
    if len(class_folders) < 2:
        raise RecipeError(
            f"input {str(folder)!r}: {len(class_folders)} class subfolder(s), at least 2 needed"
            " (one subfolder of images per class, named after the class)"
        )
    ignored = sum(1 for path in folder.iterdir() if not path.is_dir())
    images = []
    for label, class_folder in enumerate(class_folders):
        files = sorted(path for path in class_folder.rglob("*") if path.is_file())
        found = [path for path in files if path.suffix.lower() in IMAGE_SUFFIXES]
        if not found:
            raise RecipeError(f"class folder {str(class_folder)!r}: no .png, .jpg or .jpeg images")
        images += [(path, label) for path in found]
        ignored += len(files) - len(found)
    return [path.name for path in class_folders], images, ignored


def decode_image(path: Path | str, image_size: int, channels: int) -> np.ndarray:
    """An image file as uint8 (image_size, image_size, channels): shorter side resized (bicubic), centre-cropped."""
    from PIL import Image

    try:
        with Image.open(path) as opened:
            image = opened.convert("L" if channels == 1 else "RGB")
        scale = image_size / min(image.size)
        width, height = (max(image_size, round(side * scale)) for side in image.size)
        image = image.resize((width, height), Image.Resampling.BICUBIC)
        left, top = (width - image_size) // 2, (height - image_size) // 2
        image = image.crop((left, top, left + image_size, top + image_size))
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise RecipeError(f"image {str(path)!r} cannot be read ({type(error).__name__}: {error})") from None
    return np.asarray(image, dtype=np.uint8).reshape(image_size, image_size, channels)


def _decode_batch(paths: list[str], image_size: int, channels: int) -> np.ndarray:
    return np.stack([decode_image(path, image_size, channels) for path in paths])


def decoded_batches(paths: list[Path], image_size: int, channels: int, workers: int) -> Iterator[np.ndarray]:
    """The images of `paths` decoded, BATCH_IMAGES at a time and in order, in `workers` processes."""
    batches = [[str(path) for path in paths[i : i + BATCH_IMAGES]] for i in range(0, len(paths), BATCH_IMAGES)]
    if workers == 1:
        for batch in batches:
            yield _decode_batch(batch, image_size, channels)
        return
    # fork: workers start in milliseconds and need nothing re-imported; spawn elsewhere (macOS, Windows).
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with ProcessPoolExecutor(workers, context, end_with_parent, (os.getpid(),)) as pool:  # no worker outlives it
        pending: deque = deque()
        try:
            for batch in batches:
                pending.append(pool.submit(_decode_batch, batch, image_size, channels))
                if len(pending) > 2 * workers:  # bounded: reading stays a little ahead of decoding
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:  # a refused image: drop the queued work instead of decoding it
            for future in pending:
                future.cancel()


def shard_writer(folder: Path, split: str, shard_images: int) -> ShardWriter:
    """Images and labels to SPLIT-NNNNN.bin and .labels.bin files of `shard_images` images; write(pixels, labels)."""
    columns = {"file": (".bin", "sha256"), "labels": (".labels.bin", "labels_sha256")}
    return ShardWriter(folder, split, shard_images, "images", columns)


def prepare_images(
    input_folder: str,
    out: str,
    image_size: int,
    channels: int = 3,
    val_fraction: float = 0.1,
    shard_images: int | None = None,
    workers: int | None = None,
    split_seed: int = 0,
    progress: bool = True,
) -> dict[str, Any]:
    """Decode an image folder into a prepared folder at `out`; return its manifest. Checks everything it can first."""
    if image_size < 1 or channels not in (1, 3):
        raise RecipeError(f"--image_size {image_size} must be >= 1 and --channels {channels} 1 (grey) or 3 (RGB)")
    if not 0 < val_fraction < 1:
        raise RecipeError(f"--val_fraction {val_fraction:g} must be in (0, 1)")
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if shard_images is None:
        shard_images = max(1, SHARD_BYTES // (image_size * image_size * channels))
    if workers < 1 or shard_images < 1:
        raise RecipeError(f"--workers {workers} and --shard_images {shard_images} must be >= 1")
    target = Path(out)
    if target.exists():
        raise RecipeError(f"--out {out!r} already exists (choose another folder or delete it)")
    classes, images, ignored = find_images(Path(input_folder))
    labels = np.array([label for _, label in images], dtype=np.int64)
    held_out = stratified_holdout(labels, val_fraction, split_seed)
    if not held_out.any():
        raise RecipeError(f"input {input_folder!r}: no class has 2 images, so none can be held out for validation")

    with removed_unless_finished(new_partial(target)) as partial:
        writers = {split: shard_writer(partial, split, shard_images) for split in SPLITS}
        total = len(images)
        shown = Meter("prepare", total, "img", lambda done: f"{done:,} of {total:,} images written", progress)
        try:
            start = 0
            for pixels in decoded_batches([path for path, _ in images], image_size, channels, workers):
                held, batch_labels = held_out[start : start + len(pixels)], labels[start : start + len(pixels)]
                batch_labels = batch_labels.astype(LABEL_DTYPE)
                writers["train"].write(pixels[~held], batch_labels[~held])
                writers["validation"].write(pixels[held], batch_labels[held])
                start += len(pixels)
                shown.advance(len(pixels))
        finally:
            shown.close()
        manifest = {
            "task": TASK,
            "format": FORMAT,
            "kind": KIND,
            "image_size": image_size,
            "channels": channels,
            "pixels": "uint8 (images, image_size, image_size, channels)",
            "label_dtype": LABEL_DTYPE.str,
            "classes": classes,
            "images": len(images),
            "counts": {
                "train": np.bincount(labels[~held_out], minlength=len(classes)).tolist(),
                "validation": np.bincount(labels[held_out], minlength=len(classes)).tolist(),
            },
            "shards": {split: writer.close() for split, writer in writers.items()},
            "validation": {"fraction": val_fraction, "seed": split_seed, "images": int(held_out.sum())},
            "resize": "shorter side to image_size (bicubic), centre crop",
            "sources": {"folder": str(input_folder), "images": len(images), "ignored_files": ignored},
        }
        write_manifest(partial, manifest)
        partial.rename(target)
    return manifest


# --- reading ----------------------------------------------------------------------------------------------


def read_manifest(folder: Path, field: str = DATA_PATH) -> dict[str, Any]:
    """The manifest of a complete prepared image folder; refuses a missing, unfinished or foreign one."""
    hint = f"prepare IMAGE_FOLDER --out {folder}"
    return load_manifest(folder, field, hint, FORMAT, (KIND, "a prepared image folder"))


def verify(folder: Path, manifest: dict[str, Any], checksums: bool = False, field: str = DATA_PATH) -> None:
    """Refuse a folder whose files do not match its manifest: missing, another size, or (checksums) other bytes."""
    image_bytes = manifest["image_size"] ** 2 * manifest["channels"]
    files = []
    for shard in (shard for split in SPLITS for shard in manifest["shards"][split]):
        files.append(Listed(shard["file"], shard["images"] * image_bytes, shard["sha256"]))
        files.append(Listed(shard["labels"], shard["images"] * LABEL_DTYPE.itemsize, shard["labels_sha256"]))
    check_files(folder, files, checksums, field)


def describe_folder(folder: Path) -> str:
    """One line on what a prepared folder holds."""
    manifest = read_manifest(folder)
    shards = sum(len(manifest["shards"][split]) for split in SPLITS)
    size, channels = manifest["image_size"], manifest["channels"]
    return (
        f"{manifest['images']:,} images ({size}x{size}x{channels}) of {len(manifest['classes'])} classes in"
        f" {shards} shard(s), validation {manifest['validation']['images']:,} images"
    )


def check_fits(manifest: dict[str, Any], model: ViTConfig, folder: Path, field: str = DATA_PATH) -> None:
    """Refuse a prepared folder whose images or classes the model cannot take."""
    where = f"{field}={str(folder)!r}"
    for key in ("image_size", "channels"):
        if manifest[key] != getattr(model, key):
            raise RecipeError(
                f"model.{key}={getattr(model, key)} does not match {where}, prepared with {key} {manifest[key]}"
                f" (set model.{key}: {manifest[key]}, or prepare again with --{key.replace('_', '-')} {getattr(model, key)})"
            )
    if (classes := len(manifest["classes"])) > model.num_classes:
        raise RecipeError(
            f"model.num_classes={model.num_classes} is smaller than the {classes} classes of {where}"
            f" (set model.num_classes >= {classes})"
        )


def describe_prepared(data: ImageDataConfig, model: ViTConfig) -> str:
    """One line on a recipe's prepared folder (for `recipes validate`); refuses one the model cannot train on.

    Checks the manifest, the files' sizes, the image shape and the classes, not the checksums (`data verify` does).
    """
    folder = Path(data.path or "")
    if not folder.exists() and not folder.with_name(folder.name + ".partial").exists():
        return f"data: {folder} is not prepared yet (prepare IMAGE_FOLDER --out {folder} before training)"
    manifest = read_manifest(folder)
    verify(folder, manifest, checksums=False)
    check_fits(manifest, model, folder)
    return f"data: {describe_folder(folder)} at {folder}"
