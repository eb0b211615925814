"""The language model's data: token sources (embedded, text, tokens, prepared shards), `prepare`, tokenizers."""

from .sources import (
    load_splits,
    load_tokens,
    make_demo_text,
    split_tokens,
)

__all__ = ["load_splits", "load_tokens", "make_demo_text", "split_tokens"]
