"""Supervised fine-tuning data: the loss counts the replies only, packed examples do not see each other, and
`prepare --format sft` turns chat and instruction records into examples with the right loss mask."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import RECIPES, fail_with
from tokenizers import Tokenizer

from {{ cookiecutter.package_name }}.tasks.base import batch_loss
from {{ cookiecutter.package_name }}.tasks.language_model.config import DataConfig, LanguageModelRecipe, ModelConfig
from {{ cookiecutter.package_name }}.tasks.language_model.data.prepare import prepare
from {{ cookiecutter.package_name }}.tasks.language_model.data.sft import IGNORE_INDEX, Examples, ExampleSequences
from {{ cookiecutter.package_name }}.tasks.language_model.data.tokenizer import train_byte_level_bpe
from {{ cookiecutter.package_name }}.tasks.language_model.families import build_model
from {{ cookiecutter.package_name }}.tasks.language_model.task import LanguageModel

GPT = ModelConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
LLAMA = ModelConfig(arch="llama", vocab_size=32, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                    intermediate_size=48)  # fmt: skip

# Three examples: token ids, and 1 where a token is a reply's (counts in the loss when predicted).
EXAMPLES = [
    ([1, 2, 3, 4, 5], [0, 0, 1, 1, 1]),
    ([6, 7, 8, 9, 10, 11], [0, 0, 0, 1, 1, 0]),
    ([12, 13, 14, 15], [0, 1, 0, 1]),
]


def examples(chosen: list[tuple[list[int], list[int]]] = EXAMPLES) -> Examples:
    offsets = np.cumsum([0, *(len(tokens) for tokens, _ in chosen)])
    tokens = np.concatenate([np.array(tokens) for tokens, _ in chosen]).astype(np.uint16)
    mask = np.concatenate([np.array(mask) for _, mask in chosen]).astype(np.uint8)
    return Examples(tokens, mask, offsets.astype(np.int64))


def sft_task(model: ModelConfig) -> LanguageModel:
    return LanguageModel(LanguageModelRecipe(model=model, data=DataConfig(format="sft")))


def test_targets_count_only_reply_tokens_and_the_loss_is_their_mean() -> None:
    torch.manual_seed(0)
    model = build_model(GPT).eval()
    sequences = ExampleSequences(examples(), block_size=16, packing=True)
    assert len(sequences) == 1  # 4 + 5 + 3 positions fit in 16
    inputs, targets, documents = sequences.batch([0])
    ignored = IGNORE_INDEX
    # Example 1 predicts 2..5 (3, 4, 5 count), example 2 predicts 7..11 (9, 10 count), example 3 13..15 (13, 15).
    assert targets[0].tolist() == [ignored, 3, 4, 5, ignored, ignored, 9, 10, ignored, 13, ignored, 15] + [ignored] * 4
    assert inputs[0, :12].tolist() == [1, 2, 3, 4, 6, 7, 8, 9, 10, 12, 13, 14]
    assert documents[0].tolist() == [0] * 4 + [1] * 5 + [2] * 3 + [-1] * 4

    loss = batch_loss(sft_task(GPT), model, (inputs, targets, documents)).task_loss
    with torch.no_grad():
        logits = model(inputs, documents=documents)[0].double()
    by_hand = []
    for position, target in enumerate(targets[0].tolist()):
        if target != ignored:
            row = logits[position].tolist()
            by_hand.append(math.log(sum(math.exp(value) for value in row)) - row[target])
    assert len(by_hand) == 7
    assert loss.item() == pytest.approx(sum(by_hand) / len(by_hand), rel=1e-6)


def test_a_batch_without_a_counted_target_has_loss_zero_not_nan() -> None:
    model = build_model(GPT)
    sequences = ExampleSequences(examples([([1, 2, 3], [1, 0, 0])]), block_size=16, packing=True)
    assert batch_loss(sft_task(GPT), model, sequences.batch([0])).task_loss.item() == 0.0


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_packed_and_unpacked_batches_give_the_same_loss(config: ModelConfig) -> None:
    torch.manual_seed(0)
    model = build_model(config).eval()
    task = sft_task(config)
    packed = ExampleSequences(examples(), block_size=16, packing=True)
    unpacked = ExampleSequences(examples(), block_size=16, packing=False)
    assert (len(packed), len(unpacked)) == (1, 3)
    with torch.no_grad():
        packed_loss = batch_loss(task, model, packed.batch([0])).task_loss
        unpacked_loss = batch_loss(task, model, unpacked.batch([0, 1, 2])).task_loss
    torch.testing.assert_close(packed_loss, unpacked_loss, rtol=1e-6, atol=1e-6)
    # Example 2's logits in the pack are its logits alone in a row (positions restart at each example).
    inputs, _, documents = packed.batch([0])
    alone, _ = unpacked.batch([1])
    with torch.no_grad():
        in_pack = model(inputs, documents=documents)[0, 4:9]
        by_itself = model(alone)[0, :5]
    torch.testing.assert_close(in_pack, by_itself, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [GPT, LLAMA], ids=["gpt", "llama"])
def test_an_example_in_a_pack_does_not_see_the_examples_before_it(config: ModelConfig) -> None:
    torch.manual_seed(0)
    model = build_model(config).eval()
    changed = [([20, 21, 22, 23, 24], EXAMPLES[0][1]), *EXAMPLES[1:]]
    first = ExampleSequences(examples(), block_size=16, packing=True).batch([0])
    second = ExampleSequences(examples(changed), block_size=16, packing=True).batch([0])
    with torch.no_grad():
        logits = [model(batch[0], documents=batch[2])[0] for batch in (first, second)]
        without_mask = [model(batch[0])[0] for batch in (first, second)]
    assert not torch.equal(logits[0][:4], logits[1][:4])  # example 1 itself changed
    assert torch.equal(logits[0][4:12], logits[1][4:12])  # examples 2 and 3: not a bit of difference
    assert not torch.allclose(without_mask[0][4:12], without_mask[1][4:12])  # plain causal attention would leak


# --- prepare --format sft ------------------------------------------------------------------------------------

RECORDS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."},
                  {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"},
                  {"role": "assistant", "content": "Hi again."}]},
    {"prompt": "What is one plus one?", "response": "Two."},
    {"prompt": "Name a colour.", "response": "Blue."},
    {"messages": [{"role": "user", "content": "Count to two."}, {"role": "assistant", "content": "One two."}]},
]  # fmt: skip
REPLIES = [["Hi.", "Hi again."], ["Two."], ["Blue."], ["One two."]]


def jinja(text: str) -> str:
    """Jinja's delimiters from <% %> and << >>: the project's files hold no template syntax (they come from one)."""
    opening, closing = "{", "}"
    pairs = {"<%": opening + "%", "%>": "%" + closing, "<<": opening * 2, ">>": closing * 2}
    for spelled, delimiter in pairs.items():
        text = text.replace(spelled, delimiter)
    return text


CHATML = jinja(
    "<% for message in messages %><|im_start|><< message['role'] >>\n<< message['content'] >><|im_end|>\n<% endfor %>"
    "<% if add_generation_prompt %><|im_start|>assistant\n<% endif %>"
)


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face tokenizer folder: a byte-level BPE with ChatML's special tokens, and a chat template."""
    folder = tmp_path_factory.mktemp("tokenizer")
    texts = [json.dumps(record) for record in RECORDS] * 4
    tokenizer = train_byte_level_bpe(texts, 300)
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chat") / "chat.jsonl"
    path.write_text("".join(json.dumps(record) + "\n" for record in RECORDS))
    return path


def prepared_replies(folder: Path) -> tuple[dict, list[str], list[np.ndarray]]:
    """The manifest, the text of each example's counted tokens and each example's token ids."""
    manifest = json.loads((folder / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokens = np.concatenate(
        [np.fromfile(folder / shard["file"], dtype=manifest["dtype"]) for shard in manifest["shards"]]
    )
    mask = np.concatenate([np.fromfile(folder / part["file"], dtype=np.uint8) for part in manifest["sft"]["loss_mask"]])
    offsets = np.fromfile(folder / "examples.bin", dtype=np.int64)
    ids = [tokens[offsets[i] : offsets[i + 1]] for i in range(len(offsets) - 1)]
    counted = [
        tokenizer.decode(tokens[offsets[i] : offsets[i + 1]][mask[offsets[i] : offsets[i + 1]] == 1].tolist(),
                         skip_special_tokens=False)
        for i in range(len(offsets) - 1)
    ]  # fmt: skip
    return manifest, counted, ids


def test_prepare_sft_without_a_chat_template_uses_the_plain_one(
    tmp_path: Path, records: Path, tokenizer_folder: Path
) -> None:
    out = tmp_path / "sft"
    manifest = prepare([str(records)], str(out), tokenizer_file=str(tokenizer_folder / "tokenizer.json"),
                       format="sft", chat_template="plain", val_fraction=0.25, progress=False)  # fmt: skip
    manifest, counted, ids = prepared_replies(out)
    assert manifest["sft"]["chat_template"] == "plain" and manifest["documents"] == 4
    assert counted == ["".join(reply + "<|endoftext|>" for reply in replies) for replies in REPLIES]
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.decode(ids[1].tolist(), skip_special_tokens=False) == (
        "<|user|>\nWhat is one plus one?\n<|assistant|>\nTwo.<|endoftext|>"
    )
    assert manifest["validation"] == {"fraction": 0.25, "first_token": int(sum(map(len, ids[:3]))),
                                      "tokens": len(ids[3]), "documents": 1, "first_example": 3}  # fmt: skip
    assert manifest["sft"]["loss_tokens"] == sum(len(tokenizer.encode(text).ids) for text in counted)


def test_prepare_sft_with_a_tokenizer_folder_uses_its_chat_template(
    tmp_path: Path, records: Path, tokenizer_folder: Path
) -> None:
    out = tmp_path / "sft"
    prepare([str(records)], str(out), tokenizer_file=str(tokenizer_folder), format="sft", progress=False)
    manifest, counted, ids = prepared_replies(out)
    assert manifest["sft"]["chat_template"] == "tokenizer" and manifest["sft"]["template_source"] == CHATML
    # A reply counts with its end-of-turn marker, not its header.
    assert counted == ["".join(reply + "<|im_end|>\n" for reply in replies) for replies in REPLIES]
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tokenizer.decode(ids[1].tolist(), skip_special_tokens=False) == (
        "<|im_start|>user\nWhat is one plus one?<|im_end|>\n<|im_start|>assistant\nTwo.<|im_end|>\n"
    )


def test_the_chat_template_renders_as_transformers_does(tmp_path: Path, records: Path, tokenizer_folder: Path) -> None:
    transformers = pytest.importorskip("transformers")  # a test dependency (Python 3.11+)
    out = tmp_path / "sft"
    prepare([str(records)], str(out), tokenizer_file=str(tokenizer_folder), format="sft", progress=False)
    _, _, ids = prepared_replies(out)
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer_folder))
    for record, example in zip(RECORDS, ids, strict=True):
        messages = record.get("messages") or [
            {"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}
        ]  # fmt: skip
        expected = reference.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert example.tolist() == list(expected)


def test_a_record_that_is_not_chat_is_refused_in_one_line_and_nothing_is_written(
    tmp_path: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[1]) + "\n" + json.dumps({"text": "plain text"}) + "\n")
    out = tmp_path / "sft"
    argv = ["prepare", str(path), "--tokenizer", str(tokenizer_folder), "--format", "sft", "--out", str(out)]
    err = fail_with(argv, capsys)
    assert "bad.jsonl:2" in err and "'messages', or 'prompt' and 'response'" in err and "text" in err
    assert not out.exists() and not list(tmp_path.glob("sft*"))


def test_data_format_sft_refuses_a_token_stream_folder_and_a_text_source(
    tmp_path: Path, records: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recipe = str(RECIPES / "cpu-sft-debug.yaml")
    err = fail_with(["train", "--config", recipe, "--data.source", "text", "--data.path", str(tmp_path)], capsys)
    assert "data.format=sft" in err and "data.source must be prepared" in err and "not text" in err
    stream, text = tmp_path / "stream", tmp_path / "text.txt"
    text.write_text("Some plain text. " * 20)
    prepare([str(text)], str(stream), tokenizer_file=str(tokenizer_folder / "tokenizer.json"), progress=False)
    overrides = ["--data.source", "prepared", "--data.path", str(stream), "--model.vocab_size", "320"]
    err = fail_with(["train", "--config", recipe, *overrides, "--out_dir", str(tmp_path / "run")], capsys)
    assert "holds a token stream, not chat examples" in err and "prepare --format sft" in err


@pytest.mark.parametrize(
    "template",
    [
        jinja("<< 'a' * 300000000 >>"),
        jinja("<< 'a'|center(300000000) >>"),
        jinja("<< '{:300000000}'.format('a') >>"),
        jinja(
            "<% set ns = namespace(s='ab') %><% for i in range(40) %><% set ns.s = ns.s + ns.s %><% endfor %><< ns.s >>"
        ),
        jinja("<% for i in range(100000) %><% for m in messages %><< m.content * 1000 >><% endfor %><% endfor %>"),
    ],
    ids=["a repeated string", "a padding filter", "a format width", "doubling in a loop", "output without end"],
)
def test_a_chat_template_that_builds_outsized_text_is_refused_in_one_line_in_bounded_memory(
    template: str, tmp_path: Path, records: Path, tokenizer_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil
    import tracemalloc

    folder = tmp_path / "tokenizer"
    shutil.copytree(tokenizer_folder, folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<|endoftext|>"}))
    out = tmp_path / "sft"
    tracemalloc.start()
    try:
        err = fail_with(
            ["prepare", str(records), "--tokenizer", str(folder), "--format", "sft", "--out", str(out)], capsys
        )
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "the tokenizer's chat template renders more than 4,194,304 characters for one example" in err
    assert peak < 200e6  # the bound is 4 Mi characters: no step builds the 300 MB the template asks for
    assert not out.exists() and not list(tmp_path.glob("sft*"))
