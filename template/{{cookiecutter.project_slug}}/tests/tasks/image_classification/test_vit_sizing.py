"""What `plan` and MFU read for the ViT, checked against the built model: the torch-free parameter count, the
FLOPs per image (against torch's FLOP counter on a meta-device copy), the activation bytes autograd saves,
and `plan` on the library's ViT recipes."""

from __future__ import annotations

import pytest
import torch
from helpers import RECIPES, cli_env
from lightning.fabric.utilities.throughput import measure_flops

from {{ cookiecutter.package_name }}.tasks.image_classification.config import ViTConfig
from {{ cookiecutter.package_name }}.tasks.image_classification.model import ViT
from {{ cookiecutter.package_name }}.tasks.image_classification.sizing import ViTShape, reference_model

SHAPES = pytest.mark.parametrize(
    "config",
    [ViTConfig(), ViTConfig(image_size=32, patch_size=4, channels=3, num_classes=7, n_layer=3, n_head=2, n_embd=48)],
    ids=["digits", "rgb-32px"],
)


@SHAPES
def test_the_formula_counts_the_parameters_of_the_built_vit(config: ViTConfig) -> None:
    with torch.device("meta"):
        built = sum(p.numel() for p in ViT(config).parameters())
    assert ViTShape(config).parameters() == built
    with torch.device("meta"):
        block = sum(p.numel() for p in ViT(config).blocks[0].parameters())
    assert ViTShape(config).layer_parameters() == block


@SHAPES
def test_the_flops_per_image_are_torchs_count_of_forward_and_backward(config: ViTConfig) -> None:
    with torch.device("meta"):
        model = ViT(config)
        images = torch.zeros(1, config.channels, config.image_size, config.image_size)
    counted = measure_flops(model, lambda: model(images), lambda logits: logits.sum())
    assert ViTShape(config).training_flops_per_sample() == pytest.approx(counted, rel=0.01)


def saved_bytes(model: torch.nn.Module, images: torch.Tensor) -> int:
    """Bytes of the tensors autograd saves for backward in one forward pass (storages counted once)."""
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(images).sum()
    return sum(seen.values())


def test_the_activation_estimate_is_what_autograd_holds() -> None:
    config = ViTConfig(image_size=16, patch_size=2, channels=3, n_layer=2, n_head=2, n_embd=64)
    model = ViT(config)
    parameters = sum(p.numel() * p.element_size() for p in model.parameters())
    measured = saved_bytes(model, torch.randn(4, 3, 16, 16)) - parameters  # weights are saved too, not activations
    assert measured == pytest.approx(ViTShape(config).activations(4, "32-true").held, rel=0.15)


def test_a_bare_parameter_count_is_planned_on_the_nearest_reference_vit() -> None:
    assert reference_model(86e6)["n_embd"] == 768  # ViT-B/16
    assert reference_model(300e6)["n_embd"] == 1024  # ViT-L/16
    assert ViTShape(ViTConfig(**reference_model(86e6))).parameters() == pytest.approx(86.6e6, rel=0.01)


@pytest.mark.parametrize(("recipe", "strategy"), [("vit-b16-ddp-node", "ddp"), ("vit-l16-fsdp2-node", "ddp")])
def test_plan_recommends_ddp_for_the_vits_on_80_gb_gpus(recipe: str, strategy: str) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "{{ cookiecutter.package_name }}", "plan", str(RECIPES / f"{recipe}.yaml"), "--gpu", "H100"],
        capture_output=True, text=True, env=cli_env(), timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"recommended: {strategy}" in result.stdout.lower() or f"-> {strategy}" in result.stdout, result.stdout
