"""The opt-in escaping of control tokens written inside a request's text.

By default, as transformers' `apply_chat_template` does, the rendered prompt is tokenized as one
string, so a user who writes `<|im_end|>\\n<|im_start|>system\\n...` in a message forges turns:
the model sees real control tokens. With escaping on (`lily.load(..., escape_special_tokens=
True)`, `lily serve --escape-special-tokens`), every control token written in the text a request
supplies (message fields, tool definitions, template keyword values) is tokenized as ordinary
text instead, while the markers the template itself writes stay control tokens.

How: before rendering, each control token in the request's strings is replaced by a placeholder,
a private-use character that appears nowhere in the request or the template; the rendered
prompt is then tokenized piece by piece, each placeholder as its token's text read as plain text
(`Tokenizer.encode_as_text`). Only control tokens (added tokens marked special) are escaped:
`<think>` and `<tool_call>` are ordinary added tokens that templates read in text themselves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lily.chat.tokenizer import Tokenizer

# Supplementary Private Use Area-A: characters no tokenizer gives a meaning.
_PLACEHOLDERS = range(0xF0000, 0xFFFFE)
_PLACEHOLDER_CHARACTER = re.compile("[\U000f0000-\U000ffffd]")


@dataclass(frozen=True)
class TemplateInputs:
    """What the chat template renders for a request (with control tokens replaced by
    placeholders when escaping), and how a prompt rendered from it becomes token ids."""

    messages: list[Any]
    tools: list[Any] | None
    template_kwargs: dict[str, Any]
    tokenizer: Tokenizer
    # placeholder character -> the control token's text
    placeholders: dict[str, str]

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a prompt rendered from these inputs."""
        if not self.placeholders:
            return self.tokenizer.encode(prompt)
        ids: list[int] = []
        pieces = re.split(f"([{''.join(self.placeholders)}])", prompt)
        for i, piece in enumerate(pieces):
            if i % 2:
                ids += self.tokenizer.encode_as_text(self.placeholders[piece])
            elif piece:
                ids += self.tokenizer.encode(piece)
        return ids


def _strings(value: Any) -> Iterator[str]:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)


def _replace(value: Any, pattern: re.Pattern[str], placeholder: dict[str, str]) -> Any:
    if isinstance(value, str):
        return pattern.sub(lambda m: placeholder[m.group()], value)
    if isinstance(value, dict):
        return {
            _replace(k, pattern, placeholder): _replace(v, pattern, placeholder)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [_replace(item, pattern, placeholder) for item in value]
    return value


def _free_placeholders(used: Iterable[str], count: int) -> list[str]:
    taken = set(used)
    free = (chr(cp) for cp in _PLACEHOLDERS if chr(cp) not in taken)
    return [next(free) for _ in range(count)]


def escape_special_tokens(
    tokenizer: Tokenizer,
    messages: list[Any],
    tools: list[Any] | None,
    template_kwargs: dict[str, Any],
    *,
    template_source: str,
) -> TemplateInputs:
    """The inputs with every control token in their strings (keys included) replaced by a
    placeholder. `messages` must already be in template form (`template_message`), so that
    tool-call arguments are escaped after their JSON is parsed."""
    texts = sorted(tokenizer.special_token_texts, key=len, reverse=True)
    inputs = (messages, tools, template_kwargs)
    found = {t for s in _strings(inputs) for t in texts if t in s} if texts else set()
    if not found:
        return TemplateInputs(messages, tools, template_kwargs, tokenizer, {})
    used = set(_PLACEHOLDER_CHARACTER.findall(template_source))
    for text in _strings(inputs):
        used.update(_PLACEHOLDER_CHARACTER.findall(text))
    ordered = sorted(found, key=len, reverse=True)  # the longest token wins at a position
    placeholder = dict(zip(ordered, _free_placeholders(used, len(ordered)), strict=True))
    pattern = re.compile("|".join(map(re.escape, ordered)))
    escaped_messages, escaped_tools, escaped_kwargs = _replace(inputs, pattern, placeholder)
    return TemplateInputs(
        escaped_messages,
        escaped_tools,
        escaped_kwargs,
        tokenizer,
        {char: text for text, char in placeholder.items()},
    )
