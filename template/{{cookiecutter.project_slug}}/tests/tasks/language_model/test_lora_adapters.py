"""LoRA in one process: what a recipe's lora section may not ask for, and what the adapted model trains."""

from __future__ import annotations

import pytest
import torch
from helpers import RECIPES, fail_with

from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.recipe.schema import TrainConfig
from {{ cookiecutter.package_name }}.tasks import task_for
from {{ cookiecutter.package_name }}.tasks.language_model.lora import adapter_parameters
from {{ cookiecutter.package_name }}.training.optim import build_optimizer

pytest.importorskip("peft")

LORA = ["--config", str(RECIPES / "cpu-lora-debug.yaml"), "--model.n_layer", "2"]


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (
            ["--strategy.name", "fsdp2", "--strategy.fsdp2.tensor_parallel_size", "2"],
            "lora.rank=8 does not compose with strategy.fsdp2.tensor_parallel_size=2",
        ),
        (["--strategy.name", "deepspeed"], "lora.rank=8 trains adapters under strategy.name=ddp or fsdp2 or hsdp"),
        (["--strategy.name", "fsdp2", "--strategy.meta_init", "true"], "does not compose with strategy.meta_init=true"),
        (
            ["--lora.target_modules", "[attn.q, mlp.fc]"],
            "lora.target_modules: mlp.fc is not a projection of a llama block",
        ),
        (["--lora.rank", "-1"], "lora.rank=-1 must be >= 0"),
    ],
)
def test_a_lora_section_that_cannot_run_is_refused_in_one_line(
    overrides: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert expected in fail_with(["train", *LORA, *overrides], capsys)


def test_the_adapted_model_starts_as_its_base_and_its_optimizer_steps_only_the_adapters() -> None:
    task = task_for(parse_recipe([*LORA, "--lora.target_modules", "[attn.q, mlp.down]"]))
    torch.manual_seed(0)
    model = task.build_model()
    adapters = {name for name, p in model.named_parameters() if p.requires_grad}
    assert adapters == {
        f"blocks.{i}.{module}.lora_{matrix}.default.weight"
        for i in range(2)
        for module in ("attn.q", "mlp.down")
        for matrix in "AB"
    }
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trained == adapter_parameters(task.recipe)  # the formula free-space checks use (no torch)
    base = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    plain = task_for(parse_recipe([*LORA, "--lora.rank", "0"])).build_model()
    plain.load_state_dict({name.replace(".base_layer.", "."): value for name, value in base.items()})
    tokens = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(model(tokens), plain(tokens), atol=0, rtol=0)  # B = 0: no change at the start

    optimizer = build_optimizer(model, TrainConfig(learning_rate=0.01))
    assert {id(p) for group in optimizer.param_groups for p in group["params"]} == {
        id(p) for p in model.parameters() if p.requires_grad
    }
    for _ in range(2):
        model(tokens).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in base.items())  # bitwise
    assert all(after[name].grad is None for name in base)
    assert all(after[name].abs().sum() > 0 for name in adapters if ".lora_B." in name)  # the adapters learned
