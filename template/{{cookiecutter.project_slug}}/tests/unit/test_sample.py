"""`sample` continues a prompt with a checkpoint's model and prints text; bad arguments are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, run_cli

from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import dump_recipe, load_recipe
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.model import GPT
from {{ cookiecutter.package_name }}.tasks.language_model.sample import sample


def write_checkpoint(run: Path, source: str = "embedded") -> Path:
    """A checkpoint folder as a one-process run writes it, with an untrained tiny model."""
    recipe = load_recipe(RECIPES / "cpu-debug.yaml")
    recipe.model = ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=32)
    recipe.data.source, recipe.data.path = source, None if source == "embedded" else "tokens.bin"
    torch.manual_seed(0)
    folder = run / "checkpoints" / "step-00000001"
    folder.mkdir(parents=True)
    torch.save({"model": GPT(recipe.model).state_dict(), "step": 1}, folder / "state")
    (folder / "config.yaml").write_text(dump_recipe(recipe))
    files = {p.name: p.stat().st_size for p in folder.iterdir()}
    (folder / "meta.json").write_text(json.dumps({"step": 1, "tokens_seen": 0, "world_size": 1, "files": files}))
    return folder


def test_sample_continues_the_prompt_in_bytes_reproducibly(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "run")
    text = sample(str(tmp_path / "run"), "The fox", 40, temperature=1.0, top_k=None, seed=1)
    assert text.startswith("The fox") and len(text.encode("utf-8", errors="replace")) > len("The fox")
    assert sample(str(tmp_path / "run"), "The fox", 40, 1.0, None, seed=1) == text
    assert sample(str(tmp_path / "run"), "The fox", 40, 1.0, None, seed=2) != text
    greedy = [sample(str(tmp_path / "run" / "checkpoints" / "latest"), "a", 20, 0.0, None, seed) for seed in (1, 2)]
    assert greedy[0] == greedy[1]  # temperature 0: the seed does not matter


def test_a_prompt_longer_than_the_context_is_cut_to_it(tmp_path: Path) -> None:
    folder = write_checkpoint(tmp_path / "run")
    text = sample(str(folder), "x" * 100, 3, temperature=0.8, top_k=5, seed=0)
    assert text[:32] == "x" * 32 and len(text) <= 32 + 3  # the last block_size=32 bytes of it, and 3 new ones


def test_checkpoint_of_token_file_data_has_no_tokenizer(tmp_path: Path) -> None:
    write_checkpoint(tmp_path / "run", source="tokens")
    with pytest.raises(RecipeError, match=r"data\.source=tokens, which has no tokenizer"):
        sample(str(tmp_path / "run"), "x", 3, 1.0, None, 0)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (["--top_k", "0"], "--top_k 0 must be >= 1"),
        (["--max_new_tokens", "0"], "--max_new_tokens 0 must be >= 1"),
        (["--temperature", "-1"], "--temperature -1 must be >= 0"),
    ],
)
def test_bad_sample_arguments_exit_2_with_one_line(tmp_path: Path, extra: list[str], expected: str) -> None:
    write_checkpoint(tmp_path / "run")
    result = run_cli("sample", str(tmp_path / "run"), "--prompt", "a", *extra)
    assert result.returncode == 2 and result.stderr.startswith(f"error: {expected}") and result.stderr.count("\n") == 1


def test_missing_checkpoint_exits_2_with_one_line(tmp_path: Path) -> None:
    result = run_cli("sample", str(tmp_path / "nothing"), "--prompt", "a")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "no complete checkpoint there" in result.stderr
