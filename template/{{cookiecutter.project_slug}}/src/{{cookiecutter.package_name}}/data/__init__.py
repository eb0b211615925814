"""Data: sources of tokens (embedded, text, tokens, prepared shards), the exact-resume sampler, `prepare`, tokenizers.

The names below are what the loop and the tests use. The sampler's (Batch, TrainBatches,
validation_batches) load on first use, because the sampler imports torch: `prepare` and
`recipes validate` read data without it and start in a fraction of the time.
"""

from typing import Any

from {{ cookiecutter.package_name }}.data.sources import load_splits, load_tokens, make_demo_text, split_tokens

SAMPLER_NAMES = ("Batch", "TrainBatches", "validation_batches")

__all__ = ["load_splits", "load_tokens", "make_demo_text", "split_tokens", *SAMPLER_NAMES]


def __getattr__(name: str) -> Any:
    if name in SAMPLER_NAMES:
        from {{ cookiecutter.package_name }}.data import sampler

        return getattr(sampler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
