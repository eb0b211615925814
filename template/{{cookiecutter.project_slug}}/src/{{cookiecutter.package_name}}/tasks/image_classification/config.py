"""The image classifier's recipe sections: `model:` (a Vision Transformer) and `data:` (labelled images).

`ImageClassificationRecipe` is the Recipe of `task: image_classification`. No torch import.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ...recipe.bounds import bounds
from ...recipe.schema import Recipe, field_path


@dataclass
class ViTConfig:
    """A Vision Transformer (ViT); the defaults make a tiny model that learns the 8x8 digits on a laptop CPU.

    Args:
        image_size: Height and width of the (square) input images, in pixels.
        patch_size: Height and width of one patch; must divide image_size. A patch is one token.
        channels: Colour channels of the input (1: grey, 3: RGB).
        num_classes: Number of classes the head predicts.
        n_layer: Number of transformer blocks.
        n_head: Attention heads per block; must divide n_embd.
        n_embd: Width of the residual stream.
        mlp_ratio: Hidden width of the MLP as a multiple of n_embd.
        dropout: Dropout probability after the embeddings and in the MLP.
        norm_eps: Epsilon of the LayerNorm layers.
    """

    image_size: int = field(default=8, metadata=bounds(at_least=1))
    patch_size: int = field(default=2, metadata=bounds(at_least=1))
    channels: int = field(default=1, metadata=bounds(at_least=1))
    num_classes: int = field(default=10, metadata=bounds(at_least=2))
    n_layer: int = field(default=4, metadata=bounds(at_least=1))
    n_head: int = field(default=4, metadata=bounds(at_least=1))
    n_embd: int = field(default=64, metadata=bounds(at_least=1))
    mlp_ratio: int = field(default=4, metadata=bounds(at_least=1))
    dropout: float = field(default=0.0, metadata=bounds(at_least=0, below=1))
    norm_eps: float = field(default=1e-6, metadata=bounds(above=0))

    @property
    def num_patches(self) -> int:
        """Patches (tokens besides the class token) of one image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def sequence_length(self) -> int:
        """Tokens a block sees per image: the patches and the class token."""
        return self.num_patches + 1

    @property
    def mlp_hidden_size(self) -> int:
        return self.mlp_ratio * self.n_embd

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        """Sizes that tensor parallel splits evenly over its ranks (attention heads and widths)."""
        return {"n_head": self.n_head, "n_embd": self.n_embd}


@dataclass
class ImageDataConfig:
    """Where the images come from, and how training images are augmented.

    Args:
        source: digits (scikit-learn's bundled handwritten digits: 1,797 8x8 grey images of 10
            classes, offline) or prepared (a folder written by `prepare` from an image folder: uint8
            shards at model.image_size, labels, manifest).
        path: The prepared folder; unused for digits.
        val_fraction: Share of the digits held out for validation (a prepared folder brings its own split).
        crop_padding: Training images are padded by this many pixels on each side (edge pixels
            repeated) and cropped back at a random offset; 0: no crop.
        flip: Flip training images left-right at random (off for digits and text, whose mirror image
            is another class or none).
        verify: What a run checks of a prepared folder before its first step: sizes (the manifest
            and every file's size) or full (also every byte against its SHA-256, on local rank 0 of
            each node). `data verify PATH` does the full check once, with a progress bar.

    The random crop and flip of a training sample are drawn from (train.seed, its position in the
    run's sample stream): a pure function of the samples seen, so a resumed run sees the same pixels.
    """

    source: Literal["digits", "prepared"] = "digits"
    path: str | None = None
    val_fraction: float = field(default=0.1, metadata=bounds(above=0, below=1))
    crop_padding: int = 0
    flip: bool = False
    verify: Literal["sizes", "full"] = "sizes"


@dataclass
class ImageClassificationRecipe(Recipe):
    """A recipe of `task: image_classification`: the machinery's sections plus this task's model and data."""

    model: ViTConfig = field(default_factory=ViTConfig)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)


# How messages about the prepared folder name its field.
DATA_PATH = field_path(ImageDataConfig, "path")
