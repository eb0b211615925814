"""The image classifier's samples: uint8 images (in memory or memory-mapped shards) batched as normalised tensors.

A batch is (images, labels): float32 (B, C, H, W) with every pixel mapped to (p / 255 - 0.5) / 0.5, in
[-1, 1], and int64 (B,). Training images are augmented: padded by data.crop_padding edge pixels on each side
and cropped back at a random offset, and flipped left-right at random when data.flip is on. The crop and
flip of a sample are drawn from (train.seed, its position in the run's sample stream), so a resumed run
sees the same pixels (data/sampler.py passes the positions as `draws`).

Data: scikit-learn's bundled digits (held out by a fixed split that train.seed does not move) or a folder
written by `prepare` (prepare.py), which brings its own split.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from ...data.shards import hashed_here
from ...errors import RecipeError
from .config import DATA_PATH, ImageDataConfig, ViTConfig
from .prepare import (
    DIGITS_SPLIT_SEED,
    LABEL_DTYPE,
    SPLITS,
    check_data,
    check_fits,
    read_manifest,
    stratified_holdout,
    verify,
)

# Pixel value -> normalised float32, as a table: one gather converts and normalises a batch in one pass.
NORMALISED = ((np.arange(256) / 255 - 0.5) / 0.5).astype(np.float32)


def normalise(pixels: np.ndarray) -> torch.Tensor:
    """uint8 images (B, H, W, C) -> float32 tensor (B, C, H, W) of (pixels / 255 - 0.5) / 0.5."""
    return torch.from_numpy(NORMALISED[np.ascontiguousarray(pixels.transpose(0, 3, 1, 2))])


class Images:
    """Labelled uint8 images: `batch` as they are (validation, predict), `augmented_batch` cropped and flipped.

    `pixels` is anything indexed by an array of sample indices that returns uint8 (n, H, W, C): an array, a
    memory map or prepared shards (`ShardedImages`).
    """

    def __init__(self, pixels: Any, labels: np.ndarray, crop_padding: int = 0, flip: bool = False, seed: int = 0):
        self.pixels = pixels
        self.labels = np.asarray(labels, dtype=np.int64)
        self.crop_padding = crop_padding
        self.flip = flip
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """These samples' images and labels, unaugmented."""
        chosen = np.asarray(indices, dtype=np.int64)
        return normalise(np.asarray(self.pixels[chosen])), torch.from_numpy(self.labels[chosen])

    def augmented_batch(self, indices: Sequence[int], draws: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch(indices)` with sample i cropped and flipped as drawn from (seed, draws[i])."""
        chosen = np.asarray(indices, dtype=np.int64)
        pixels = np.asarray(self.pixels[chosen])
        padding = self.crop_padding
        if padding or self.flip:
            cropped = np.empty_like(pixels)
            for i, draw in enumerate(draws):
                top, left, flip = self.augmentation(draw)
                image = np.pad(pixels[i], ((padding, padding), (padding, padding), (0, 0)), mode="edge")
                image = image[top : top + pixels.shape[1], left : left + pixels.shape[2]]
                cropped[i] = image[:, ::-1] if flip else image
            pixels = cropped
        return normalise(pixels), torch.from_numpy(self.labels[chosen])

    def augmentation(self, draw: int) -> tuple[int, int, bool]:
        """(top, left, flip) of the sample drawn at `draw`: the crop's offset in the padded image and the flip."""
        rng = np.random.default_rng([self.seed, draw])
        top, left = rng.integers(0, 2 * self.crop_padding + 1, size=2)
        return int(top), int(left), bool(self.flip and rng.random() < 0.5)


class ShardedImages:
    """Image shards as one read-only array of images: `len()` and `[indices]`, a copy in the order asked."""

    def __init__(self, shards: Sequence[np.ndarray], image_shape: tuple[int, ...]) -> None:
        self.shards = shards
        self.image_shape = image_shape
        self.offsets = np.cumsum([0] + [len(shard) for shard in shards])  # offsets[i]: first image of shard i

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) and (indices.min() < 0 or indices.max() >= len(self)):
            raise IndexError(f"image index outside [0, {len(self)})")
        shard_of = np.searchsorted(self.offsets, indices, side="right") - 1
        images = np.empty((len(indices), *self.image_shape), dtype=np.uint8)
        for shard in np.unique(shard_of):
            inside = shard_of == shard
            images[inside] = self.shards[shard][indices[inside] - self.offsets[shard]]
        return images


class PreparedImages(NamedTuple):
    """The two splits of a prepared folder and its class names."""

    train_pixels: ShardedImages
    train_labels: np.ndarray
    validation_pixels: ShardedImages
    validation_labels: np.ndarray
    classes: list[str]


def read_prepared(folder: Path, model: ViTConfig, field: str = DATA_PATH, checksums: bool = False) -> PreparedImages:
    """Both splits of a prepared folder, as memory-mapped shards, and its classes; verified and checked first."""
    manifest = read_manifest(folder, field)
    check_fits(manifest, model, folder, field)
    verify(folder, manifest, checksums=checksums, field=field)  # sizes; every byte with data.verify: full
    shape = (manifest["image_size"], manifest["image_size"], manifest["channels"])
    train, validation = (_open_split(folder, manifest["shards"][split], shape) for split in SPLITS)
    return PreparedImages(*train, *validation, classes=list(manifest["classes"]))


def _open_split(folder: Path, shards: list[dict[str, Any]], shape: tuple[int, ...]) -> tuple[ShardedImages, np.ndarray]:
    """One split's pixels (memory maps) and labels (read: 8 bytes an image)."""
    pixels = [np.memmap(folder / s["file"], dtype=np.uint8, mode="r", shape=(s["images"], *shape)) for s in shards]
    labels = [np.fromfile(folder / s["labels"], dtype=LABEL_DTYPE).astype(np.int64) for s in shards]
    return ShardedImages(pixels, shape), np.concatenate(labels) if labels else np.empty(0, dtype=np.int64)


def digits_splits(val_fraction: float) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """(train pixels, labels), (validation pixels, labels) of scikit-learn's digits: uint8 (N, 8, 8, 1), 0..255.

    The held-out images are `val_fraction` of each digit, drawn with a fixed seed (not train.seed), so
    every run holds out the same images.
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * 255 / 16).astype(np.uint8)[..., None]  # values 0..16 -> 0..255
    labels = digits.target.astype(np.int64)
    held_out = stratified_holdout(labels, val_fraction, DIGITS_SPLIT_SEED)
    return (pixels[~held_out], labels[~held_out]), (pixels[held_out], labels[held_out])


def load_splits(data: ImageDataConfig, model: ViTConfig, seed: int) -> tuple[Images, Images]:
    """(training, validation) images of the recipe's data; refuses data the model cannot train on.

    Training images are augmented as data.crop_padding and data.flip say, drawn from `seed`; validation
    images are not.
    """
    check_data(data, model)
    splits: tuple[tuple[Any, np.ndarray], ...]  # (pixels, labels) of training and validation
    if data.source == "digits":
        splits, where = digits_splits(data.val_fraction), "data.source=digits"
    else:
        prepared = read_prepared(Path(data.path or ""), model, checksums=hashed_here(data.verify))
        splits = (
            (prepared.train_pixels, prepared.train_labels),
            (prepared.validation_pixels, prepared.validation_labels),
        )
        where = f"data.path={data.path!r}"
    for split, (_, labels) in zip(("training", "validation"), splits, strict=True):
        if not len(labels):
            raise RecipeError(f"{where}: the {split} split has no images (use more images or change the split)")
        if (largest := int(labels.max())) >= model.num_classes:
            raise RecipeError(
                f"{where} holds label {largest}, beyond model.num_classes={model.num_classes}"
                f" (set model.num_classes >= {largest + 1})"
            )
    (train_pixels, train_labels), (val_pixels, val_labels) = splits
    train = Images(train_pixels, train_labels, data.crop_padding, data.flip, seed)
    return train, Images(val_pixels, val_labels)
