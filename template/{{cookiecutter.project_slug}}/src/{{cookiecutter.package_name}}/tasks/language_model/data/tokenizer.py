"""Tokenizers in the Hugging Face `tokenizers` format: load a tokenizer.json, train a byte-level BPE offline, and
encode documents into one token stream (what `prepare`'s worker processes and Ray tasks run)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ....errors import RecipeError

EOS_TOKEN = "<|endoftext|>"  # what a trained tokenizer uses to end a document (GPT-2's name for it)
# End-of-document tokens of common tokenizers (GPT-2, Llama 2 / Mistral, Llama 3, others), in this order.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>", "<|eos|>")
BYTE_ALPHABET = 256  # a byte-level BPE starts from every byte value
BATCH_CHARS = 1 << 20  # text encoded in one call (sent to a worker): large enough that the transfer costs little


def load_tokenizer(path: Path, option: str = "--tokenizer") -> Tokenizer:
    """A tokenizer.json; refuses a missing or unreadable file with one line."""
    if not path.is_file():
        raise RecipeError(f"{option} {str(path)!r}: no such file (a Hugging Face tokenizer.json)")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as error:  # tokenizers raises a plain Exception whose text spans lines
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise RecipeError(f"{option} {str(path)!r}: not a tokenizers tokenizer.json ({reason})") from None


def eos_id(tokenizer: Tokenizer, where: str) -> tuple[str, int]:
    """The tokenizer's end-of-document token and its id."""
    for token in EOS_CANDIDATES:
        if (token_id := tokenizer.token_to_id(token)) is not None:
            return token, token_id
    raise RecipeError(f"{where}: the tokenizer has no end-of-document token (looked for {', '.join(EOS_CANDIDATES)})")


def vocab_size(tokenizer: Tokenizer) -> int:
    """Ids the tokenizer can produce: its vocabulary including added tokens."""
    return tokenizer.get_vocab_size(with_added_tokens=True)


def train_byte_level_bpe(texts: Iterable[str], size: int, show_progress: bool = False) -> Tokenizer:
    """A GPT-2-style byte-level BPE of at most `size` tokens (fewer when the text has fewer merges), with EOS_TOKEN.

    Byte-level: every string is encodable and decodes back to itself, so prepared data never loses text.
    """
    if size < BYTE_ALPHABET + 1:
        raise RecipeError(
            f"--train_tokenizer {size}: a byte-level BPE needs at least {BYTE_ALPHABET + 1} tokens"
            f" ({BYTE_ALPHABET} bytes + {EOS_TOKEN})"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: list[str], eos: int, dtype: str) -> np.ndarray:
    """Token ids of the documents, each followed by the end-of-document id."""
    # encode_batch_fast (tokenizers >= 0.21) gives the same ids without computing character offsets.
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    encodings = encode(texts, add_special_tokens=False)
    tokens = np.empty(sum(len(encoding.ids) + 1 for encoding in encodings), dtype=dtype)
    position = 0
    for encoding in encodings:
        ids = encoding.ids
        tokens[position : position + len(ids)] = ids
        tokens[position + len(ids)] = eos
        position += len(ids) + 1
    return tokens


def batches(documents: Iterator[str]) -> Iterator[list[str]]:
    """The documents in lists of about BATCH_CHARS characters, in order."""
    batch: list[str] = []
    size = 0
    for text in documents:
        batch.append(text)
        size += len(text)
        if size >= BATCH_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch
