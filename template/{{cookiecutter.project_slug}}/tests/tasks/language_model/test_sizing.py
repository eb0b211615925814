"""`sizing`: parameter counts equal the built model's, model states equal the ZeRO paper's formulas to the byte,
and the activation estimate matches the bytes the model really saves for backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from {{ cookiecutter.package_name }}.precision import zero_model_states
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import count_parameters, training_flops_per_token
from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.model import GPT
from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.sizing import gpt_parameters
from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.sizing import shape as gpt_shape
from {{ cookiecutter.package_name }}.tasks.language_model.families.llama.sizing import llama_parameters
from {{ cookiecutter.package_name }}.tasks.language_model.sizing import activations, model_parameters, model_shape
from {{ cookiecutter.package_name }}.tasks.language_model.sizing import training_flops_per_token as flops_by_formula

SHAPES = [
    ModelConfig(),
    ModelConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
    ModelConfig(vocab_size=1000, block_size=77, n_layer=3, n_head=5, n_embd=40, mlp_ratio=2, bias=True),
    ModelConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048),
]


@pytest.mark.parametrize("config", SHAPES, ids=lambda c: f"L{c.n_layer}-h{c.n_embd}-bias{c.bias}")
def test_the_formula_counts_the_parameters_of_the_built_gpt(config: ModelConfig) -> None:
    assert gpt_parameters(config) == count_parameters(config)


LLAMAS = [
    ModelConfig(arch="llama", vocab_size=256, block_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=64),
    ModelConfig(arch="llama", vocab_size=1000, block_size=32, n_layer=3, n_head=6, n_embd=48, intermediate_size=80),
    ModelConfig(
        arch="llama", vocab_size=500, block_size=16, n_layer=1, n_head=8, n_kv_head=1, n_embd=64, tie_embeddings=True
    ),
]


@pytest.mark.parametrize(
    "config", LLAMAS, ids=lambda c: f"kv{c.kv_heads}-ffn{c.mlp_hidden_size}-tied{c.tie_embeddings}"
)
def test_the_formulas_count_the_parameters_and_flops_of_the_built_llama(config: ModelConfig) -> None:
    assert model_parameters(config) == count_parameters(config)
    assert flops_by_formula(model_shape(config)) == training_flops_per_token(config)


@pytest.mark.parametrize("config", SHAPES[:3], ids=lambda c: f"L{c.n_layer}-h{c.n_embd}")
def test_the_formula_counts_the_flops_that_torch_measures(config: ModelConfig) -> None:
    assert flops_by_formula(gpt_shape(config)) == training_flops_per_token(config)


def test_llama_parameters_by_formula_equal_a_hand_count() -> None:
    # Llama-2-7B and Llama-3-8B (grouped-query attention, 8 key/value heads): their published counts.
    llama2 = {"vocab_size": 32000, "block_size": 4096, "n_layer": 32, "n_embd": 4096, "n_head": 32}
    assert llama_parameters({**llama2, "n_kv_head": 32, "intermediate_size": 11008}) == 6_738_415_616
    llama3 = {"vocab_size": 128256, "block_size": 8192, "n_layer": 32, "n_embd": 4096, "n_head": 32}
    assert llama_parameters({**llama3, "n_kv_head": 8, "intermediate_size": 14336}) == 8_030_261_248
    # A small one with tied embeddings, counted term by term.
    v, h, layers, heads, kv_heads, ffn = 100, 16, 2, 4, 2, 40
    head_dim = h // heads
    attention = h * h + 2 * h * kv_heads * head_dim + h * h  # q, k, v, o; no biases
    mlp = 3 * h * ffn  # gate, up, down
    hand = v * h + layers * (attention + mlp + 2 * h) + h  # embedding (= head), layers with 2 RMSNorms, final norm
    config = {"vocab_size": v, "block_size": 32, "n_layer": layers, "n_embd": h, "n_head": heads}
    tied = {**config, "n_kv_head": kv_heads, "intermediate_size": ffn, "tie_embeddings": True}
    assert llama_parameters(tied) == hand
    assert llama_parameters({**tied, "tie_embeddings": False}) == hand + v * h


@pytest.mark.parametrize("psi", [100e6, 7.5e9, 70e9, 175e9, 1e12])
@pytest.mark.parametrize("nd", [1, 8, 64, 1024])
def test_model_states_are_the_zero_papers_formulas_to_the_byte(psi: float, nd: int) -> None:
    # ZeRO section 3.1 / figure 1: 2 + 2 + K bytes per parameter, K = 12 under mixed precision.
    for precision, (w, g, k) in (("bf16-mixed", (2, 2, 12)), ("32-true", (4, 4, 8)), ("bf16-true", (2, 2, 4))):
        expected = {
            0: (w * psi, g * psi, k * psi),
            1: (w * psi, g * psi, k * psi / nd),
            2: (w * psi, g * psi / nd, k * psi / nd),
            3: (w * psi / nd, g * psi / nd, k * psi / nd),
        }
        for stage, parts in expected.items():
            states = zero_model_states(psi, precision, stage, nd)
            assert (states.parameters, states.gradients, states.optimizer) == parts, (precision, stage)
            assert states.total == sum(parts)


def test_the_zero_papers_figure_1_example() -> None:
    # 7.5 B parameters, 64 GPUs: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB.
    totals = [zero_model_states(7.5e9, "bf16-mixed", stage, 64).total / 1e9 for stage in range(4)]
    assert [round(total, 1) for total in totals] == [120.0, 31.4, 16.6, 1.9]


def test_the_paper_activation_formula() -> None:
    config = ModelConfig(vocab_size=50304, block_size=2048, n_layer=24, n_head=16, n_embd=2048)
    s, b, h, a, v, layers = 2048, 4, 2048, 16, 50304, 24
    outside = 4 * s * b * h * (1 + v / h)
    estimate = activations(gpt_shape(config), b, "bf16-mixed")
    assert estimate.paper == pytest.approx(layers * s * b * h * (34 + 5 * a * s / h) + outside)
    assert estimate.paper_checkpointed == pytest.approx(layers * 2 * s * b * h + outside)
    tp = activations(gpt_shape(config), b, "bf16-mixed", tensor_parallel=4)
    assert tp.paper == pytest.approx(layers * s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)) + outside / 4)


def saved_for_backward(config: ModelConfig, micro_batch: int, checkpointing: bool, precision: str) -> int:
    """Bytes autograd holds for backward after one forward and loss, counted by storage (parameters left out).
    bf16-true: a 16-bit module, as fsdp2 computes each gathered block under bf16-mixed."""
    torch.manual_seed(0)
    model = GPT(config).to(torch.bfloat16 if precision == "bf16-true" else torch.float32)
    if checkpointing:
        for index, block in enumerate(model.blocks):
            model.blocks[index] = checkpoint_wrapper(block)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    tokens = torch.randint(0, config.vocab_size, (micro_batch, config.block_size))
    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"),
    ):
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    loss.backward()
    return sum(saved.values())


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128),
        ModelConfig(vocab_size=512, block_size=64, n_layer=3, n_head=2, n_embd=96, mlp_ratio=2),
    ],
    ids=["cpu-debug", "narrow"],
)
def test_the_activation_estimate_is_within_15_percent_of_what_autograd_saves(
    config: ModelConfig, checkpointing: bool, precision: str
) -> None:
    measured = saved_for_backward(config, 2, checkpointing, precision)
    estimate = activations(gpt_shape(config), 2, precision)
    expected = estimate.held_checkpointed if checkpointing else estimate.held
    assert measured == pytest.approx(expected, rel=0.15)
    print(f"{precision} checkpointing={checkpointing}: measured {measured} B, estimated {expected:.0f} B")


def test_the_activation_estimate_of_a_16_bit_gpt_is_within_15_percent_of_what_autograd_saves() -> None:
    """fsdp2 under bf16-mixed computes each gathered block as a 16-bit module: what `plan` counts as bf16-true."""
    config = ModelConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)  # cpu-debug's
    measured = saved_for_backward(config, 2, False, "bf16-true")
    expected = activations(gpt_shape(config), 2, "bf16-true").held
    assert measured == pytest.approx(expected, rel=0.15)
    # Against autocast alone: no fp32 residual stream, no bf16 copy of every weight held until backward.
    ratio = measured / saved_for_backward(config, 2, False, "bf16-mixed")
    assert ratio < 0.7
    print(f"bf16-true: measured {measured} B, estimated {expected:.0f} B, {ratio:.2f}x of autocast alone")


@pytest.mark.parametrize(
    "config",
    [
        ModelConfig(),
        ModelConfig(vocab_size=1000, block_size=64, n_layer=3, n_head=2, n_embd=48, mlp_ratio=2, bias=True),
    ],
)
def test_the_torch_free_parameter_count_is_the_built_models(config: ModelConfig) -> None:
    assert model_parameters(config) == count_parameters(config)


def test_flops_per_token_are_six_per_matmul_parameter_plus_attention() -> None:
    config = ModelConfig(n_layer=2, n_head=2, n_embd=64, block_size=32)
    with torch.device("meta"):
        matmul_parameters = sum(
            p.numel() for name, p in GPT(config).named_parameters() if p.dim() == 2 and "embedding" not in name
        )
    attention = 12 * config.n_layer * config.n_embd * config.block_size
    assert training_flops_per_token(config) == 6 * matmul_parameters + attention
