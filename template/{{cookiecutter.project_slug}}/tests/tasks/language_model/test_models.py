"""The model families build at any size from their config; the GPT learns; counts of parameters and FLOPs are exact."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model, count_parameters, training_flops_per_token
from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.model import GPT

TINY = ModelConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32)


def test_logits_have_one_row_per_position() -> None:
    model = GPT(TINY)
    assert model(torch.randint(0, 256, (3, 32))).shape == (3, 32, 256)


def test_attention_is_causal() -> None:
    model = GPT(TINY).eval()
    tokens = torch.randint(0, 256, (1, 32))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    assert torch.allclose(model(tokens)[0, :-1], model(changed)[0, :-1], atol=1e-6)
    assert not torch.allclose(model(tokens)[0, -1], model(changed)[0, -1])


def test_parameter_count_of_gpt2_small_shape() -> None:
    config = ModelConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
    expected = 50304 * 768 * 2 + 1024 * 768 + 12 * (12 * 768 * 768 + 2 * 768) + 768
    assert count_parameters(config) == expected  # ~163M (untied head), built on the meta device


def test_a_few_steps_reduce_the_loss_on_a_repeated_batch() -> None:
    torch.manual_seed(0)
    model = GPT(TINY)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 256, (4, 33))
    losses = []
    for _ in range(20):
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


LLAMA = ModelConfig(
    arch="llama", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64
)


def test_the_llama_is_causal_and_has_one_row_of_logits_per_position() -> None:
    model = build_model(LLAMA).eval()
    tokens = torch.randint(0, 256, (1, 32))
    changed = tokens.clone()
    changed[0, -1] = (changed[0, -1] + 1) % 256
    assert model(tokens).shape == (1, 32, 256)
    assert torch.allclose(model(tokens)[0, :-1], model(changed)[0, :-1], atol=1e-6)
    assert not torch.allclose(model(tokens)[0, -1], model(changed)[0, -1])


def test_parameter_count_of_the_llama_3_8b_shape() -> None:
    config = ModelConfig(
        arch="llama", vocab_size=128256, block_size=8192, n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
        intermediate_size=14336, rope_theta=500000.0,
    )  # fmt: skip
    width, kv_width, hidden = 4096, 8 * 128, 14336
    per_block = 2 * width * width + 2 * width * kv_width + 3 * width * hidden + 2 * width
    assert count_parameters(config) == 2 * 128256 * width + 32 * per_block + width == 8_030_261_248


def test_a_tied_llama_shares_one_matrix_between_embedding_and_head() -> None:
    tied = ModelConfig(**{**vars(LLAMA), "tie_embeddings": True})
    model = build_model(tied)
    assert model.lm_head.weight is model.token_embedding.weight
    assert count_parameters(tied) == count_parameters(LLAMA) - 256 * 32


def test_llamas_rule_sizes_the_mlp_when_intermediate_size_is_0() -> None:
    assert ModelConfig(arch="llama", n_embd=4096).mlp_hidden_size == 11008  # Llama 2 7B
    assert ModelConfig(arch="llama", n_embd=64).mlp_hidden_size == 256


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters of the matrices that multiply activations (the embedding tables only look rows up)."""
    return sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embedding" not in name)


def test_flops_per_token_count_every_matmul_and_attention_like_the_gpts() -> None:
    attention = 12 * LLAMA.n_layer * LLAMA.n_embd * LLAMA.block_size  # all query heads attend, shared key/values or not
    assert training_flops_per_token(LLAMA) == 6 * matmul_parameters(build_model(LLAMA)) + attention
    gpt = ModelConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)
    attention = 12 * gpt.n_layer * gpt.n_embd * gpt.block_size
    assert training_flops_per_token(gpt) == 6 * matmul_parameters(build_model(gpt)) + attention


def test_plan_speaks_of_the_llama_recipes_real_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    main(["plan", "llama-1b-fsdp2-node"])
    assert "model: 1.24 B parameters (n_layer=16, n_embd=2048, n_head=32" in capsys.readouterr().out
    main(["plan", "llama-8b-fsdp2-node"])
    assert "model: 8.03 B parameters (n_layer=32, n_embd=4096, n_head=32" in capsys.readouterr().out
