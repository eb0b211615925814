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


def byte_tokenizer() -> Tokenizer:
    """The byte-level sources' (embedded, text) tokenizer in the `tokenizers` format: every byte of the UTF-8 text is
    its own id, as the project reads them (`list(text.encode("utf-8"))`), and decodes back to the text.

    Each byte is a token spelled in GPT-2's byte alphabet (printable characters standing for bytes), one BPE token
    without merges; no regex split and no added tokens, so that no text, whatever characters it holds, encodes
    otherwise. It declares no special token: an end-of-document token would be matched in the text before bytes.
    """
    vocabulary = {character: byte for byte, character in enumerate(byte_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocabulary, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def byte_alphabet() -> list[str]:
    """The character GPT-2's byte-level tokenizers spell each byte value with: itself where it is printable, else
    the next unused character from U+0100 on (the map `pre_tokenizers.ByteLevel` applies)."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}  # "!".."~", "¡".."¬", "®".."ÿ"
    spelled, unused = [], 256
    for byte in range(BYTE_ALPHABET):
        if byte in printable:
            spelled.append(chr(byte))
        else:
            spelled.append(chr(unused))
            unused += 1
    return spelled


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
