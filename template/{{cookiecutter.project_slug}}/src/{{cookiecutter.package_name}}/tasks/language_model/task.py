"""`task: language_model`: next-token prediction with a decoder-only transformer (families/: gpt, llama).

A sample is a window of model.block_size tokens cut from the data's token stream; the loss is the
cross entropy of each next token; throughput counts tokens. Its other commands: `prepare` (text ->
token shards), `sample` (continue a prompt), `export` (to transformers) and `evaluate` (lm-eval tasks).
Importing this module does not import torch.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from ...errors import RecipeError
from ...recipe.schema import field_path
from ..base import Benchmarks, Inputs, ModelCost, Splits, Task
from .config import (
    ARCH_ONLY_FIELDS,
    LanguageModelEvalConfig,
    LanguageModelRecipe,
    ModelConfig,
    MoeConfig,
)
from .lora import check_lora
from .task_folder import check_task_folder

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
        "prepare": f"{__package__}.commands.prepare",
        "sample": f"{__package__}.commands.sample",
        "export": f"{__package__}.commands.export",
        "evaluate": f"{__package__}.commands.evaluate",
    }
    # What reads its data, tokenizes, exports and evaluates: their versions are in every checkpoint.
    key_packages = ("numpy", "tokenizers", "safetensors", "transformers", "peft", "lm-eval")
    recipe: LanguageModelRecipe

    @classmethod
    def saved_recipe_overrides(cls, saved: dict[str, Any]) -> list[str]:
        # The eval.tasks of training are not the checkpoint's: reading it needs neither lm-eval nor their folder.
        # The weights init_from named are in a checkpoint now; the folder they came from may be gone. Not so under
        # LoRA: the checkpoint holds the adapters, init_from the base they adapt.
        overrides = [f"--{field_path(LanguageModelEvalConfig, 'tasks')}", "[]"]
        if (saved.get("lora") or {}).get("rank") and (saved.get("model") or {}).get("init_from"):
            return overrides
        return [f"--{field_path(ModelConfig, 'init_from')}", "null", *overrides]

    @classmethod
    def verify_prepared(cls, folder: Path | str) -> str:
        from .data.prepared import describe_folder, read_manifest, verify, verify_url

        if isinstance(folder, str):  # a URL
            return verify_url(folder, field="PATH")
        verify(folder, read_manifest(folder, "PATH"), checksums=True, field="PATH")
        return describe_folder(folder)

    def check(self) -> None:
        model, data = self.recipe.model, self.recipe.data
        if model.n_embd % model.n_head:
            raise RecipeError(f"model.n_head={model.n_head} does not divide model.n_embd={model.n_embd}")
        if data.source != "embedded" and not data.path:
            raise RecipeError(f"data.path is required when data.source={data.source}")
        if data.format == "sft" and data.source not in ("embedded", "prepared"):
            raise RecipeError(
                f"data.format=sft reads chat examples: data.source must be prepared (prepare --format sft) or"
                f" embedded (the demo conversations), not {data.source}"
            )
        if data.format != "sft" and not data.packing:
            raise RecipeError("data.packing=false applies to data.format=sft only (remove it)")
        if data.document_mask and data.format != "stream":
            raise RecipeError(
                f"data.document_mask=true applies to data.format=stream (data.format={data.format} keeps its"
                " examples apart already: remove it)"
            )
        if data.document_mask and data.source == "tokens":
            raise RecipeError(
                "data.document_mask=true needs an end-of-document token: data.source=tokens names none (use"
                " data.source=prepared, whose manifest states it, or set data.document_mask=false)"
            )
        if data.source in ("embedded", "text") and model.vocab_size < 256:
            raise RecipeError(
                f"model.vocab_size={model.vocab_size} is too small for data.source={data.source}"
                " (byte-level tokens need 256)"
            )
        check_model(model)
        check_eval_tasks(self.recipe.eval)
        check_lora(self.recipe)
        if self.recipe.lora.rank and model.moe.num_experts:
            raise RecipeError(
                f"lora.rank={self.recipe.lora.rank} adapts dense projections: a mixture of experts"
                f" (model.moe.num_experts={model.moe.num_experts}) has none to adapt (set lora.rank=0)"
            )

    def tensor_parallel_dimensions(self) -> dict[str, int]:
        model = self.recipe.model
        dimensions = {field_path(model, key): size for key, size in model.tensor_parallel_dimensions().items()}
        if model.moe.shared_experts:  # split as a dense MLP; the routed experts share out the tokens instead
            dimensions[field_path(model.moe, "expert_intermediate_size")] = model.expert_hidden_size
        return dimensions

    def expert_parallel_dimensions(self) -> dict[str, int]:
        moe = self.recipe.model.moe
        return {field_path(moe, "num_experts"): moe.num_experts} if moe.num_experts else {}

    def adapters(self) -> str | None:
        return f"lora.rank={self.recipe.lora.rank}" if self.recipe.lora.rank else None

    def checkpointed_parameters(self) -> int | None:
        if not self.frozen_from_pretrained():
            return None
        from .lora import adapter_parameters

        return adapter_parameters(self.recipe)

    def units_per_sample(self) -> int:
        return self.recipe.model.block_size

    def model_cost(self) -> ModelCost:
        import dataclasses

        from .sizing import model_shape

        data = self.recipe.data
        documents = (data.format == "sft" and data.packing) or data.document_mask
        return dataclasses.replace(model_shape(self.recipe.model), document_ids=documents)

    def trained_parameters(self) -> int | None:
        from .lora import adapter_parameters

        return adapter_parameters(self.recipe) if self.recipe.lora.rank else None

    def reference_model(self, parameters: float) -> dict[str, Any]:
        from .sizing import reference_model

        return {field_path(ModelConfig, key): value for key, value in reference_model(parameters).items()}

    def describe(self) -> str | None:
        if self.recipe.data.source != "prepared":
            return None
        from .data.sources import describe_prepared  # numpy only

        return describe_prepared(self.recipe.data, self.recipe.model)

    def resumable_model_changes(self) -> frozenset[str]:
        return RESUMABLE_MODEL_CHANGES

    def build_model(self) -> nn.Module:
        from .families import build_model

        model = build_model(self.recipe.model)
        if self.recipe.lora.rank:  # adapters in, base frozen: before any strategy wraps the model
            from .lora import inject_adapters

            model = inject_adapters(model, self.recipe.lora, self.recipe.lora.targets(self.recipe.model.arch))
        return model

    def pretrained_from(self) -> str | None:
        return self.recipe.model.init_from

    def pretrained_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        from .hf import pretrained_tensors

        tensors = pretrained_tensors(self.recipe.model)
        if not self.recipe.lora.rank:
            return tensors
        from .lora import adapted_name

        targets = self.recipe.lora.targets(self.recipe.model.arch)
        return ((adapted_name(name, targets), tensor) for name, tensor in tensors)

    def frozen_from_pretrained(self) -> bool:
        return self.recipe.lora.rank > 0 and self.recipe.model.init_from is not None

    def datasets(self) -> Splits:
        from .data import load_splits
        from .data.sources import document_end
        from .data.windows import TokenWindows

        data = self.recipe.data
        if data.format == "sft":
            return self._example_datasets()
        train, validation = load_splits(data, self.recipe.model)
        block_size = self.recipe.model.block_size
        # Prepared shards are read in the shard-block order (data/sampler.py); the other sources keep a full shuffle.
        blocks = data.shuffle_blocks if data.source == "prepared" else None
        end = document_end(data) if data.document_mask else None
        return Splits(TokenWindows(train, block_size, blocks, end), TokenWindows(validation, block_size, None, end))

    def _example_datasets(self) -> Splits:
        """data.format=sft: chat examples in sequences of block_size, packed or one a sequence (data/sft.py)."""
        from .data.sft import ExampleSequences
        from .data.sources import load_example_splits

        data, block_size = self.recipe.data, self.recipe.model.block_size
        train, validation = load_example_splits(data, self.recipe.model)
        splits = Splits(
            ExampleSequences(train, block_size, data.packing), ExampleSequences(validation, block_size, data.packing)
        )
        for name, part in (("training", splits.train), ("validation", splits.validation)):
            if len(part) == 0:
                raise RecipeError(f"data: the {name} split of data.path={data.path!r} holds no example")
        return splits

    def example_batch(self, micro_batch_size: int) -> Any:
        """Token ids and next-token targets of `block_size`, with each position's example (document) id when sft packs
        them or data.document_mask is set."""
        import torch

        shape, vocab = (micro_batch_size, self.recipe.model.block_size), self.recipe.model.vocab_size
        tokens, targets = torch.randint(0, vocab, shape), torch.randint(0, vocab, shape)
        data = self.recipe.data
        if (data.format == "sft" and data.packing) or data.document_mask:
            return tokens, targets, torch.zeros(shape, dtype=torch.long)
        return tokens, targets

    def split_batch(self, batch: Any) -> tuple[Inputs, torch.Tensor]:
        """A stream batch is (inputs, targets). An sft batch adds, when packed, each position's example id, and a
        stream's under data.document_mask its document id: the model is called with it (`model(inputs, documents)`)
        and attends within an example."""
        inputs, targets, *documents = batch
        return ((inputs, documents[0]) if documents else inputs), targets

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of the next token over the targets that count.

        A stream's targets all count. An sft batch's targets are IGNORE_INDEX outside the replies, and a micro-batch
        without a counted target has loss 0 (not 0 / 0). Under context parallel the replies fall unevenly on the
        parts of a sequence: a rank's sum is divided by the count over its group, times the group's size, so the
        group's mean of its losses (and of their gradients) is the whole sequences' mean.
        """
        from ...strategies.context_parallel import active

        shard = active()
        if self.recipe.data.format != "sft" or shard is None:
            return self.part_loss(outputs, targets)
        return summed_loss(outputs, targets) * shard.size / shard.total(counted_targets(targets)).clamp(min=1)

    def part_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy over the counted targets of these outputs alone (a rank's part under context
        parallel)."""
        import torch.nn.functional as F

        if self.recipe.data.format != "sft":
            return F.cross_entropy(outputs.flatten(0, 1), targets.flatten())
        return summed_loss(outputs, targets) / counted_targets(targets).clamp(min=1)

    def pipeline_blocks(self) -> int:
        recipe = self.recipe
        unsupported = {
            "data.format=sft": recipe.data.format == "sft",
            "data.document_mask=true": recipe.data.document_mask,
            f"lora.rank={recipe.lora.rank}": bool(recipe.lora.rank),
            f"eval.tasks={recipe.eval.tasks}": bool(recipe.eval.tasks),
        }
        if fields := [field for field, applies in unsupported.items() if applies]:
            raise RecipeError(
                f"{fields[0]} does not run under pipeline parallel yet (set strategy.fsdp2.pipeline_parallel_size=1)"
            )
        if self.recipe.model.arch == "llama" and self.recipe.model.tie_embeddings:
            raise RecipeError(
                "model.tie_embeddings=true shares the embedding with the head, which pipeline stages hold apart"
                " (set it false, or strategy.fsdp2.pipeline_parallel_size=1)"
            )
        return self.recipe.model.n_layer

    def update_metrics(self, outputs: torch.Tensor, targets: torch.Tensor, metrics: dict[str, Metric]) -> None:
        # The mean over every counted token: each batch's (or rank's part's) mean weighted by its counted targets.
        metrics["loss"].update(self.part_loss(outputs, targets), weight=counted_targets(targets))

    def validation_results(self, computed: dict[str, float]) -> dict[str, float]:
        import math

        return {**computed, "perplexity": math.exp(computed["loss"])}

    def benchmarks(self) -> Benchmarks | None:
        if not self.recipe.eval.tasks:
            return None
        from .evaluate import TrainingEvaluation

        return TrainingEvaluation(self.recipe)

    def flops_per_unit(self) -> float:
        if self.recipe.model.moe.num_experts:  # routing depends on the values: counted by formula, active experts only
            from .sizing import model_shape

            return model_shape(self.recipe.model).training_flops_per_sample() / self.recipe.model.block_size
        from .families import training_flops_per_token

        return float(training_flops_per_token(self.recipe.model))


def summed_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The cross entropy of the next token summed over the counted targets."""
    import torch.nn.functional as F

    return F.cross_entropy(outputs.flatten(0, 1), targets.flatten(), reduction="sum")


def counted_targets(targets: torch.Tensor) -> torch.Tensor:
    """How many targets count in the loss: those that are not IGNORE_INDEX (-100, F.cross_entropy's default)."""
    return (targets != -100).sum()


def check_eval_tasks(config: LanguageModelEvalConfig) -> None:
    """eval.tasks* settings that can run (the tasks themselves are loaded when training starts)."""
    if not config.tasks:
        return
    if not (config.tasks_every_steps or config.every_steps):
        raise RecipeError("eval.tasks are set but never run: set eval.tasks_every_steps (or eval.every_steps) > 0")
    if config.tasks_include_path is not None:
        allow = field_path(config, "tasks_allow_code")
        check_task_folder(
            config.tasks_include_path,
            config.tasks_allow_code,
            field_path(config, "tasks_include_path"),
            f"{allow}: true",
        )
    if importlib.util.find_spec("lm_eval") is None:
        raise RecipeError("eval.tasks needs lm-evaluation-harness: pip install .[eval]")


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
    check_moe(model)
    if model.arch != "llama":
        return
    if model.n_head % model.kv_heads:
        raise RecipeError(
            f"model.n_kv_head={model.n_kv_head} does not divide model.n_head={model.n_head}"
            " (each key/value head serves an equal group of query heads)"
        )
    if (model.n_embd // model.n_head) % 2:
        raise RecipeError(
            f"model.n_embd / model.n_head = {model.n_embd // model.n_head} must be even (RoPE rotates pairs)"
        )
    if model.init_from is not None:
        from .hf import check_init_from  # reads JSON only: no torch

        check_init_from(model)


def check_moe(model: ModelConfig) -> None:
    """A model.moe section that can run: on the llama family, top_k within the experts, its other fields left at
    their defaults when the MLP is dense (the values' own bounds are declared on MoeConfig)."""
    moe, defaults = model.moe, MoeConfig()
    if not moe.num_experts:
        if changed := [name for name in vars(defaults) if getattr(moe, name) != getattr(defaults, name)]:
            raise RecipeError(f"model.moe.{changed[0]} applies only with model.moe.num_experts > 0 (remove it)")
        return
    if model.arch != "llama":
        raise RecipeError(f"model.moe.num_experts={moe.num_experts} applies only to model.arch=llama")
    if moe.top_k > moe.num_experts:
        raise RecipeError(
            f"model.moe.top_k={moe.top_k} is above model.moe.num_experts={moe.num_experts} (choose 1 to"
            f" {moe.num_experts})"
        )
