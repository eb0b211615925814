"""`predict`: the classes a trained checkpoint gives image files, to see what the model learned.

The model is built from the checkpoint's own config.yaml and loaded from its full state (sharded or
not); each image is decoded and resized as `prepare` does it and normalised as training saw it. The
command is commands/predict.py; the checkpoint argument is read by checkpoint/layout.py's `resolve_checkpoint`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...checkpoint.layout import resolve_checkpoint
from ...checkpoint.tensors import load_model
from ...errors import RecipeError
from .data import normalise
from .prepare import class_names, decode_image


def predict(checkpoint: str, images: list[str], top: int = 3) -> list[tuple[str, list[tuple[str, float]]]]:
    """(image, [(class name, probability)] most likely first) for each image file."""
    if top < 1:
        raise RecipeError(f"--top={top} must be >= 1")
    path = resolve_checkpoint(checkpoint)
    for image in images:
        if not Path(image).is_file():
            raise RecipeError(f"image {image} does not exist")
    model, recipe = load_model(path)
    labels = class_names(recipe.data)
    size, channels = recipe.model.image_size, recipe.model.channels
    pixels = np.stack([decode_image(image, size, channels) for image in images])
    with torch.no_grad():
        probabilities = torch.softmax(model(normalise(pixels)), dim=-1)
    best = probabilities.topk(min(top, probabilities.shape[-1]), dim=-1)
    return [
        (
            image,
            [
                (labels[index] if index < len(labels) else str(index), float(p))
                for p, index in zip(values.tolist(), indices.tolist(), strict=True)
            ],
        )
        for image, values, indices in zip(images, best.values, best.indices, strict=True)
    ]
