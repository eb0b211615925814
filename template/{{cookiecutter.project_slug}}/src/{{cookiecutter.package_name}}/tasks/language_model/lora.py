"""LoRA: low-rank adapters on the model's projections, injected with peft into the project's own model.

With lora.rank > 0 the task builds the model, then peft's `inject_adapter_in_model` puts an adapter beside each
target projection of every block and freezes everything else, before the strategy wraps the model: a target
`blocks.<i>.attn.q` keeps its weight as `blocks.<i>.attn.q.base_layer.weight` and gains
`...attn.q.lora_A.default.weight` (rank x in) and `...lora_B.default.weight` (out x rank, zero at the start, so
the adapted model starts as the base). With model.init_from the frozen base comes from there at every start,
resumed or not, and checkpoints hold the adapters and their optimizer state only; without it (a random base, for
trying things out) they hold the whole model. `export` merges the adapters into the base weights
(W + alpha / rank x B @ A) or writes them as a peft adapter folder (the llama family).

Importing this module does not import torch (its checks run when a recipe is read).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...errors import RecipeError
from .config import LORA_TARGETS, LanguageModelRecipe, LoraConfig, ModelConfig

if TYPE_CHECKING:
    import torch
    from torch import nn

ADAPTER = "default"  # peft's name of the one adapter injected
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # a peft adapter folder


def check_lora(recipe: LanguageModelRecipe) -> None:
    """Refuse a lora section that cannot run: its projections and the model it adapts (its values' bounds are
    declared on LoraConfig; the strategies that train adapters say which of their settings do not compose with
    them: recipe/checks.py, strategies/)."""
    lora, model = recipe.lora, recipe.model
    if lora.rank == 0:
        return
    where = f"lora.rank={lora.rank}"
    targets = LORA_TARGETS[model.arch]
    unknown = [name for name in lora.target_modules if name not in targets]
    if unknown:
        raise RecipeError(
            f"lora.target_modules: {unknown[0]} is not a projection of a {model.arch} block (choose among"
            f" {', '.join(targets)}; [] for all)"
        )
    if importlib.util.find_spec("peft") is None:
        raise RecipeError(f"{where} needs peft: pip install '.[lora]'")


def projection_shapes(model: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each projection of a block that LoRA may adapt."""
    width, hidden = model.n_embd, model.mlp_hidden_size
    if model.arch == "gpt":
        return {**dict.fromkeys(("attn.q", "attn.k", "attn.v", "attn.proj"), (width, width)),
                "mlp.fc": (width, hidden), "mlp.proj": (hidden, width)}  # fmt: skip
    kv_width = model.kv_heads * (width // model.n_head)
    return {
        "attn.q": (width, width), "attn.k": (width, kv_width), "attn.v": (width, kv_width), "attn.o": (width, width),
        "mlp.gate": (width, hidden), "mlp.up": (width, hidden), "mlp.down": (hidden, width),
    }  # fmt: skip


def adapter_parameters(recipe: LanguageModelRecipe) -> int:
    """Parameters of the adapters (rank x (in + out) per adapted projection and block), by formula."""
    shapes = projection_shapes(recipe.model)
    per_block = sum(recipe.lora.rank * sum(shapes[name]) for name in recipe.lora.targets(recipe.model.arch))
    return recipe.model.n_layer * per_block


def inject_adapters(model: nn.Module, lora: LoraConfig, targets: list[str]) -> nn.Module:
    """`model` with an adapter beside each target projection of every block, everything else frozen (in place)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    # A module matches a target when its name ends with it: blocks.3.attn.q ends with attn.q.
    targets = [f"blocks.{index}.{name}" for index in range(len(model.blocks)) for name in targets]  # type: ignore[arg-type]
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=targets)
    return inject_adapter_in_model(config, model, adapter_name=ADAPTER)


def adapted_name(name: str, targets: list[str]) -> str:
    """A parameter's name in the adapted model: a target projection's weight (and bias) moves under `base_layer`."""
    module, _, leaf = name.rpartition(".")
    parts = module.split(".", 2)  # blocks, <i>, attn.q
    if parts[0] == "blocks" and len(parts) == 3 and parts[2] in targets:
        return f"{module}.base_layer.{leaf}"
    return name


def adapter_names(module: str) -> tuple[str, str]:
    """The names of a projection's A and B matrices in the adapted model's state dict."""
    return f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"


def merged_reader(
    recipe: LanguageModelRecipe, names: set[str], read_saved: Callable[[str], torch.Tensor]
) -> tuple[set[str], Callable[[str], torch.Tensor]]:
    """(the base model's parameter names, a reader of one of them with its adapter merged in: W + alpha / rank x
    B @ A), one tensor at a time, from a LoRA checkpoint's tensors (`names`, `read_saved`) and its base: the
    weights of model.init_from, or the checkpoint's own when the run had none."""
    import torch

    targets = recipe.lora.targets(recipe.model.arch)
    if recipe.model.init_from is not None:
        from .hf import pretrained_reader

        base_names, read_base = pretrained_reader(recipe.model)
    else:
        base_names = {name.replace(".base_layer.", ".") for name in names if ".lora_" not in name}

        def read_base(name: str) -> torch.Tensor:
            return read_saved(adapted_name(name, targets))

    scale = recipe.lora.alpha / recipe.lora.rank

    def read(name: str) -> torch.Tensor:
        weight = read_base(name)
        a, b = adapter_names(name.removesuffix(".weight"))
        if a not in names:
            return weight
        delta = read_saved(b).to(torch.float32) @ read_saved(a).to(torch.float32)
        return (weight.to(torch.float32) + scale * delta).to(weight.dtype)

    return base_names, read


def write_adapter_folder(
    recipe: LanguageModelRecipe, adapters: set[str], read_adapter: Callable[[str], torch.Tensor], folder: Path
) -> dict[str, Any]:
    """Write the adapters as a peft adapter folder (adapter_config.json, adapter_model.safetensors) for peft's
    PeftModel.from_pretrained on the Hugging Face base (model.init_from)."""
    from peft import LoraConfig as PeftLoraConfig
    from safetensors.torch import save_file

    from .hf import hf_tensors

    if recipe.model.init_from is None:
        raise RecipeError("export --format peft writes adapters for the base of model.init_from; this run had none")
    if recipe.model.arch != "llama":  # GPT-2's layout fuses q, k and v into one c_attn, which one adapter cannot cover
        raise RecipeError(
            f"peft adapter folders are written for model.arch=llama (this checkpoint's is {recipe.model.arch}):"
            " export it with --format hf (adapters merged)"
        )
    hf_name = {spec.sources[0]: name for name, spec in hf_tensors(recipe.model).items()}  # the Llama's: one to one
    tensors: dict[str, torch.Tensor] = {}
    targets: set[str] = set()
    for name in sorted(name for name in adapters if ".lora_" in name):  # blocks.<i>.attn.q.lora_A.default.weight
        module, _, matrix = name.partition(".lora_")
        theirs = hf_name[f"{module}.weight"].removesuffix(".weight")  # model.layers.<i>.self_attn.q_proj
        tensors[f"base_model.model.{theirs}.lora_{matrix[0]}.weight"] = read_adapter(name).contiguous()
        targets.add(theirs.split(".", 3)[3])  # self_attn.q_proj
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    lora = recipe.lora
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=sorted(targets),
        task_type="CAUSAL_LM",
        base_model_name_or_path=recipe.model.init_from,
    )
    config.save_pretrained(str(folder))  # adapter_config.json
    return {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
