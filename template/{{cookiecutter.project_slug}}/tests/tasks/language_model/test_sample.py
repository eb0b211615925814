"""`sample` continues a prompt with a checkpoint's model and prints text, reading only the model's tensors and
generating with a KV cache that gives the tokens of full recomputation; bad arguments are one line, exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, run_cli

from {{ cookiecutter.package_name }}.checkpoint.tensors import load_model
from {{ cookiecutter.package_name }}.errors import RecipeError
from {{ cookiecutter.package_name }}.recipe.load import dump_recipe, load_recipe
from {{ cookiecutter.package_name }}.tasks.language_model.config import ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model
from {{ cookiecutter.package_name }}.tasks.language_model.families.gpt.model import GPT
from {{ cookiecutter.package_name }}.tasks.language_model.families.kv_cache import new_caches
from {{ cookiecutter.package_name }}.tasks.language_model.sample import generate, sample


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
    (folder / "meta.json").write_text(
        json.dumps({"step": 1, "tokens_seen": 0, "strategy": "ddp", "world_size": 1, "files": files})
    )
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
        (["--max_new_tokens", "0"], "--max_new_tokens 0 must be in [1, 100,000]"),
        (["--max_new_tokens", "1e20"], "--max_new_tokens: Expected a <class 'int'>. Got value: 1e+20"),
        (
            ["--max_new_tokens", "100000000000000000000"],
            "--max_new_tokens 100000000000000000000 must be in [1, 100,000]",
        ),
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


def write_sharded_checkpoint(run: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """A checkpoint folder in torch.distributed.checkpoint's layout (as fsdp2 writes it): the model's tensors and an
    optimizer state twice their size."""
    from torch.distributed.checkpoint import FileSystemWriter, save

    folder = write_checkpoint(run)
    (folder / "state").unlink()
    torch.manual_seed(1)
    weights = GPT(ModelConfig(n_layer=1, n_embd=32, n_head=2, block_size=32)).state_dict()
    moments = {name: {"exp_avg": torch.randn_like(v), "exp_avg_sq": torch.rand_like(v)} for name, v in weights.items()}
    save(
        {"model": weights, "optimizer": {"state": moments}},
        storage_writer=FileSystemWriter(folder / "state"),
        no_dist=True,
    )
    meta = json.loads((folder / "meta.json").read_text())
    files = {
        str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file() and p.name != "meta.json"
    }
    (folder / "meta.json").write_text(json.dumps({**meta, "strategy": "fsdp2", "files": files}))
    return folder, weights


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the checkpoint is written by one process
def test_sample_reads_the_model_tensors_of_a_checkpoint_and_not_its_optimizer_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    folder, weights = write_sharded_checkpoint(tmp_path / "run")
    read: dict[str, int] = {}  # checkpoint key -> bytes read from the shard files
    original = FileSystemReader.read_data

    def recording(self: FileSystemReader, plan, planner):  # type: ignore[no-untyped-def]
        for item in plan.items:
            read[item.storage_index.fqn] = self.storage_data[item.storage_index].length
        return original(self, plan, planner)

    monkeypatch.setattr(FileSystemReader, "read_data", recording)
    model, _ = load_model(folder)
    assert set(read) == {f"model.{name}" for name in weights}  # no optimizer.* entry is read
    stored = FileSystemReader(folder / "state").read_metadata().storage_data.values()
    assert sum(read.values()) < 0.4 * sum(entry.length for entry in stored)  # the model is a third of the bytes
    assert all(torch.equal(model.state_dict()[name], value) for name, value in weights.items())
    read.clear()
    assert sample(str(tmp_path / "run"), "The fox", 5, 0.0, None, 0).startswith("The fox")
    assert read and all(key.startswith("model.") for key in read)


def varied(model: torch.nn.Module) -> torch.nn.Module:
    """A model whose random weights are large enough that its greedy choices vary from token to token."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(std=0.3) if param.dim() > 1 else None
    return model.eval()


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_generation_with_the_kv_cache_equals_full_recomputation_token_for_token(arch: str) -> None:
    config = ModelConfig(arch=arch, n_layer=2, n_embd=32, n_head=4, block_size=16)
    if arch == "llama":
        config.n_kv_head = 2  # grouped-query attention through the cache too
    model = varied(build_model(config))
    fed: list[int] = []  # tokens each forward pass takes
    model.token_embedding.register_forward_hook(lambda module, args, out: fed.append(args[0].shape[1]))
    prompt = [3, 141, 59, 26, 5]
    # 30 new tokens: 11 fill the 16-token window, then it slides.
    recomputed = generate(model, prompt, 30, temperature=0, top_k=None, seed=0, use_cache=False)
    full_cost, fed[:] = sum(fed), []
    cached = generate(model, prompt, 30, temperature=0, top_k=None, seed=0)
    assert cached == recomputed and len(set(cached[len(prompt) :])) > 5
    assert sum(fed) < full_cost and fed[:3] == [5, 1, 1]  # the prompt once, then one token per step

    caches, sequence = new_caches(model), torch.tensor([cached[:16]])
    with torch.no_grad():  # the logits themselves, prompt then token by token, against one pass over all 16
        stepwise = torch.cat(
            [model(sequence[:, :5], caches=caches)]
            + [model(sequence[:, t : t + 1], caches=caches) for t in range(5, 16)],
            1,
        )
        torch.testing.assert_close(stepwise, model(sequence), atol=1e-5, rtol=1e-5)
