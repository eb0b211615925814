"""The mixture of experts (model.moe): routing on hand-made scores, grouped matmuls equal to the loop, the balance
loss, the auxiliary loss and the bias update each balancing a skewed router, capacity drops, its refusals, and one
2-process run that logs its figures and resumes bitwise."""

from __future__ import annotations

import csv
import re
import signal
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, final_weights, losses_by_run, run_cli

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.language_model.config import LanguageModelRecipe, ModelConfig, MoeConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model, count_parameters
from {{ cookiecutter.package_name }}.tasks.language_model.families.llama.moe import (
    MoE,
    Routing,
    balance_loss,
    dispatch,
    grouped_mm_runs,
    route,
)
from {{ cookiecutter.package_name }}.tasks.language_model.sizing import model_shape
from {{ cookiecutter.package_name }}.tasks.language_model.task import LanguageModel

MOE = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=32, shared_experts=1)
SMALL = ModelConfig(arch="llama", n_layer=2, n_head=4, n_embd=64, intermediate_size=128, block_size=16, moe=MOE)


def test_softmax_routing_picks_the_top_k_and_normalises_their_weights() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [1.0, 0.0, 0.5, 5.0]])
    routing = route(logits, replace(MOE, normalize_top_k=True))
    assert routing.experts.tolist() == [[1, 2], [3, 0]]
    probabilities = logits.softmax(-1)
    top = probabilities.gather(-1, routing.experts)
    torch.testing.assert_close(routing.weights, top / top.sum(-1, keepdim=True))
    unnormalised = route(logits, replace(MOE, normalize_top_k=False))
    torch.testing.assert_close(unnormalised.weights, top)
    torch.testing.assert_close(routing.probabilities, probabilities)


def test_sigmoid_routing_weighs_by_each_experts_own_score_and_the_bias_moves_only_the_choice() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    config = replace(MOE, gate="sigmoid", normalize_top_k=False)
    assert route(logits, config).experts.tolist() == [[0, 1]]
    routing = route(logits, config, bias=torch.tensor([0.0, 0.0, 1.0, 0.0]))
    assert routing.experts.tolist() == [[2, 0]]
    torch.testing.assert_close(routing.weights, logits.sigmoid()[:, [2, 0]])  # the unbiased scores
    scores = logits.sigmoid()
    torch.testing.assert_close(routing.probabilities, scores / scores.sum())


def test_grouped_matmuls_give_the_loops_outputs_and_gradients() -> None:
    torch.manual_seed(0)
    layer = build_model(SMALL).blocks[0].mlp
    assert isinstance(layer, MoE)
    x = torch.randn(3, 16, 64)
    assert grouped_mm_runs(x, layer.experts.gate, layer.experts.down)  # this CPU runs torch._grouped_mm
    results = []
    for grouped in (True, False):
        layer.zero_grad()
        layer.experts.use_grouped_mm = grouped
        source = x.clone().requires_grad_()
        out = layer(source)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out, source.grad, *(p.grad for p in layer.parameters())))
    for grouped, looped in zip(*results, strict=True):
        torch.testing.assert_close(grouped, looped, rtol=1e-5, atol=1e-6)


def test_the_balance_loss_is_one_for_uniform_routing_and_above_one_for_skewed() -> None:
    experts = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    uniform = Routing(experts, torch.full((4, 2), 0.5), torch.full((4, 4), 0.25))
    assert balance_loss(uniform, torch.bincount(experts.reshape(-1), minlength=4)).item() == pytest.approx(1.0)
    skewed_experts = torch.tensor([[0, 1]] * 4)
    probabilities = torch.tensor([[0.4, 0.4, 0.1, 0.1]] * 4)
    skewed = Routing(skewed_experts, torch.full((4, 2), 0.5), probabilities)
    assert balance_loss(skewed, torch.bincount(skewed_experts.reshape(-1), minlength=4)).item() > 1.5


def test_capacity_drops_the_pairs_past_it_and_counts_them() -> None:
    x = torch.arange(5.0).unsqueeze(-1)
    experts = torch.tensor([[0], [0], [0], [1], [0]])
    routing = Routing(experts, torch.ones(5, 1), torch.full((5, 2), 0.5))
    sent = dispatch(x, routing, num_experts=2, limit=2)
    assert sent.counts.tolist() == [2, 1]
    assert sent.dropped.item() == 2
    assert sent.rows.squeeze(-1).tolist() == [0.0, 1.0, 3.0]  # the first tokens of each expert, in token order
    assert dispatch(x, routing, num_experts=2, limit=None).dropped.item() == 0


def test_the_bias_update_moves_a_skewed_routers_load_towards_balance() -> None:
    torch.manual_seed(0)
    config = replace(SMALL, n_layer=1, moe=replace(MOE, load_balance="bias", bias_update_rate=0.01))
    model = build_model(config)
    tokens = torch.randint(0, 256, (4, 16))
    skewed = torch.randn(64, 4) * 0.1 + torch.tensor([0.3, 0.2, 0.0, 0.0])  # experts 0 and 1 win most tokens

    class SkewedRouter(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return skewed

    model.blocks[0].mlp.router = SkewedRouter()
    imbalance = []
    for _ in range(30):
        model(tokens)
        model.auxiliary_loss()
        summed = model.step_statistics()
        assert summed is not None
        imbalance.append(float(model.end_step(summed, updated=True)["moe/load_imbalance"]))
    assert imbalance[0] > 1.8 and max(imbalance[-5:]) < 1.45, imbalance  # sign steps: it settles near balance
    assert float(model.blocks[0].mlp.expert_bias[0]) < 0  # the over-loaded expert is pushed down


def routers_imbalance_after_training(aux_loss_weight: float, steps: int = 50) -> tuple[float, float]:
    """Max/mean load of a skewed router's experts before and after `steps` SGD steps on the auxiliary loss alone
    (aux_loss_weight x the balance loss), on fixed inputs, training the router only."""
    torch.manual_seed(0)
    layer = MoE(replace(SMALL, moe=replace(MOE, shared_experts=0, aux_loss_weight=aux_loss_weight)), None)
    torch.nn.init.normal_(layer.router.weight, std=0.02)
    for weight in layer.experts.parameters():
        torch.nn.init.normal_(weight, std=0.02)
        weight.requires_grad_(False)
    with torch.no_grad():  # inputs share a direction that experts 0 and 1 favour: they win most tokens
        layer.router.weight[:2] += torch.tensor([[0.05], [0.03]])
    x = torch.randn(128, 64) + 1.0
    optimizer = torch.optim.SGD(layer.router.parameters(), lr=1.0)

    def imbalance() -> float:
        layer(x)
        assert layer.record is not None
        loads = layer.record.loads.float()
        return float(loads.max() / loads.mean())

    before = imbalance()
    for _ in range(steps):
        layer(x)
        assert layer.record is not None
        optimizer.zero_grad()
        (layer.config.aux_loss_weight * layer.record.balance_loss).backward()
        optimizer.step()
    return before, imbalance()


def test_the_auxiliary_loss_moves_a_skewed_routers_load_towards_balance() -> None:
    before, after = routers_imbalance_after_training(aux_loss_weight=0.01)
    assert before == 2.0 and after < 1.1  # two of four experts took every pair; now near even
    assert routers_imbalance_after_training(aux_loss_weight=0.0) == (2.0, 2.0)  # without the term nothing moves it


def test_an_aux_loss_model_adds_the_weighted_term_and_a_dense_one_none() -> None:
    torch.manual_seed(0)
    model = build_model(SMALL)
    model(torch.randint(0, 256, (2, 16)))
    term = model.auxiliary_loss()
    assert term is not None and term.requires_grad
    assert 0.01 <= term.item() < 0.02  # aux_loss_weight x a balance loss of one or a little more
    dense = build_model(replace(SMALL, moe=MoeConfig()))
    dense(torch.randint(0, 256, (2, 16)))
    assert dense.auxiliary_loss() is None and dense.step_statistics() is None


def test_plan_counts_every_expert_for_memory_and_the_active_ones_for_flops() -> None:
    shape = model_shape(SMALL)
    assert shape.parameters() == count_parameters(SMALL)
    dense_active = replace(SMALL, intermediate_size=(MOE.top_k + MOE.shared_experts) * 32, moe=MoeConfig())
    per_layer_router = SMALL.n_embd * MOE.num_experts
    assert shape.active_parameters() == count_parameters(dense_active) + SMALL.n_layer * per_layer_router
    recipe = LanguageModelRecipe(model=SMALL)
    every_expert = model_shape(replace(SMALL, moe=replace(MOE, top_k=4)))
    assert LanguageModel(recipe).flops_per_unit() < every_expert.training_flops_per_sample() / SMALL.block_size


@pytest.mark.parametrize(
    ("moe", "message"),
    [
        (replace(MOE, top_k=5), "model.moe.top_k=5 is above model.moe.num_experts=4"),
        (MoeConfig(top_k=3), "model.moe.top_k applies only with model.moe.num_experts > 0"),
    ],
)
def test_moe_settings_that_cannot_run_are_refused_in_one_line(moe: MoeConfig, message: str) -> None:
    with pytest.raises(RecipeError, match=re.escape(message)):
        LanguageModel(LanguageModelRecipe(model=replace(SMALL, moe=moe))).check()
    with pytest.raises(RecipeError, match=re.escape("applies only to model.arch=llama")):
        LanguageModel(LanguageModelRecipe(model=ModelConfig(moe=MOE))).check()


@pytest.mark.slow
def test_the_moe_recipe_trains_logs_its_figures_and_resumes_bitwise(tmp_path: Path) -> None:
    def args(out_dir: Path) -> list[str]:
        return [
            "train", "--config", str(RECIPES / "cpu-moe-debug.yaml"), "--out_dir", str(out_dir),
            "--logger.name", "csv", "--model.n_layer", "1", "--model.block_size", "16", "--train.max_steps", "4",
            "--checkpoint.save_every_steps", "2", "--eval.every_steps", "0", "--logger.log_every_steps", "1",
            "--model.moe.load_balance", "bias", "--model.moe.capacity_factor", "1.0",
        ]  # fmt: skip

    reference = tmp_path / "reference"
    result = run_cli(*args(reference))
    assert result.returncode == 0, result.stderr[-3000:]
    (expected,) = losses_by_run(reference)
    with next(reference.glob("csv/version_*/metrics.csv")).open() as handle:
        rows = [row for row in csv.DictReader(handle) if row.get("moe/load_imbalance")]
    assert len(rows) == 4
    assert all(float(row["moe/load_imbalance"]) >= 1.0 and float(row["moe/router_entropy"]) > 0 for row in rows)
    assert any(float(row["moe/dropped_fraction"]) > 0 for row in rows)  # capacity 1.0 drops some

    killed = tmp_path / "killed"
    assert run_cli(*args(killed), fault="kill-at-step:3").returncode == -signal.SIGKILL
    resumed = run_cli(*args(killed))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _, after_resume = losses_by_run(killed)
    assert after_resume == {step: expected[step] for step in range(3, 5)}  # bitwise: the bias was saved and read
    weights, expected_weights = final_weights(killed, 4), final_weights(reference, 4)
    assert any("expert_bias" in name for name in weights)
    assert all(torch.equal(weights[name], expected_weights[name]) for name in expected_weights)
