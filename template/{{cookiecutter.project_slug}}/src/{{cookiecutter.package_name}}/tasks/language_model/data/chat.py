"""Chat and instruction records -> token ids and a loss mask (which tokens are the assistant's replies).

A record is one .jsonl line, either a conversation or one instruction:

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "response": "..."}          (read as a user message and an assistant reply)

A conversation is rendered by a chat template into one text, which is tokenized as a whole. The
template is the tokenizer's own when it has one: a Hugging Face tokenizer folder whose
tokenizer_config.json (or chat_template.jinja) holds a `chat_template`, rendered with Jinja in a
sandbox as `transformers`' apply_chat_template does. Otherwise (a bare tokenizer.json, or
`--chat_template plain`) it is the plain template:

    <|system|>\\n{content}\\n        for a system message
    <|user|>\\n{content}\\n          for a user message
    <|assistant|>\\n{content}<eos>   for an assistant reply, <eos> the tokenizer's end-of-document token

(the role headers are plain text, not special tokens). Only the tokens of the assistant replies
count in the loss: with a Jinja template, the text that message i adds after the conversation up to
it with the generation prompt (so a reply's end-of-turn token counts, its header does not). A token
counts when its first character is in a reply; a template that does not render a conversation as
an extension of its prefixes is refused. The template sees the tokenizer's special tokens (bos_token,
eos_token, ...) and raise_exception, as in `transformers`; not strftime_now, so that the same records
give the same bytes on any day (Llama 3.1's template then writes its default date).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ....errors import RecipeError

ROLES = ("system", "user", "assistant")
PLAIN = "plain"  # --chat_template plain: the template above, whatever the tokenizer holds
TOKENIZER_CONFIG, TEMPLATE_FILE = "tokenizer_config.json", "chat_template.jinja"
SPECIAL_TOKENS = "special_tokens_map.json"


@dataclass(frozen=True)
class ChatTemplate:
    """How conversations become text: `source` is a Jinja template, or None for the plain template."""

    source: str | None
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    eos_token: str  # the end-of-document token that the plain template ends each reply with

    @property
    def name(self) -> str:
        """What the manifest records: `plain`, or `tokenizer` for the tokenizer's own template."""
        return PLAIN if self.source is None else "tokenizer"

    def render(self, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans [start, end) of its assistant replies."""
        if self.source is None:
            return _render_plain(messages, self.eos_token)
        return _render_jinja(self.source, self.special_tokens, messages)


def _render_plain(messages: list[dict[str, str]], eos_token: str) -> tuple[str, list[tuple[int, int]]]:
    text, replies = "", []
    for message in messages:
        text += f"<|{message['role']}|>\n"
        if message["role"] == "assistant":
            replies.append((len(text), len(text) + len(message["content"]) + len(eos_token)))
            text += message["content"] + eos_token
        else:
            text += message["content"] + "\n"
    return text, replies


def _render_jinja(
    source: str, special_tokens: dict[str, str], messages: list[dict[str, str]]
) -> tuple[str, list[tuple[int, int]]]:
    template = _compiled(source)
    try:
        text = _bounded_render(template, messages, False, special_tokens)
        replies = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = _bounded_render(template, messages[:index], True, special_tokens)
            upto = _bounded_render(template, messages[: index + 1], False, special_tokens)
            if not (text.startswith(upto) and upto.startswith(prompt)):
                raise RecipeError(
                    "the tokenizer's chat template does not render a conversation as an extension of its first"
                    " messages, so the replies cannot be found in it (use --chat_template plain)"
                )
            replies.append((len(prompt), len(upto)))
    except RecipeError:
        raise
    except Exception as error:  # the template's own: raise_exception(), a missing variable
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise RecipeError(f"the tokenizer's chat template failed: {reason}") from None
    return text, replies


# The most characters a template may render for one example, and so the largest string, list or integer (in
# digits) that any step of it may build: far beyond a training example, far below what a machine cannot hold.
MAX_RENDERED_CHARS = 1 << 22


def _too_large() -> RecipeError:
    return RecipeError(
        f"the tokenizer's chat template renders more than {MAX_RENDERED_CHARS:,} characters for one example"
        " (refused: a template that builds outsized text; use --chat_template plain or fix the template)"
    )


def _bounded_render(template: Any, messages: list[dict[str, str]], prompt: bool, special: dict[str, str]) -> str:
    """The template's text, rendered piece by piece and refused once it passes MAX_RENDERED_CHARS."""
    pieces, length = [], 0
    for piece in template.generate(messages=messages, add_generation_prompt=prompt, **special):
        length += len(piece)
        if length > MAX_RENDERED_CHARS:
            raise _too_large()
        pieces.append(piece)
    return "".join(pieces)


def _size(value: Any) -> int:
    """How large a value is for the bound: a sequence's length, an integer's digits (about), else 0."""
    if isinstance(value, (str, bytes, list, tuple, dict)):
        return len(value)
    if isinstance(value, int):
        return value.bit_length() // 3
    return 0


def _check_widths(pattern: Any) -> None:
    """Refuse a format string (`%9999999s`, `{:9999999}`) whose field widths pass the bound: formatting would
    build that much before any check of its result."""
    if isinstance(pattern, str) and any(int(digits) > MAX_RENDERED_CHARS for digits in re.findall(r"\d{7,}", pattern)):
        raise _too_large()


def _checked(result: Any) -> Any:
    if _size(result) > MAX_RENDERED_CHARS:
        raise _too_large()
    return result


def _guarded(function: Any, name: str) -> Any:
    """A filter whose integer arguments (widths, counts), format string and result are held to the bound."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if name == "format" and args:
            _check_widths(args[0])
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > MAX_RENDERED_CHARS:
                raise _too_large()
        return _checked(function(*args, **kwargs))

    return call


_templates: dict[str, Any] = {}


def _compiled(source: str) -> Any:
    """A Jinja template in a sandbox (no attribute access to Python internals), with the helpers chat templates use,
    every operator, call and filter held to MAX_RENDERED_CHARS before it builds its result: `'a' * 10**9` is refused
    without allocating it."""
    if source not in _templates:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class BoundedEnvironment(ImmutableSandboxedEnvironment):
            intercepted_binops = frozenset({"*", "**", "+", "%"})

            def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
                if operator == "*" and isinstance(left, int) and isinstance(right, int):
                    estimate = _size(left) + _size(right)
                elif operator == "*":
                    count = right if isinstance(right, int) else left if isinstance(left, int) else 1
                    estimate = max(_size(left), _size(right)) * max(count, 0)
                elif operator == "%":
                    _check_widths(left)
                    estimate = 0
                elif operator == "**":
                    estimate = _size(left) * abs(right) if isinstance(right, int) else 0
                else:
                    estimate = _size(left) + _size(right)
                if estimate > MAX_RENDERED_CHARS:
                    raise _too_large()
                return super().call_binop(context, operator, left, right)

            def call(self, context: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
                for value in (*args, *kwargs.values()):
                    if isinstance(value, int) and abs(value) > MAX_RENDERED_CHARS:
                        raise _too_large()  # a width or count: str.center(10**9), str.ljust, ...
                if getattr(obj, "__name__", "") in ("format", "format_map"):
                    _check_widths(getattr(getattr(obj, "__wrapped__", obj), "__self__", None))  # the sandbox's wrap
                return _checked(super().call(context, obj, *args, **kwargs))

        def raise_exception(message: str) -> None:
            raise RecipeError(f"the tokenizer's chat template refused a record: {message}")

        environment = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        environment.filters["tojson"] = _tojson
        environment.filters.update({name: _guarded(f, name) for name, f in environment.filters.items()})
        environment.globals["raise_exception"] = raise_exception
        _templates[source] = environment.from_string(source)
    return _templates[source]


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    """Jinja's `tojson` as chat templates expect it (transformers' version: no HTML escaping)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def find_chat_template(tokenizer_path: Path | None, choice: str | None, eos_token: str) -> ChatTemplate:
    """The template of a tokenizer (a folder, or a tokenizer.json whose folder is read): its `chat_template`
    (tokenizer_config.json or chat_template.jinja), else the plain one; `choice` "plain" forces the plain one."""
    if choice not in (None, PLAIN):
        raise RecipeError(f"--chat_template {choice!r}: use plain, or leave it out for the tokenizer's own")
    if tokenizer_path is None:
        return ChatTemplate(None, {}, eos_token)
    folder = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    config_file = folder / TOKENIZER_CONFIG
    config: dict[str, Any] = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except ValueError as error:
            raise RecipeError(f"--tokenizer {str(folder)!r}: unreadable {TOKENIZER_CONFIG} ({error})") from None
    source = config.get("chat_template")
    if (folder / TEMPLATE_FILE).is_file():
        source = (folder / TEMPLATE_FILE).read_text()
    if isinstance(source, list):  # several named templates: the default one
        source = next((entry.get("template") for entry in source if entry.get("name") == "default"), None)
    if (folder / SPECIAL_TOKENS).is_file():  # older folders keep bos_token, eos_token, ... here
        try:
            config = {**json.loads((folder / SPECIAL_TOKENS).read_text()), **config}
        except ValueError as error:
            raise RecipeError(f"--tokenizer {str(folder)!r}: unreadable {SPECIAL_TOKENS} ({error})") from None
    special_tokens = {
        key: value["content"] if isinstance(value, dict) else value
        for key, value in config.items()
        if key.endswith("_token") and isinstance(value, (str, dict))
    }
    if choice == PLAIN or not isinstance(source, str):
        return ChatTemplate(None, special_tokens, eos_token)
    return ChatTemplate(source, special_tokens, eos_token)


def conversation_of(record: Any, where: str) -> list[dict[str, str]]:
    """A record's messages ({"messages": [...]} or {"prompt", "response"}); refuses anything else with one line."""
    if isinstance(record, dict) and "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise RecipeError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise RecipeError(f"{where}: each message needs a role in {', '.join(ROLES)} (found {message!r:.80})")
            if not isinstance(message.get("content"), str):
                raise RecipeError(f"{where}: a {message['role']} message without a text 'content'")
        if not any(message["role"] == "assistant" for message in messages):
            raise RecipeError(f"{where}: no assistant message (nothing to learn from)")
        return [{"role": message["role"], "content": message["content"]} for message in messages]
    if isinstance(record, dict) and isinstance(record.get("prompt"), str) and isinstance(record.get("response"), str):
        return [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]
    keys = ", ".join(record) if isinstance(record, dict) else type(record).__name__
    raise RecipeError(f"{where}: not a chat record (needs 'messages', or 'prompt' and 'response'; found: {keys})")


def read_conversations(path: str, handle: Any) -> Iterator[list[dict[str, str]]]:
    """The conversations of a .jsonl file, in order; blank lines skipped."""
    for number, line in enumerate(handle, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as error:
            raise RecipeError(f"{path}:{number}: not valid JSON ({error})") from None
        yield conversation_of(record, f"{path}:{number}")


def encode_conversation(
    tokenizer: Any, template: ChatTemplate, messages: list[dict[str, str]]
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of a rendered conversation and its loss mask (1 for the tokens of the assistant replies)."""
    text, replies = template.render(messages)
    encoding = tokenizer.encode(text, add_special_tokens=False)
    starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
    mask = np.zeros(len(starts), dtype=np.uint8)
    for start, end in replies:
        mask[(starts >= start) & (starts < end)] = 1
    return np.array(encoding.ids, dtype=np.int64), mask
