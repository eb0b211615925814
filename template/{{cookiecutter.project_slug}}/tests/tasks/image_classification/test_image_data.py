"""The image classifier's data: the digits split, exactly resumable augmentation, and `prepare` from an image folder
to shards that train reads back, byte-identically whatever the number of workers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import run_cli
from PIL import Image

from {{ cookiecutter.package_name }}.data.sampler import TrainBatches
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.image_classification.config import ImageDataConfig, ViTConfig
from {{ cookiecutter.package_name }}.tasks.image_classification.data import Images, digits_splits, load_splits
from {{ cookiecutter.package_name }}.tasks.image_classification.prepare import (
    class_names,
    decode_image,
    describe_prepared,
    prepare_images,
)

CLASSES = ["cat", "dog", "emu"]
RGB = ViTConfig(image_size=8, patch_size=2, channels=3, num_classes=3)


def digits_data(**changes: object) -> ImageDataConfig:
    return ImageDataConfig(**{"source": "digits", **changes})  # type: ignore[arg-type]


def prepared_data(path: Path) -> ImageDataConfig:
    return ImageDataConfig(source="prepared", path=str(path))


def write_image(path: Path, width: int, height: int, mode: str, seed: int) -> None:
    """A random image of this size and Pillow mode; JPEG or PNG as the suffix says."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    image = Image.fromarray(pixels, "RGB")
    image = image.quantize(16) if mode == "P" else image.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, format="JPEG" if path.suffix.lower() in (".jpg", ".jpeg") else "PNG")


def write_image_folder(folder: Path) -> None:
    """3 classes of PNG and JPEG files of different sizes and modes, a nested one, and a file that is no image."""
    shapes = [(12, 20, "RGB", ".png"), (9, 15, "L", ".jpg"), (30, 10, "RGBA", ".PNG"), (16, 16, "P", ".png")]
    shapes += [(11, 11, "RGB", ".JPEG"), (8, 24, "L", ".jpeg")]
    for label, name in enumerate(CLASSES):
        for number, (width, height, mode, suffix) in enumerate(shapes):
            write_image(folder / name / f"{number:02d}{suffix}", width, height, mode, seed=10 * label + number)
    write_image(folder / "dog" / "more" / "nested.jpg", 14, 9, "RGB", seed=99)
    (folder / "cat" / "notes.txt").write_text("not an image")


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("images") / "input"
    write_image_folder(folder)
    return folder


def prepare(image_folder: Path, out: Path, workers: int = 1) -> dict:
    return prepare_images(
        str(image_folder), str(out), 8, 3, val_fraction=0.25, shard_images=4, workers=workers, progress=False
    )


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, image_folder: Path) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "data"
    prepare(image_folder, out)
    return out


def test_digits_are_8x8_grey_uint8_of_10_classes_split_per_class() -> None:
    (train_pixels, train_labels), (val_pixels, val_labels) = digits_splits(0.1)
    assert train_pixels.shape[1:] == val_pixels.shape[1:] == (8, 8, 1) and train_pixels.dtype == np.uint8
    assert len(train_labels) + len(val_labels) == 1797
    assert train_pixels.max() == 255 and train_pixels.min() == 0
    per_class = np.bincount(np.concatenate([train_labels, val_labels]), minlength=10)
    assert np.array_equal(np.bincount(val_labels, minlength=10), np.round(per_class * 0.1).astype(int))


def test_the_digits_split_does_not_move_with_the_seed() -> None:
    first_train, first_val = load_splits(digits_data(), ViTConfig(), seed=1)
    second_train, second_val = load_splits(digits_data(), ViTConfig(), seed=2)
    assert np.array_equal(first_val.pixels, second_val.pixels) and np.array_equal(first_val.labels, second_val.labels)
    assert np.array_equal(first_train.pixels, second_train.pixels)
    assert first_train.seed == 1 and first_val.crop_padding == 0 and not first_val.flip


def test_a_batch_is_normalised_float_images_channels_first_and_int64_labels() -> None:
    pixels = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    pixels[1] = 255
    pixels[0, :, :, 1] = 51
    images, labels = Images(pixels, np.array([3, 1])).batch([1, 0])
    assert images.shape == (2, 3, 4, 4) and images.dtype == torch.float32 and labels.dtype == torch.int64
    assert labels.tolist() == [1, 3]
    assert torch.all(images[0] == 1.0) and torch.all(images[1, 0] == -1.0)
    assert torch.allclose(images[1, 1], torch.tensor((51 / 255 - 0.5) / 0.5))


def gradient_images(count: int = 8, size: int = 12) -> np.ndarray:
    """Images whose every pixel differs from its neighbours, so any crop or flip shows."""
    values = np.arange(size * size * 3, dtype=np.int64).reshape(size, size, 3) % 251
    return np.stack([(values + 7 * i) % 256 for i in range(count)]).astype(np.uint8)


def test_augmentation_is_a_pure_function_of_seed_and_draw() -> None:
    images = Images(gradient_images(), np.arange(8), crop_padding=2, flip=True, seed=5)
    first, _ = images.augmented_batch([0, 1, 2, 3], [100, 101, 102, 103])
    again, _ = images.augmented_batch([0, 1, 2, 3], [100, 101, 102, 103])
    other_draws, _ = images.augmented_batch([0, 1, 2, 3], [200, 201, 202, 203])
    reseeded = Images(images.pixels, images.labels, crop_padding=2, flip=True, seed=6)
    other_seed, _ = reseeded.augmented_batch([0, 1, 2, 3], [100, 101, 102, 103])
    assert torch.equal(first, again)
    assert not torch.equal(first, other_draws) and not torch.equal(first, other_seed)


def test_a_crop_is_the_edge_padded_image_at_the_drawn_offset_and_a_flip_mirrors_it() -> None:
    pixels = gradient_images()
    images = Images(pixels, np.arange(8), crop_padding=3, flip=True, seed=0)
    draws = list(range(40, 48))
    augmented, _ = images.augmented_batch(list(range(8)), draws)
    changed = 0
    for i, draw in enumerate(draws):
        top, left, flip = images.augmentation(draw)
        expected = np.pad(pixels[i], ((3, 3), (3, 3), (0, 0)), mode="edge")[top : top + 12, left : left + 12]
        expected = expected[:, ::-1] if flip else expected
        assert torch.equal(augmented[i : i + 1], Images(expected[None], np.zeros(1)).batch([0])[0])
        changed += not np.array_equal(expected, pixels[i])
    assert changed >= 6  # 1 in 98 draws is the unshifted, unflipped image
    flips = {images.augmentation(draw)[2] for draw in range(20)}
    assert flips == {True, False}


def test_without_crop_or_flip_training_images_are_the_images() -> None:
    images = Images(gradient_images(), np.arange(8), crop_padding=0, flip=False, seed=0)
    assert torch.equal(images.augmented_batch([3, 4], [7, 8])[0], images.batch([3, 4])[0])


def test_augmented_training_batches_resume_exactly() -> None:
    train = Images(gradient_images(16), np.arange(16), crop_padding=2, flip=True, seed=3)
    straight = TrainBatches(train, micro_batch_size=4, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=3)
    steps = [straight.next_step()[0] for _ in range(6)]  # past one epoch of 16 samples
    resumed = TrainBatches(train, micro_batch_size=4, grad_accum_steps=1, dp_rank=0, dp_size=1, seed=3)
    resumed.load_state_dict({"samples_seen": 12, "seed": 3, "num_samples": 16})
    for expected in steps[3:]:
        images, labels = resumed.next_step()[0]
        assert torch.equal(images, expected[0]) and torch.equal(labels, expected[1])


def test_prepare_writes_every_image_resized_with_the_class_folders_as_labels(
    prepared: Path, image_folder: Path
) -> None:
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["task"] == "image_classification"  # the task `data verify` reads the folder with
    assert manifest["classes"] == CLASSES and class_names(prepared_data(prepared)) == CLASSES
    assert (manifest["image_size"], manifest["channels"], manifest["images"]) == (8, 3, 19)
    assert manifest["sources"]["ignored_files"] == 1  # notes.txt
    counts = manifest["counts"]
    assert np.add(counts["train"], counts["validation"]).tolist() == [6, 7, 6]
    assert manifest["validation"]["images"] == sum(counts["validation"]) == 6  # round(1.5), round(1.75), round(1.5)
    assert len(manifest["shards"]["train"]) == 4  # 13 training images, 4 a shard
    train, validation = load_splits(prepared_data(prepared), RGB, seed=0)
    assert (len(train), len(validation)) == (13, 6)
    assert np.array_equal(np.bincount(train.labels, minlength=3), manifest["counts"]["train"])
    images, labels = train.batch(range(13))
    assert images.shape == (13, 3, 8, 8) and labels.tolist() == sorted(labels.tolist())  # written in input order
    files = [path for path in image_folder.rglob("*") if path.suffix.lower() in (".png", ".jpg", ".jpeg")]
    class_of_image = {decode_image(file, 8, 3).tobytes(): file.relative_to(image_folder).parts[0] for file in files}
    pixels = [*train.pixels[np.arange(13)], *validation.pixels[np.arange(6)]]
    labels_written = [*train.labels, *validation.labels]
    written = {image.tobytes(): CLASSES[label] for image, label in zip(pixels, labels_written, strict=True)}
    assert written == class_of_image and len(written) == 19


def test_an_image_is_resized_by_its_shorter_side_and_centre_cropped(tmp_path: Path) -> None:
    pixels = np.zeros((8, 16), dtype=np.uint8)
    pixels[:, 4:12] = 200  # the centre 8 columns of a 16x8 image
    Image.fromarray(pixels, "L").save(tmp_path / "wide.png")
    assert np.all(decode_image(tmp_path / "wide.png", 8, 1) == 200)
    assert decode_image(tmp_path / "wide.png", 4, 3).shape == (4, 4, 3)


def test_prepare_writes_the_same_bytes_with_one_or_two_workers(
    prepared: Path, image_folder: Path, tmp_path: Path
) -> None:
    prepare(image_folder, tmp_path / "two", workers=2)
    names = sorted(path.name for path in prepared.iterdir())
    assert names == sorted(path.name for path in (tmp_path / "two").iterdir())
    for name in names:
        assert (prepared / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name


@pytest.mark.parametrize("workers", [1, 2])
def test_a_corrupt_image_is_refused_by_name_and_nothing_is_written(
    image_folder: Path, tmp_path: Path, workers: int
) -> None:
    inputs = tmp_path / "input"
    shutil.copytree(image_folder, inputs)
    (inputs / "dog" / "03-broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(RecipeError, match=r"03-broken\.png"):
        prepare(inputs, tmp_path / "out", workers=workers)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_prepare_refuses_an_existing_folder_and_a_folder_of_one_class(image_folder: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    with pytest.raises(RecipeError, match="already exists"):
        prepare(image_folder, tmp_path / "out")
    with pytest.raises(RecipeError, match="1 class subfolder"):
        prepare(image_folder.parent / "input" / "..", tmp_path / "other")  # the folder holding `input` only
    assert not (tmp_path / "other").exists()


def test_a_damaged_or_truncated_shard_is_refused_naming_it(prepared: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged"
    shutil.copytree(prepared, damaged)
    data = bytearray((damaged / "train-00001.bin").read_bytes())
    data[0] ^= 0xFF
    (damaged / "train-00001.bin").write_bytes(bytes(data))
    load_splits(prepared_data(damaged), RGB, seed=0)  # start-up checks sizes only (data.verify: sizes)
    with pytest.raises(RecipeError, match=r"train-00001\.bin does not match its sha256"):
        load_splits(ImageDataConfig(source="prepared", path=str(damaged), verify="full"), RGB, seed=0)
    (damaged / "validation-00000.labels.bin").write_bytes(b"")
    with pytest.raises(RecipeError, match=r"validation-00000\.labels\.bin has 0 bytes"):
        describe_prepared(prepared_data(damaged), RGB)


def test_data_verify_reads_every_byte_and_names_the_damaged_shard(prepared: Path, tmp_path: Path) -> None:
    intact = run_cli("data", "verify", str(prepared))
    assert intact.returncode == 0, intact.stderr
    assert f"{prepared}: every file matches its manifest: " in intact.stdout and "of 3 classes" in intact.stdout
    damaged = tmp_path / "damaged"
    shutil.copytree(prepared, damaged)
    data = bytearray((damaged / "validation-00000.bin").read_bytes())
    data[-1] ^= 0x01
    (damaged / "validation-00000.bin").write_bytes(bytes(data))
    refused = run_cli("data", "verify", str(damaged))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"error: PATH={str(damaged)!r}: validation-00000.bin does not match its sha256")


def test_an_unfinished_prepare_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data.partial").mkdir()
    with pytest.raises(RecipeError, match="unfinished prepare"):
        load_splits(prepared_data(tmp_path / "data"), RGB, seed=0)


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (ViTConfig(image_size=16, channels=3, num_classes=3), "model.image_size=16"),
        (ViTConfig(image_size=8, channels=1, num_classes=3), "model.channels=1"),
        (ViTConfig(image_size=8, channels=3, num_classes=2), "model.num_classes=2"),
    ],
)
def test_a_prepared_folder_the_model_cannot_take_is_refused_naming_the_field(
    prepared: Path, model: ViTConfig, named: str
) -> None:
    with pytest.raises(RecipeError, match=named):
        load_splits(prepared_data(prepared), model, seed=0)
    with pytest.raises(RecipeError, match=named):
        describe_prepared(prepared_data(prepared), model)


@pytest.mark.parametrize(
    ("data", "model", "named"),
    [
        (digits_data(), ViTConfig(image_size=16, patch_size=4), "model.image_size must be 8"),
        (digits_data(), ViTConfig(num_classes=5), "model.num_classes=5"),
        (digits_data(val_fraction=1.0), ViTConfig(), "data.val_fraction=1.0"),
        (ImageDataConfig(source="prepared"), ViTConfig(), "data.path is required"),
    ],
)
def test_data_the_model_cannot_train_on_is_refused_naming_the_field(
    data: ImageDataConfig, model: ViTConfig, named: str
) -> None:
    with pytest.raises(RecipeError, match=named):
        load_splits(data, model, seed=0)


def test_describe_prepared_is_one_line_on_the_folder(prepared: Path, tmp_path: Path) -> None:
    line = describe_prepared(prepared_data(prepared), RGB)
    assert "\n" not in line and "19 images (8x8x3) of 3 classes" in line and "validation 6 images" in line
    assert "not prepared yet" in describe_prepared(prepared_data(tmp_path / "missing"), RGB)


@pytest.mark.parametrize("name", ["../outside.bin", "/etc/passwd", "sub/x.bin", ".."])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(prepared: Path, tmp_path: Path, name: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(prepared, copy)
    (tmp_path / "outside.bin").write_bytes(b"\0" * 64)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["shards"]["train"][0]["file"] = name
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RecipeError, match="not a file in the folder"):
        load_splits(prepared_data(copy), RGB, seed=0)
