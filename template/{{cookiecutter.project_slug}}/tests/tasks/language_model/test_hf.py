"""The Hugging Face round trip on CPU, fp32, tiny shapes: a Llama made by transformers imports with the same logits,
an export loads in transformers with the same logits, export(import(x)) is x, and bad folders get one line, exit 2."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from corpus import write_corpus
from helpers import RECIPES, fail_with, train_args
from lm_eval_task import TASK, write_task
from safetensors.torch import load_file
from tokenizers import Tokenizer

from {{ cookiecutter.package_name }}.cli import main
from {{ cookiecutter.package_name }}.recipe.load import dump_recipe, load_recipe
from {{ cookiecutter.package_name }}.tasks.language_model.config import DataConfig, ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.config import LanguageModelRecipe as Recipe
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare
from {{ cookiecutter.package_name }}.tasks.language_model.export import export_hf
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model
from {{ cookiecutter.package_name }}.tasks.language_model.hf import check_init_from, pretrained_tensors
from {{ cookiecutter.package_name }}.tasks.language_model.sample import text_codec

transformers = pytest.importorskip("transformers")  # a test dependency (Python 3.11+)

# The same tiny Llama in both vocabularies: 4 query heads sharing 2 key/value heads, Llama 3's RoPE base.
LLAMA = {"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64}
LLAMA |= {"intermediate_size": 96, "rope_theta": 500000.0}
LLAMA_ARGS = [  # cpu-debug's GPT has biases, a GPT-only field: back to its default for the Llama
    "--model.arch", "llama", "--model.bias", "false", "--model.n_head", "4", "--model.n_kv_head", "2", "--model.intermediate_size", "96",
    "--model.rope_theta", "500000", "--model.block_size", "32",
]  # fmt: skip


def save_hf_llama(folder: Path, tie: bool = False, **changes: object) -> Path:
    """A randomly initialised LlamaForCausalLM of the LLAMA shape, saved by transformers (no download)."""
    shape = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 32, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    config = transformers.LlamaConfig(**{**shape, "tie_word_embeddings": tie, **changes})
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def imported(folder: Path, tie: bool = False) -> tuple[torch.nn.Module, ModelConfig]:
    """The project's Llama with an init_from folder's weights."""
    config = ModelConfig(arch="llama", tie_embeddings=tie, init_from=str(folder), **LLAMA)
    check_init_from(config)
    model = build_model(config)
    model.load_state_dict(dict(pretrained_tensors(config)))
    return model.eval(), config


def save_checkpoint(model: torch.nn.Module, config: ModelConfig, folder: Path, data: DataConfig | None = None) -> Path:
    """A checkpoint folder as a one-process run writes it (whole state, config.yaml, meta.json)."""
    folder.mkdir(parents=True)
    torch.save({"model": model.state_dict(), "step": 1}, folder / "state")
    (folder / "config.yaml").write_text(dump_recipe(Recipe(model=config, data=data or DataConfig())))
    (folder / "meta.json").write_text(json.dumps({"step": 1, "tokens_seen": 0, "strategy": "ddp", "world_size": 1}))
    return folder


def logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        output = model(tokens)
    return getattr(output, "logits", output)


@pytest.mark.parametrize("tie", [False, True])
def test_a_llama_saved_by_transformers_imports_with_the_same_logits(tmp_path: Path, tie: bool) -> None:
    folder = save_hf_llama(tmp_path / "hf", tie=tie)
    model, _ = imported(folder, tie)
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    tokens = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(logits(model, tokens), logits(reference, tokens), atol=1e-5, rtol=0)


def test_export_of_an_import_is_the_same_tensors_and_loads_in_transformers(tmp_path: Path) -> None:
    folder = save_hf_llama(tmp_path / "hf")
    model, config = imported(folder)
    checkpoint = save_checkpoint(model, config, tmp_path / "run" / "step-00000001")  # its recipe names init_from
    original = load_file(folder / "model.safetensors")
    shutil.rmtree(folder)  # the weights are in the checkpoint now: export does not need init_from's folder
    exported = tmp_path / "exported"
    summary = export_hf(checkpoint, exported, max_shard_bytes=100_000)
    assert summary["files"] > 1 and (exported / "model.safetensors.index.json").is_file()  # split, with an index
    index = json.loads((exported / "model.safetensors.index.json").read_text())["weight_map"]
    again = {name: value for file in set(index.values()) for name, value in load_file(exported / file).items()}
    assert again.keys() == original.keys()
    assert all(torch.equal(again[name], original[name]) for name in original)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    tokens = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(logits(reloaded, tokens), logits(model, tokens), atol=1e-5, rtol=0)


def test_a_run_on_prepared_data_exports_its_tokenizer(tmp_path: Path) -> None:
    documents = write_corpus(tmp_path / "raw")
    manifest = prepare([str(tmp_path / "raw")], str(tmp_path / "prepared"), train_tokenizer=300, progress=False)
    config = ModelConfig(arch="llama", **{**LLAMA, "vocab_size": 320})
    data = DataConfig(source="prepared", path=str(tmp_path / "prepared"))
    checkpoint = save_checkpoint(build_model(config), config, tmp_path / "run" / "step-00000001", data)
    assert export_hf(checkpoint, tmp_path / "hf")["tokenizer"]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    reference = Tokenizer.from_file(str(tmp_path / "prepared" / "tokenizer.json"))
    text = documents[0][:300]
    assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text).ids
    eos_id = manifest["tokenizer"]["eos_id"]
    assert tokenizer.eos_token_id == eos_id == json.loads((tmp_path / "hf" / "config.json").read_text())["eos_token_id"]


def gpt_checkpoint(folder: Path, bias: bool) -> tuple[torch.nn.Module, Path]:
    config = ModelConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=32, bias=bias)
    torch.manual_seed(0)
    model = build_model(config).eval()
    with torch.no_grad():  # biases start at zero: give them values so that a wrong mapping shows
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.1)
    return model, save_checkpoint(model, config, folder)


def test_a_gpt_with_biases_exports_to_gpt2s_layout_with_the_same_logits(tmp_path: Path) -> None:
    model, checkpoint = gpt_checkpoint(tmp_path / "run" / "step-00000001", bias=True)
    main(["export", str(checkpoint), str(tmp_path / "gpt2")])
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "gpt2").eval()
    assert type(reference).__name__ == "GPT2LMHeadModel"
    tokens = torch.randint(0, 256, (2, 32))
    torch.testing.assert_close(logits(reference, tokens), logits(model, tokens), atol=1e-5, rtol=0)


def test_the_demo_recipes_model_exports_and_loads_in_transformers_with_the_same_logits(tmp_path: Path) -> None:
    config = load_recipe(RECIPES / "cpu-debug.yaml").model  # the model `train --config recipes/cpu-debug.yaml` trains
    torch.manual_seed(0)
    model = build_model(config).eval()
    with torch.no_grad():  # biases start at zero: give them values so that a wrong mapping shows
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(std=0.1)
    main(["export", str(save_checkpoint(model, config, tmp_path / "run" / "step-00000001")), str(tmp_path / "hf")])
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size))
    torch.testing.assert_close(logits(reference, tokens), logits(model, tokens), atol=1e-5, rtol=0)


def test_the_demo_runs_export_gives_every_tool_the_projects_ids_logits_and_scores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run on the embedded demo text (bytes) exports a tokenizer: AutoTokenizer encodes to the project's ids,
    AutoModelForCausalLM gives its logits, and lm-eval's Hugging Face backend scores it as `evaluate` does."""
    lm_eval = pytest.importorskip("lm_eval")  # the eval extra
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")

    config = load_recipe(RECIPES / "cpu-debug.yaml").model
    torch.manual_seed(0)
    model = build_model(config).eval()
    checkpoint = save_checkpoint(model, config, tmp_path / "run" / "step-00000001")
    main(["export", str(checkpoint), str(tmp_path / "hf")])
    assert "prefix_token_id=10" in capsys.readouterr().out
    encode, _, _ = text_codec(Recipe(model=config))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "The fox sees the river.\nNa\u00efve caf\u00e9 \u010a\u00a0\u65e5\u672c <|endoftext|>\x00"  # \u010a: byte 10's alias
    ids = tokenizer(text)["input_ids"]
    assert ids == encode(text) and tokenizer.decode(ids, skip_special_tokens=True) == text
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.tensor([ids[: config.block_size]])
    torch.testing.assert_close(logits(reference, tokens), logits(model, tokens), atol=1e-5, rtol=0)
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "hf")
    assert generation.bos_token_id == generation.pad_token_id == encode("\n")[0]

    tasks = write_task(tmp_path / "tasks")
    scored = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32,prefix_token_id=10",  # as `export` says
        tasks=[TASK],
        task_manager=lm_eval_tasks.TaskManager(include_path=str(tasks), include_defaults=False),
        device="cpu",
        batch_size=4,
        limit=4,
        bootstrap_iters=0,
    )
    main(["evaluate", str(checkpoint), "--tasks", TASK, "--include_path", str(tasks), "--limit", "4"])
    ours = json.loads(checkpoint.with_name(checkpoint.name + ".eval.json").read_text())
    assert scored["results"][TASK]["acc,none"] == ours["results"][TASK]["acc,none"]


def test_a_gpt_without_biases_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, checkpoint = gpt_checkpoint(tmp_path / "run" / "step-00000001", bias=False)
    error = fail_with(["export", str(checkpoint), str(tmp_path / "gpt2")], capsys)
    assert "model.bias=false" in error and "GPT2LMHeadModel" in error
    assert not (tmp_path / "gpt2").exists()


def test_export_refuses_a_folder_that_is_not_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, checkpoint = gpt_checkpoint(tmp_path / "run" / "step-00000001", bias=True)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "mine.txt").write_text("keep")
    assert "is not empty" in fail_with(["export", str(checkpoint), str(tmp_path / "out")], capsys)


def test_export_says_it_cannot_read_deepspeeds_own_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, checkpoint = gpt_checkpoint(tmp_path / "run" / "step-00000001", bias=True)
    meta = json.loads((checkpoint / "meta.json").read_text())
    (checkpoint / "meta.json").write_text(json.dumps({**meta, "strategy": "deepspeed"}))
    assert "in its own layout" in fail_with(["export", str(checkpoint), str(tmp_path / "out")], capsys)


def write_gpt2_folder(folder: Path) -> Path:
    config = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    return folder


def wrong_tensor_shape(folder: Path) -> Path:
    """A Llama folder whose config.json says what the recipe says, but whose MLP tensors are narrower."""
    save_hf_llama(folder, intermediate_size=80)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    return folder


def index_outside_the_folder(folder: Path) -> Path:
    """A Llama folder whose index names a weight file elsewhere (by an absolute path; a real file there)."""
    save_hf_llama(folder)
    elsewhere = folder.parent / "elsewhere.safetensors"
    (folder / "model.safetensors").rename(elsewhere)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": str(elsewhere)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def index_through_a_link(folder: Path) -> Path:
    """As above, through a link inside the folder that points out of it."""
    index_outside_the_folder(folder)
    (folder / "weights.safetensors").symlink_to(folder.parent / "elsewhere.safetensors")
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "weights.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def header_claiming_two_to_the_63(folder: Path) -> Path:
    """A Llama folder whose model.safetensors' header length says 2**63 bytes (read, it would be allocated)."""
    save_hf_llama(folder)
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 63) + b"{}")
    return folder


@pytest.mark.parametrize(
    ("make", "recipe_changes", "message"),
    [
        (lambda folder: folder / "missing", [], "no such folder"),
        (index_outside_the_folder, [], "weight_map names '/"),
        (index_through_a_link, [], "weight_map names 'weights.safetensors', outside the folder (refused)"),
        (
            header_claiming_two_to_the_63,
            [],
            "its header claims 9,223,372,036,854,775,808 bytes, more than the file's 10",
        ),
        (write_gpt2_folder, [], "holds a GPT2LMHeadModel model; init_from reads LlamaForCausalLM folders"),
        (save_hf_llama, ["--model.n_layer", "3"], "num_hidden_layers=2 but model.n_layer=3"),
        (save_hf_llama, ["--model.n_kv_head", "4"], "num_key_value_heads=2 but model.n_kv_head=4"),
        (
            wrong_tensor_shape,
            [],
            "model.layers.0.mlp.gate_proj.weight has shape [80, 64], the recipe's model needs [96, 64]",
        ),
    ],
)
def test_an_init_from_folder_that_does_not_fit_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make, recipe_changes: list[str], message: str
) -> None:
    folder = make(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bars
    argv = train_args(tmp_path / "run", *LLAMA_ARGS, "--model.init_from", str(folder), *recipe_changes)
    assert message in fail_with(argv, capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--model.n_kv_head", "2"], "model.n_kv_head applies only to model.arch=llama"),
        ([*LLAMA_ARGS, "--model.bias", "true"], "model.bias applies only to model.arch=gpt"),
        ([*LLAMA_ARGS, "--model.n_kv_head", "3"], "model.n_kv_head=3 does not divide model.n_head=4"),
        ([*LLAMA_ARGS, "--model.n_head", "8", "--model.n_kv_head", "0", "--model.n_embd", "40"], "must be even"),
        ([*LLAMA_ARGS, "--strategy.fsdp2.tensor_parallel_size", "2", "--model.n_kv_head", "1"], "model.n_kv_head=1"),
    ],
)
def test_llama_fields_and_shapes_are_checked_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], overrides: list[str], message: str
) -> None:
    assert message in fail_with(train_args(tmp_path / "run", *overrides), capsys)
