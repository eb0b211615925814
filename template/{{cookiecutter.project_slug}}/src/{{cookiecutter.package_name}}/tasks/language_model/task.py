"""`task: language_model`: next-token prediction with a decoder-only transformer (families/: gpt, llama).

A sample is a window of model.block_size tokens cut from the data's token stream; the loss is the
cross entropy of each next token; throughput counts tokens. Its other commands: `prepare` (text ->
token shards), `sample` (continue a prompt) and `export` (to transformers).
Importing this module does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.base import ModelCost, Splits, Task
from {{ cookiecutter.package_name }}.tasks.language_model.config import ARCH_ONLY_FIELDS, LanguageModelRecipe, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torchmetrics import Metric

# Model fields a resumed run may change: they do not change the shapes of the saved tensors.
RESUMABLE_MODEL_CHANGES = frozenset({"dropout", "init_from"})


class LanguageModel(Task):
    """A GPT- or Llama-style decoder trained on token windows."""

    name = "language_model"
    recipe_type = LanguageModelRecipe
    unit = "token"
    commands: ClassVar[dict[str, str]] = {
        "prepare": "{{ cookiecutter.package_name }}.tasks.language_model.commands.prepare",
        "sample": "{{ cookiecutter.package_name }}.tasks.language_model.commands.sample",
        "export": "{{ cookiecutter.package_name }}.tasks.language_model.commands.export",
    }
    # The weights init_from named are in a checkpoint now; the folder they came from may be gone.
    saved_recipe_overrides = ("--model.init_from", "null")
    recipe: LanguageModelRecipe

    @classmethod
    def verify_prepared(cls, folder: Path) -> str:
        from {{ cookiecutter.package_name }}.tasks.language_model.data.prepared import describe_folder, read_manifest, verify

        verify(folder, read_manifest(folder, "PATH"), checksums=True, field="PATH")
        return describe_folder(folder)

    def check(self) -> None:
        model, data = self.recipe.model, self.recipe.data
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "mlp_ratio"):
            if (value := getattr(model, key)) < 1:
                raise RecipeError(f"model.{key}={value} must be >= 1")
        if not 0 <= model.dropout < 1:
            raise RecipeError(f"model.dropout={model.dropout} must be in [0, 1)")
        if model.n_embd % model.n_head:
            raise RecipeError(f"model.n_head={model.n_head} does not divide model.n_embd={model.n_embd}")
        if not 0 < data.val_fraction < 1:
            raise RecipeError(f"data.val_fraction={data.val_fraction} must be in (0, 1)")
        if data.shuffle_blocks < 1:
            raise RecipeError(f"data.shuffle_blocks={data.shuffle_blocks} must be >= 1")
        if not data.cache_gb > 0:
            raise RecipeError(f"data.cache_gb={data.cache_gb} must be > 0")
        if data.source != "embedded" and not data.path:
            raise RecipeError(f"data.path is required when data.source={data.source}")
        if data.source in ("embedded", "text") and model.vocab_size < 256:
            raise RecipeError(
                f"model.vocab_size={model.vocab_size} is too small for data.source={data.source}"
                " (byte-level tokens need 256)"
            )
        check_model(model)

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        return {f"model.{key}": size for key, size in self.recipe.model.tensor_parallel_dimensions().items()}

    def units_per_sample(self) -> int:
        return self.recipe.model.block_size

    def model_cost(self) -> ModelCost:
        from {{ cookiecutter.package_name }}.tasks.language_model.sizing import model_shape

        return model_shape(self.recipe.model)

    def reference_model(self, parameters: float) -> dict[str, Any]:
        from {{ cookiecutter.package_name }}.tasks.language_model.sizing import reference_model

        return {f"model.{key}": value for key, value in reference_model(parameters).items()}

    def describe(self) -> str | None:
        if self.recipe.data.source != "prepared":
            return None
        from {{ cookiecutter.package_name }}.tasks.language_model.data.sources import describe_prepared  # numpy only

        return describe_prepared(self.recipe.data, self.recipe.model)

    def resumable_model_changes(self) -> frozenset[str]:
        return RESUMABLE_MODEL_CHANGES

    def build_model(self) -> nn.Module:
        from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model

        return build_model(self.recipe.model)

    def pretrained_from(self) -> str | None:
        return self.recipe.model.init_from

    def pretrained_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from {{ cookiecutter.package_name }}.tasks.language_model.hf import pretrained_tensors

        return pretrained_tensors(self.recipe.model)

    def datasets(self) -> Splits:
        from {{ cookiecutter.package_name }}.tasks.language_model.data import load_splits
        from {{ cookiecutter.package_name }}.tasks.language_model.data.windows import TokenWindows

        train, validation = load_splits(self.recipe.data, self.recipe.model)
        block_size = self.recipe.model.block_size
        # Prepared shards are read in the shard-block order (data/sampler.py); the other sources keep a full shuffle.
        blocks = self.recipe.data.shuffle_blocks if self.recipe.data.source == "prepared" else None
        return Splits(TokenWindows(train, block_size, blocks), TokenWindows(validation, block_size))

    def loss(self, model: Any, batch: Any) -> torch.Tensor:
        inputs, targets = batch
        return self.output_loss(model(inputs), targets)

    def pipeline_blocks(self) -> int:
        if self.recipe.model.arch == "llama" and self.recipe.model.tie_embeddings:
            raise RecipeError(
                "model.tie_embeddings=true shares the embedding with the head, which pipeline stages hold apart"
                " (set it false, or strategy.fsdp2.pipeline_parallel_size=1)"
            )
        return self.recipe.model.n_layer

    def pipeline_batch(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        return inputs, targets

    def output_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())

    def validation_metrics(self) -> dict[str, Metric]:
        from torchmetrics.aggregation import MeanMetric

        return {"loss": MeanMetric()}

    def validation_step(self, model: Any, batch: Any, metrics: dict[str, Metric]) -> None:
        _, targets = batch
        metrics["loss"].update(self.loss(model, batch), weight=targets.numel())  # the mean over every token

    def validation_results(self, computed: dict[str, float]) -> dict[str, float]:
        import math

        return {**computed, "perplexity": math.exp(computed["loss"])}

    def flops_per_unit(self) -> float:
        from {{ cookiecutter.package_name }}.tasks.language_model.families import training_flops_per_token

        return float(training_flops_per_token(self.recipe.model))


def check_model(model: ModelConfig) -> None:
    """Fields of the other model family left at their defaults; grouped-query heads and RoPE widths that fit;
    an init_from folder that matches the model (its config.json and tensor shapes, read without torch)."""
    defaults = ModelConfig()
    for name, arch in ARCH_ONLY_FIELDS.items():
        if arch != model.arch and getattr(model, name) != getattr(defaults, name):
            raise RecipeError(
                f"model.{name} applies only to model.arch={arch} (this recipe has {model.arch}; remove the key"
                f" or set it to its default, {str(getattr(defaults, name)).lower()})"
            )
    if model.arch != "llama":
        return
    if model.n_kv_head < 0 or model.intermediate_size < 0:
        raise RecipeError("model.n_kv_head and model.intermediate_size must be >= 0 (0: the default rule)")
    if model.n_head % model.kv_heads:
        raise RecipeError(
            f"model.n_kv_head={model.n_kv_head} does not divide model.n_head={model.n_head}"
            " (each key/value head serves an equal group of query heads)"
        )
    if (model.n_embd // model.n_head) % 2:
        raise RecipeError(
            f"model.n_embd / model.n_head = {model.n_embd // model.n_head} must be even (RoPE rotates pairs)"
        )
    if not model.rope_theta > 0 or not model.norm_eps > 0:
        raise RecipeError("model.rope_theta and model.norm_eps must be > 0")
    if model.init_from is not None:
        from {{ cookiecutter.package_name }}.tasks.language_model.hf import check_init_from  # reads JSON only: no torch

        check_init_from(model)
