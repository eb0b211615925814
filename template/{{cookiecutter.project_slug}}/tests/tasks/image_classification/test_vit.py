"""The ViT on CPU, fp32, tiny shapes: its Hugging Face layout loads in transformers' ViTForImageClassification with the
same logits, the export writes such a folder, a meta-device build materialises, and a wrong image size is refused."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from {{ cookiecutter.package_name }}.checkpoint.tensors import DEFAULT_SHARD_BYTES, write_safetensors
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import dump_recipe
from {{ cookiecutter.package_name }}.tasks.image_classification.config import ImageClassificationRecipe, ViTConfig
from {{ cookiecutter.package_name }}.tasks.image_classification.data import normalise
from {{ cookiecutter.package_name }}.tasks.image_classification.export import export_hf
from {{ cookiecutter.package_name }}.tasks.image_classification.hf import (
    CONFIG,
    PREPROCESSOR_CONFIG,
    hf_config,
    hf_tensors,
    preprocessor_config,
)
from {{ cookiecutter.package_name }}.tasks.image_classification.model import ViT

DIGITS = ViTConfig()  # the defaults: 8x8 grey images, 10 classes
RGB = ViTConfig(channels=3, image_size=16, patch_size=4)
CONFIGS = pytest.mark.parametrize("config", [DIGITS, RGB], ids=["digits", "rgb-16px"])


@pytest.fixture
def transformers() -> ModuleType:
    return pytest.importorskip("transformers")  # a test dependency (Python 3.11+)


def labels(config: ViTConfig) -> list[str]:
    return [str(index) for index in range(config.num_classes)]


def random_images(config: ViTConfig, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, config.channels, config.image_size, config.image_size)


def logits(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model(images)
    return getattr(output, "logits", output)


def save_checkpoint(model: ViT, folder: Path) -> Path:
    """A checkpoint folder as a one-process run writes it (whole state, config.yaml, meta.json)."""
    folder.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "step": 1}, folder / "state")
    recipe = ImageClassificationRecipe(task="image_classification", model=model.config)
    (folder / "config.yaml").write_text(dump_recipe(recipe))
    (folder / "meta.json").write_text(json.dumps({"step": 1, "strategy": "ddp", "world_size": 1}))
    return folder


@CONFIGS
def test_the_hf_layout_names_every_parameter_once_with_its_shape(config: ViTConfig) -> None:
    state = ViT(config).state_dict()
    tensors = hf_tensors(config)
    assert sorted(tensor.source for tensor in tensors.values()) == sorted(state)
    for tensor in tensors.values():
        assert tuple(state[tensor.source].shape) == tensor.shape, tensor.source


@CONFIGS
def test_the_hf_layout_loads_in_transformers_with_the_same_logits(
    tmp_path: Path, transformers: ModuleType, config: ViTConfig
) -> None:
    torch.manual_seed(0)
    model = ViT(config).eval()
    state = model.state_dict()
    weights = ((name, state[tensor.source]) for name, tensor in hf_tensors(config).items())
    write_safetensors(weights, tmp_path, DEFAULT_SHARD_BYTES)
    (tmp_path / CONFIG).write_text(json.dumps(hf_config(config, "float32", labels(config))))
    reference = transformers.ViTForImageClassification.from_pretrained(tmp_path).eval()
    images = random_images(config)
    torch.testing.assert_close(logits(model, images), logits(reference, images), atol=1e-5, rtol=0)


def test_export_writes_a_folder_transformers_loads_with_the_same_logits_and_class_names(
    tmp_path: Path, transformers: ModuleType
) -> None:
    torch.manual_seed(0)
    model = ViT(DIGITS).eval()
    checkpoint = save_checkpoint(model, tmp_path / "step-1")
    names = [f"digit {index}" for index in range(DIGITS.num_classes)]
    summary = export_hf(checkpoint, tmp_path / "hf", max_shard_bytes=200_000, labels=names)
    assert summary["architecture"] == "ViTForImageClassification" and summary["dtype"] == "float32"
    assert summary["files"] > 1  # the 200 kB limit splits the weights, with an index
    assert summary["tensors"] == len(hf_tensors(DIGITS)) and not (tmp_path / "hf.partial").exists()
    reference = transformers.ViTForImageClassification.from_pretrained(tmp_path / "hf").eval()
    assert [reference.config.id2label[index] for index in range(DIGITS.num_classes)] == names
    images = random_images(DIGITS)
    torch.testing.assert_close(logits(model, images), logits(reference, images), atol=1e-5, rtol=0)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path / "hf")  # its settings: the test below
    expected = preprocessor_config(DIGITS)
    assert (list(processor.image_mean), list(processor.image_std)) == (expected["image_mean"], expected["image_std"])
    assert processor.size == expected["size"] and processor.rescale_factor == expected["rescale_factor"]


def test_export_refuses_a_folder_that_is_not_empty_and_class_names_that_do_not_fit(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(ViT(DIGITS), tmp_path / "step-1")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("")
    with pytest.raises(RecipeError, match="not empty"):
        export_hf(checkpoint, tmp_path / "taken", DEFAULT_SHARD_BYTES, labels(DIGITS))
    with pytest.raises(RecipeError, match=r"model\.num_classes=10"):
        export_hf(checkpoint, tmp_path / "hf", DEFAULT_SHARD_BYTES, labels(DIGITS)[:9])
    with pytest.raises(RecipeError, match="distinct"):
        export_hf(checkpoint, tmp_path / "hf", DEFAULT_SHARD_BYTES, ["same"] * 10)
    assert not (tmp_path / "hf").exists()


@CONFIGS
def test_the_exported_image_processor_normalises_pixels_as_training_does(
    tmp_path: Path, transformers: ModuleType, config: ViTConfig
) -> None:
    pytest.importorskip("PIL")  # the image processor's backend without torchvision
    (tmp_path / PREPROCESSOR_CONFIG).write_text(json.dumps(preprocessor_config(config)))
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path)  # what a user of the export calls
    shape = (config.image_size, config.image_size, config.channels)
    pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)  # one image, channels last
    processed = processor(images=pixels, return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(processed, normalise(pixels[None]), atol=1e-6, rtol=0)


@CONFIGS
def test_a_meta_device_build_materialises_with_every_parameter_initialised(config: ViTConfig) -> None:
    with torch.device("meta"):
        model = ViT(config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))  # so a parameter the init skips stays visible
        for name, param in model.named_parameters():
            model.init_parameter(name, param)
    shapes = {name: param.shape for name, param in ViT(config).named_parameters()}
    assert {name: param.shape for name, param in model.named_parameters()} == shapes
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name
    assert model.blocks[0].norm_attn.weight.eq(1).all() and model.blocks[0].attn.q.bias.eq(0).all()
    assert 0.01 < model.blocks[0].mlp.fc.weight.std() < 0.03
    assert logits(model, random_images(config)).shape == (3, config.num_classes)


@pytest.mark.parametrize(
    "shape", [(2, 3, 8, 8), (2, 1, 16, 16), (2, 1, 8, 6), (1, 8, 8)], ids=["channels", "size", "not-square", "no-batch"]
)
def test_images_of_the_wrong_shape_are_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=r"the model takes \(batch, 1, 8, 8\)"):
        ViT(DIGITS)(torch.zeros(shape))
