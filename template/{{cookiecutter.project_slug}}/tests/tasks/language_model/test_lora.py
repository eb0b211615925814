"""LoRA on 2 CPU processes (gloo): adapters on a saved transformers Llama, trained under ddp and under fsdp2.

One ddp run and one fsdp2 run that is killed after step 3 and resumed: only the adapters change, ddp and fsdp2
give the same losses, the resumed run repeats step 3 bitwise, checkpoints hold the adapters and their optimizer
state only, and both exports (adapters merged; a peft adapter folder) give transformers the project's logits.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from helpers import RECIPES, assert_same_losses, losses_by_run, run_cli, run_overrides, train_losses

from {{ cookiecutter.package_name }}.checkpoint.layout import find_latest
from {{ cookiecutter.package_name }}.checkpoint.load import load_full_state
from {{ cookiecutter.package_name }}.checkpoint.tensors import load_model
from {{ cookiecutter.package_name }}.cli import main

transformers = pytest.importorskip("transformers")  # test dependencies (Python 3.11+)
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

STEPS = 4
RANK = 4
# Adapters on attention's q and v and on the MLP's down projection of both blocks: A and B for each.
TARGETS = ["attn.q", "attn.v", "mlp.down"]
ADAPTERS = 2 * len(TARGETS) * 2
SHARED = [
    "--model.n_layer", "2", "--model.n_embd", "64", "--model.n_head", "4", "--model.n_kv_head", "2",
    "--model.intermediate_size", "96", "--model.block_size", "64", "--lora.rank", str(RANK),
    "--lora.target_modules", f"[{', '.join(TARGETS)}]", "--train.max_steps", str(STEPS), "--train.warmup_steps", "0",
    "--train.micro_batch_size", "4", "--eval.every_steps", "0", "--checkpoint.save_every_steps", "2",
    "--checkpoint.resume", "auto",
]  # fmt: skip


def lora_args(out_dir: Path, *overrides: str) -> list[str]:
    """`train` on the cpu-lora-debug recipe with the shared tiny model."""
    return ["train", "--config", str(RECIPES / "cpu-lora-debug.yaml"), *run_overrides(out_dir, *SHARED, *overrides)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved transformers Llama of the shared shape: the frozen base."""
    folder = tmp_path_factory.mktemp("base") / "hf"
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, base: Path) -> Callable[[str], Path]:
    """name -> out_dir: ddp uninterrupted; fsdp2 killed right after step 3 (saved at step 2), then resumed."""
    out: dict[str, Path] = {}
    for name, strategy in (("ddp", "ddp"), ("fsdp2", "fsdp2")):
        out[name] = tmp_path_factory.mktemp(name)
        args = lora_args(out[name], "--model.init_from", str(base), "--strategy.name", strategy)
        if name == "fsdp2":
            killed = run_cli(*args, fault="kill-at-step:3")
            assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
        result = run_cli(*args)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Started from the weights of" in result.stdout
    return out.__getitem__


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def last_checkpoint(out_dir: Path) -> Path:
    latest = find_latest(out_dir / "checkpoints")
    assert latest is not None and latest.name == f"step-{STEPS:08d}"
    return latest


def test_ddp_and_fsdp2_train_the_adapters_to_the_same_losses_and_a_resume_repeats_its_step(
    runs: Callable[[str], Path],
) -> None:
    reference = train_losses(runs("ddp"))
    assert sorted(reference) == list(range(1, STEPS + 1)) and reference[STEPS] < reference[1]
    before, after = losses_by_run(runs("fsdp2"))
    assert sorted(before) == [1, 2, 3] and sorted(after) == [3, 4]
    # Resumed from step 2's adapters and optimizer state on init_from's base: step 3 again, bitwise. Had the base
    # moved in steps 1-2 of the killed run, its step 3 would have seen another model than the resumed run's.
    assert after[3] == before[3]
    assert_same_losses({**before, **after}, reference, tolerance=1e-4)


@pytest.mark.parametrize("name", ["ddp", "fsdp2"])
def test_only_the_adapters_train_and_the_checkpoint_holds_only_them(
    runs: Callable[[str], Path], base: Path, name: str
) -> None:
    checkpoint = last_checkpoint(runs(name))
    state = load_full_state(checkpoint)
    saved = state["model"]
    assert len(saved) == ADAPTERS and all(".lora_A." in key or ".lora_B." in key for key in saved)
    assert all(any(f".{target}.lora_" in key for target in TARGETS) for key in saved)
    moments = [value for entry in state["optimizer"]["state"].values() for value in entry.values() if value.dim()]
    assert len(moments) == 2 * ADAPTERS  # AdamW's two moments of each adapter matrix, nothing else
    assert sum(map(nbytes, moments)) == 2 * sum(map(nbytes, saved.values()))
    state_bytes = sum(file.stat().st_size for file in (checkpoint / "state").rglob("*") if file.is_file())
    assert state_bytes < sum(file.stat().st_size for file in base.glob("*.safetensors"))  # less than the base alone

    model, _ = load_model(checkpoint)  # the base from init_from, the adapters from the checkpoint
    pretrained = transformers.LlamaForCausalLM.from_pretrained(base).state_dict()
    adapted = model.state_dict()
    assert torch.equal(
        adapted["blocks.1.attn.q.base_layer.weight"], pretrained["model.layers.1.self_attn.q_proj.weight"]
    )
    assert torch.equal(adapted["token_embedding.weight"], pretrained["model.embed_tokens.weight"])
    assert all(adapted[key].abs().sum() > 0 for key in saved)  # B started at zero: the adapters have learned


def test_the_exports_give_transformers_the_logits_of_the_model_with_adapters(
    runs: Callable[[str], Path], base: Path, tmp_path: Path
) -> None:
    checkpoint = last_checkpoint(runs("fsdp2"))
    model, _ = load_model(checkpoint)
    main(["export", str(checkpoint), str(tmp_path / "merged")])
    main(["export", str(checkpoint), str(tmp_path / "adapters"), "--format", "peft"])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(base)
    with_adapters = peft.PeftModel.from_pretrained(pretrained, tmp_path / "adapters").eval()
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        expected = model(tokens)
        torch.testing.assert_close(merged(tokens).logits, expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(with_adapters(tokens).logits, expected, atol=1e-5, rtol=0)
        with with_adapters.disable_adapter():  # the base alone: the adapters matter
            assert (with_adapters(tokens).logits - expected).abs().max() > 1e-3


@pytest.mark.matrix  # the merged export of the Llama above shows the merge; this adds the GPT and a random base
def test_a_gpt_with_adapters_on_a_random_base_checkpoints_both_and_exports_them_merged(tmp_path: Path) -> None:
    # No init_from: the base is the seed's, so the checkpoint holds it beside the adapters. GPT-2's layout fuses
    # q, k and v into one c_attn: each part is merged before they are joined.
    gpt = ["--model.arch", "gpt", "--model.bias", "true", "--model.n_kv_head", "0", "--model.intermediate_size", "0"]
    gpt += ["--model.n_head", "4", "--lora.target_modules", "[attn.q, attn.v, mlp.fc]", "--devices", "1"]
    gpt += ["--train.max_steps", "2", "--train.learning_rate", "0.01"]
    result = run_cli(*lora_args(tmp_path, *gpt))
    assert result.returncode == 0, result.stderr[-3000:]
    checkpoint = find_latest(tmp_path / "checkpoints")
    assert checkpoint is not None
    saved = load_full_state(checkpoint)["model"]
    assert "blocks.0.attn.q.base_layer.weight" in saved and "blocks.0.attn.q.base_layer.bias" in saved
    assert "blocks.0.attn.k.weight" in saved and sum(".lora_" in key for key in saved) == 2 * 3 * 2
    model, _ = load_model(checkpoint)
    main(["export", str(checkpoint), str(tmp_path / "merged")])
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tokens = torch.randint(0, 256, (2, 64))
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens).logits, model(tokens), atol=1e-5, rtol=0)
