"""`sample`: continue a prompt with a trained checkpoint and print the text, to see what the model learned.

The model is built from the checkpoint's own config.yaml and given the checkpoint's model tensors only
(sharded or not; the optimizer state is not read), and generates with a KV cache (families/kv_cache.py).
Text goes in and out through the tokenizer of the prepared folder the run trained on, or as UTF-8 bytes
for the byte-level sources (embedded, text). The command is commands/sample.py; the
checkpoint argument is read by checkpoint/layout.py's `resolve_checkpoint`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...checkpoint.layout import resolve_checkpoint
from ...checkpoint.tensors import load_model
from ...errors import RecipeError
from ...recipe.schema import Recipe
from .families.kv_cache import KVCache, new_caches

MAX_NEW_TOKENS = 100_000  # each token is a forward pass on CPU or GPU: beyond this, a typo (1e20), not a request


def text_codec(recipe: Recipe) -> tuple[Callable[[str], list[int]], Callable[[list[int]], str], int | None]:
    """(encode, decode, end-of-document id) for the data a checkpoint was trained on."""
    if recipe.data.source in ("embedded", "text"):
        return (lambda text: list(text.encode("utf-8"))), _decode_bytes, None
    if recipe.data.source == "prepared":
        from .data.sources import prepared_tokenizer
        from .data.tokenizer import load_tokenizer

        path, manifest = prepared_tokenizer(recipe.data, field="the checkpoint's data.path")  # fetched if remote
        tokenizer = load_tokenizer(path, option="tokenizer")
        return (
            lambda text: tokenizer.encode(text, add_special_tokens=False).ids,
            lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
            manifest["tokenizer"]["eos_id"],
        )
    raise RecipeError(
        f"the checkpoint was trained on data.source={recipe.data.source}, which has no tokenizer to decode with"
        " (sample reads prepared folders and the byte-level sources embedded and text)"
    )


def _decode_bytes(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


@torch.no_grad()
def generate(
    model: Any,
    ids: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    use_cache: bool = True,
) -> list[int]:
    """`ids` continued by `max_new_tokens` sampled tokens (temperature 0: the most likely token each time).

    Each token is predicted from the last block_size tokens. With `use_cache` the blocks keep the keys and values
    of the tokens seen, so each new token costs one token's forward pass; once the context is full the window
    slides, every position moves, and the window is computed again for each token (as without the cache).
    """
    generator = torch.Generator().manual_seed(seed)
    sequence = list(ids)
    block_size = model.config.block_size
    caches: list[KVCache] | None = None
    for _ in range(max_new_tokens):
        if use_cache and caches is not None and caches[0].length < block_size:
            logits = model(torch.tensor([sequence[-1:]]), caches=caches)  # only the newest token: the rest is cached
        else:
            caches = new_caches(model) if use_cache else None
            logits = model(torch.tensor([sequence[-block_size:]]), caches=caches)
        logits = logits[0, -1].float()
        if temperature == 0:
            next_id = logits.argmax().view(1)
        else:
            logits = logits / temperature
            if top_k:
                threshold = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < threshold, float("-inf"))
            next_id = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        sequence.append(int(next_id))
    return sequence


def sample(checkpoint: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int | None, seed: int) -> str:
    """The prompt and its continuation by the model of a checkpoint, as text."""
    if not 1 <= max_new_tokens <= MAX_NEW_TOKENS:
        raise RecipeError(f"--max_new_tokens {max_new_tokens} must be in [1, {MAX_NEW_TOKENS:,}]")
    if temperature < 0:
        raise RecipeError(f"--temperature {temperature:g} must be >= 0 (0: always the most likely token)")
    if top_k is not None and top_k < 1:
        raise RecipeError(f"--top_k {top_k} must be >= 1 (or omitted: no limit)")
    path = resolve_checkpoint(checkpoint)
    model, recipe = load_model(path)
    encode, decode, eos = text_codec(recipe)
    ids = encode(prompt) if prompt else [eos] if eos is not None else encode("\n")
    ids = ids[-recipe.model.block_size :]
    continued = generate(model, ids, max_new_tokens, temperature, top_k, seed)
    return decode(continued[1:] if not prompt and eos is not None else continued)
