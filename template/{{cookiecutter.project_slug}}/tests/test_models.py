"""The GPT builds at any size from its config and learns."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from {{ cookiecutter.package_name }}.models import count_parameters
from {{ cookiecutter.package_name }}.models.gpt import GPT
from {{ cookiecutter.package_name }}.recipe.schema import ModelConfig

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
