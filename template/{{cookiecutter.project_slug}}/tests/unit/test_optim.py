"""The training defaults: AdamW in its fused kernel, the warmup-stable-decay schedule beside cosine, and selective
(per-operation) activation checkpointing beside full, each checked against what it replaces or sits beside."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
from helpers import fail_with, recipe_args, train_args
from torch.utils._python_dispatch import TorchDispatchMode

from {{ cookiecutter.package_name }}.recipe.load import parse_recipe
from {{ cookiecutter.package_name }}.recipe.schema import StrategyConfig, TrainConfig
from {{ cookiecutter.package_name }}.strategies.base import prepare_blocks
from {{ cookiecutter.package_name }}.strategies.checkpointing import MATMULS
from {{ cookiecutter.package_name }}.tasks import task_for
from {{ cookiecutter.package_name }}.tasks.base import batch_loss
from {{ cookiecutter.package_name }}.training.optim import build_optimizer, build_scheduler, learning_rate_factor


def test_wsd_warms_up_holds_the_peak_then_decays_linearly_over_the_last_fraction() -> None:
    config = TrainConfig(max_steps=100, warmup_steps=10, learning_rate=1e-3, min_learning_rate=1e-4, schedule="wsd")
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=config.learning_rate)
    scheduler = build_scheduler(optimizer, config)
    rates = []
    for _ in range(101):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert rates[0] == pytest.approx(1e-3 / 11) and rates[9] == pytest.approx(1e-3 * 10 / 11)  # warmup
    assert rates[10:81] == [pytest.approx(1e-3)] * 71  # stable: the peak until the last 20 steps
    assert rates[90] == pytest.approx(0.55e-3) and rates[100] == pytest.approx(1e-4)  # linear to the floor
    assert all(later < earlier for earlier, later in itertools.pairwise(rates[80:]))
    cosine = TrainConfig(max_steps=100, warmup_steps=10, learning_rate=1e-3, min_learning_rate=1e-4)
    assert learning_rate_factor(55, cosine) == pytest.approx(0.55) and learning_rate_factor(
        100, cosine
    ) == pytest.approx(0.1)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["--train.schedule", "linear"], "train.schedule"),
        (["--train.decay_fraction", "0"], "train.decay_fraction=0.0 must be in (0, 1]"),
        (["--train.decay_fraction", "1.5"], "train.decay_fraction=1.5 must be in (0, 1]"),
        (
            [
                "--train.schedule",
                "wsd",
                "--train.max_steps",
                "20",
                "--train.warmup_steps",
                "10",
                "--train.decay_fraction",
                "0.6",
            ],
            "train.schedule=wsd: train.warmup_steps=10 and the decay's 12 steps",
        ),
        (["--strategy.activation_checkpointing_policy", "selective"], "needs strategy.activation_checkpointing=true"),
        (["--strategy.activation_checkpointing_policy", "some"], "strategy.activation_checkpointing_policy"),
        (
            [
                "--strategy.name",
                "fsdp",
                "--accelerator",
                "cuda",
                "--strategy.activation_checkpointing",
                "true",
                "--strategy.activation_checkpointing_policy",
                "selective",
            ],
            "strategy.name=fsdp checkpoints whole blocks",
        ),
    ],
)
def test_bad_schedule_and_checkpointing_values_are_one_line(
    tmp_path: Path, overrides: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    error = fail_with(train_args(tmp_path / "run", *overrides), capsys)
    assert expected in error
    assert not (tmp_path / "run").exists()


def test_adamw_runs_the_fused_kernel_on_cpu_with_the_updates_of_the_per_tensor_loop() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    optimizer = build_optimizer(model, TrainConfig())
    assert optimizer.defaults["fused"] is True
    per_tensor = torch.optim.AdamW(
        [
            {"params": [p for p in reference.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in reference.parameters() if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=TrainConfig().learning_rate, betas=(0.9, 0.95), foreach=False,
    )  # fmt: skip
    for _ in range(3):
        inputs = torch.randn(5, 8)
        for net, opt in ((model, optimizer), (reference, per_tensor)):
            opt.zero_grad()
            net(inputs).square().mean().backward()
            opt.step()
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


class MatmulCounter(TorchDispatchMode):
    """Counts the matrix multiplies dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func in MATMULS
        return func(*args, **(kwargs or {}))


def test_selective_checkpointing_gives_the_same_loss_and_gradients_and_recomputes_fewer_matmuls(tmp_path: Path) -> None:
    recipe = parse_recipe(recipe_args(tmp_path, "--model.n_layer", "2"))
    task = task_for(recipe)
    torch.manual_seed(0)
    base = task.build_model()
    samples = task.datasets().train
    batch = samples.batch(list(range(4)))

    def step(policy: str | None) -> tuple[float, dict[str, torch.Tensor], int]:
        model = copy.deepcopy(base)
        if policy:
            prepare_blocks(model, StrategyConfig(activation_checkpointing=True, activation_checkpointing_policy=policy))
        loss = batch_loss(task, model, batch).objective
        with MatmulCounter() as counter:
            loss.backward()
        grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
        return loss.item(), grads, counter.count

    loss, grads, backward_matmuls = step(None)
    recomputed = {}
    for policy in ("full", "selective"):
        other_loss, other_grads, other_matmuls = step(policy)
        assert other_loss == loss
        assert all(torch.equal(other_grads[name], grads[name]) for name in grads), policy
        recomputed[policy] = other_matmuls - backward_matmuls  # forward matmuls run again in backward
    # Selective keeps every other matmul's output: fewer of them run again than under full checkpointing.
    assert 0 < recomputed["selective"] < recomputed["full"]
