"""`task: image_classification`: a Vision Transformer (model.py) that classifies images.

A sample is one image and its label; the loss is the cross entropy of the class logits; validation
reports the loss and top-1 accuracy; throughput counts images. Its data are scikit-learn's bundled
handwritten digits or a folder `prepare` made from an image folder (one subfolder per class). Its other
commands: `prepare` (image folder -> uint8 shards), `predict` (the top classes of image files) and
`export` (to transformers' ViTForImageClassification).
Importing this module does not import torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...errors import RecipeError
from ...recipe.schema import field_path
from ..base import ModelCost, Splits, Task
from .config import DATA_PATH, ImageClassificationRecipe, ImageDataConfig, ViTConfig
from .prepare import check_data, describe_prepared  # numpy, no torch

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchmetrics import Metric

# Model fields a resumed run may change: they do not change the shapes of the saved tensors.
RESUMABLE_MODEL_CHANGES = frozenset({"dropout"})


class ImageClassification(Task):
    """A ViT trained on labelled images."""

    name = "image_classification"
    recipe_type = ImageClassificationRecipe
    unit = "image"
    commands: ClassVar[dict[str, str]] = {
        "prepare": f"{__package__}.commands.prepare",
        "predict": f"{__package__}.commands.predict",
        "export": f"{__package__}.commands.export",
    }
    # What reads its images and exports the model: their versions are in every checkpoint.
    key_packages = ("numpy", "pillow", "safetensors", "transformers")
    recipe: ImageClassificationRecipe

    @classmethod
    def verify_prepared(cls, folder: Path | str) -> str:
        from .prepare import describe_folder, read_manifest, verify

        if isinstance(folder, str):
            raise RecipeError(f"PATH={folder!r}: an image folder is verified where it is stored (a local path)")
        verify(folder, read_manifest(folder, "PATH"), checksums=True, field="PATH")
        return describe_folder(folder)

    def check(self) -> None:
        model, data = self.recipe.model, self.recipe.data
        if model.image_size % model.patch_size:
            raise RecipeError(
                f"model.patch_size={model.patch_size} does not divide model.image_size={model.image_size}"
            )
        if model.n_embd % model.n_head:
            raise RecipeError(f"model.n_head={model.n_head} does not divide model.n_embd={model.n_embd}")
        check_data(data, model)

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        model = self.recipe.model
        return {field_path(model, key): size for key, size in model.tensor_parallel_dimensions().items()}

    def model_cost(self) -> ModelCost:
        from .sizing import ViTShape

        return ViTShape(self.recipe.model)

    def reference_model(self, parameters: float) -> dict[str, Any]:
        from .sizing import reference_model

        # A reference ViT takes 224x224 RGB images: planned as trained on a prepared folder (plan reads no data).
        fields = {field_path(ViTConfig, key): value for key, value in reference_model(parameters).items()}
        return {**fields, field_path(ImageDataConfig, "source"): "prepared", DATA_PATH: "data/prepared"}

    def describe(self) -> str | None:
        if self.recipe.data.source != "prepared":
            return None
        return describe_prepared(self.recipe.data, self.recipe.model)

    def resumable_model_changes(self) -> frozenset[str]:
        return RESUMABLE_MODEL_CHANGES

    def build_model(self) -> nn.Module:
        from .model import ViT

        return ViT(self.recipe.model)

    def datasets(self) -> Splits:
        from .data import load_splits

        train, validation = load_splits(self.recipe.data, self.recipe.model, self.recipe.train.seed)
        return Splits(train, validation)

    def example_batch(self, micro_batch_size: int) -> Any:
        """Normalised images of the model's size and class labels."""
        import torch

        model = self.recipe.model
        images = torch.zeros(micro_batch_size, model.channels, model.image_size, model.image_size)
        return images, torch.zeros(micro_batch_size, dtype=torch.long)

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.cross_entropy(outputs, targets)

    def metrics(self) -> dict[str, Metric]:
        from torchmetrics.aggregation import MeanMetric
        from torchmetrics.classification import MulticlassAccuracy

        return {"loss": MeanMetric(), "accuracy": MulticlassAccuracy(self.recipe.model.num_classes, average="micro")}

    def update_metrics(self, outputs: torch.Tensor, targets: torch.Tensor, metrics: dict[str, Metric]) -> None:
        metrics["loss"].update(self.loss(outputs, targets), weight=targets.numel())
        metrics["accuracy"].update(outputs, targets)  # top-1

    def flops_per_unit(self) -> float:
        return self.model_cost().training_flops_per_sample()
