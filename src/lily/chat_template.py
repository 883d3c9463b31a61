"""Rendering the checkpoint's own chat template, the way transformers renders it.

The template ships with the checkpoint (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`) and is rendered as it is: Lily never re-implements the model's chat
format by hand. To produce byte-identical prompts it reproduces the jinja2 environment of
transformers' `apply_chat_template`: a sandboxed, immutable environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a no-op `{% generation %}` block, the
`raise_exception` and `strftime_now` globals and transformers' `tojson` filter (no HTML escaping,
non-ASCII kept, optional indent).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template is missing, or refused the conversation (its `raise_exception`)."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's tokens for training masks
    in transformers; for inference it only renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own `tojson` HTML-escapes `<`, `>`, `&` and `'`, which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped message as chat templates expect it.

    OpenAI clients send tool-call arguments as a JSON string; templates iterate them as a mapping
    (transformers documents dicts), so the string is parsed. The caller's message is not changed.
    """
    out = dict(message)
    calls = out.get("tool_calls")
    if calls:
        converted = []
        for call in calls:
            call = dict(call)
            function = call.get("function")
            if isinstance(function, Mapping) and isinstance(function.get("arguments"), str):
                function = dict(function)
                text = function["arguments"]
                try:
                    function["arguments"] = json.loads(text) if text.strip() else {}
                except json.JSONDecodeError as e:
                    raise ChatTemplateError(
                        f"tool call arguments are not valid JSON: {text!r} ({e})"
                    ) from None
                call["function"] = function
            converted.append(call)
        out["tool_calls"] = converted
    return out


class ChatTemplate:
    """One compiled chat template.

    `render` takes OpenAI-shaped messages and tools and returns the prompt text; tokenize it with
    `Tokenizer.encode` (no BOS: the template writes every marker).
    """

    def __init__(self, source: str, *, special_tokens: Mapping[str, str] | None = None) -> None:
        self.source = source
        # bos_token, eos_token, ... are template variables in transformers.
        self._special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None

    @classmethod
    def from_dir(
        cls, model_dir: str | Path, *, special_tokens: Mapping[str, str] | None = None
    ) -> ChatTemplate:
        """The template of a checkpoint: `chat_template.jinja`, else `tokenizer_config.json`'s
        `chat_template` (a string, or a list of named templates of which "default" is used)."""
        model_dir = Path(model_dir)
        path = model_dir / "chat_template.jinja"
        if path.is_file():
            return cls(path.read_text(encoding="utf-8"), special_tokens=special_tokens)
        config_path = model_dir / "tokenizer_config.json"
        source: Any = None
        if config_path.is_file():
            source = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source}
            source = named.get("default")
        if not isinstance(source, str):
            raise ChatTemplateError(
                f"{model_dir} has no chat template (chat_template.jinja or "
                "tokenizer_config.json['chat_template'])"
            )
        return cls(source, special_tokens=special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation.

        `enable_thinking=None` leaves the variable undefined, so the template's own default
        applies (thinking on for Qwen3.6). `template_kwargs` are the request's extra
        `chat_template_kwargs` (e.g. `preserve_thinking`), passed through as template variables.
        """
        variables: dict[str, Any] = dict(self._special_tokens)
        variables.update(template_kwargs)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        variables["messages"] = [template_message(m) for m in messages]
        variables["tools"] = list(tools) if tools else None
        variables["documents"] = None  # transformers always defines it
        variables["add_generation_prompt"] = add_generation_prompt
        try:
            return self._template.render(**variables)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"chat template refused the conversation: {e}") from None
