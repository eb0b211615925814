"""The Hugging Face round trip of a mixture of experts on CPU, fp32, tiny shapes: MixtralForCausalLM (the Llama's
attention, a softmax router over SwiGLU experts) in both directions with the same logits, and the options Mixtral
cannot hold refused in one line."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_hf import logits, save_checkpoint

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig, MoeConfig
from {{ cookiecutter.package_name }}.tasks.language_model.export import export_hf
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model
from {{ cookiecutter.package_name }}.tasks.language_model.hf import check_init_from, export_problem, pretrained_tensors

transformers = pytest.importorskip("transformers")  # a test dependency (Python 3.11+)

MOE = MoeConfig(num_experts=4, top_k=2, expert_intermediate_size=32)
MIXTRAL = ModelConfig(
    arch="llama", vocab_size=256, block_size=32, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, rope_theta=500000.0,
    moe=MOE,
)  # fmt: skip


def save_hf_mixtral(folder: Path) -> Path:
    """A randomly initialised MixtralForCausalLM of the MIXTRAL shape, saved by transformers (no download)."""
    config = transformers.MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, rope_theta=500000.0, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_mixtral_saved_by_transformers_imports_with_the_same_logits(tmp_path: Path) -> None:
    folder = save_hf_mixtral(tmp_path / "hf")
    config = replace(MIXTRAL, init_from=str(folder))
    check_init_from(config)
    model = build_model(config)
    model.load_state_dict(dict(pretrained_tensors(config)), strict=True)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(logits(model.eval(), tokens), logits(reference, tokens), atol=1e-5, rtol=0)


def test_a_mixture_of_experts_exports_to_mixtral_with_the_same_logits_and_imports_back(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = build_model(MIXTRAL).eval()
    exported = tmp_path / "exported"
    summary = export_hf(save_checkpoint(model, MIXTRAL, tmp_path / "run" / "step-00000001"), exported)
    assert summary["architecture"] == "MixtralForCausalLM"
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokens = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(logits(reloaded, tokens), logits(model, tokens), atol=1e-5, rtol=0)
    weights = load_file(exported / "model.safetensors")  # each expert its own tensor, a slice of the stacked ones
    expert = model.blocks[1].mlp.experts
    assert torch.equal(weights["model.layers.1.block_sparse_moe.experts.3.w2.weight"], expert.down[3])
    again = dict(pretrained_tensors(replace(MIXTRAL, init_from=str(exported))))
    assert all(torch.equal(again[name], value) for name, value in model.state_dict().items())


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"gate": "sigmoid"}, "model.moe.gate=sigmoid"),
        ({"shared_experts": 1}, "model.moe.shared_experts=1"),
        ({"normalize_top_k": False}, "model.moe.normalize_top_k=False"),
        ({"capacity_factor": 1.25}, "model.moe.capacity_factor=1.25"),
        ({"load_balance": "bias"}, "model.moe.load_balance=bias"),
    ],
)
def test_moe_options_mixtral_cannot_hold_are_refused_naming_the_field(change: dict[str, object], field: str) -> None:
    config = replace(MIXTRAL, moe=replace(MOE, **change))
    problem = export_problem(config)
    assert problem is not None and problem.startswith(field) and "\n" not in problem
    with pytest.raises(RecipeError, match=f"^model.init_from=.*{field}"):
        check_init_from(replace(config, init_from="."))
