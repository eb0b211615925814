"""Data: sources of tokens (embedded, text, tokens, prepared shards), the exact-resume sampler, `prepare`, tokenizers.

The names below are what the loop and the tests use; `prepare` and `tokenizer` need the optional
`tokenizers`/`pyarrow` imports and are imported from their modules where used.
"""

from {{ cookiecutter.package_name }}.data.sampler import Batch, TrainBatches, validation_batches
from {{ cookiecutter.package_name }}.data.sources import load_splits, load_tokens, make_demo_text, split_tokens

__all__ = [
    "Batch",
    "TrainBatches",
    "load_splits",
    "load_tokens",
    "make_demo_text",
    "split_tokens",
    "validation_batches",
]
