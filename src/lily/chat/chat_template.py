"""Rendering the checkpoint's own chat template, the way transformers renders it.

The template ships with the checkpoint (`chat_template.jinja`, or `chat_template` in
`tokenizer_config.json`) and is rendered as it is: Lily never re-implements the model's chat
format by hand. To produce byte-identical prompts it reproduces the jinja2 environment of
transformers' `apply_chat_template`: a sandboxed, immutable environment with `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a no-op `{% generation %}` block, the
`raise_exception` and `strftime_now` globals and transformers' `tojson` filter (no HTML escaping,
non-ASCII kept, optional indent).

Unlike transformers, a render is bounded (`TemplateLimits`, see `lily.chat.template_budget`) and
every
failure is a named error of `lily.errors`: `ChatTemplateError` when the template cannot be used at
all (at load), `ChatTemplateRefusedError` (HTTP 400) when it refuses or fails on a conversation,
`ChatTemplateLimitError` when it goes over its bounds. A template may not include, import or
extend other templates (transformers has no loader for them either).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes

from lily.chat.template_budget import BudgetedEnvironment, TemplateLimits, instrument, limited
from lily.checkpoint.files import open_regular, read_json_file
from lily.errors import (
    ChatTemplateError,
    ChatTemplateLimitError,
    ChatTemplateRefusedError,
    CheckpointError,
)

__all__ = [
    "ChatTemplate",
    "ChatTemplateError",
    "ChatTemplateLimitError",
    "ChatTemplateRefusedError",
    "TemplateLimits",
    "template_message",
]

# The largest chat template accepted: Qwen's is 6 KB, the largest on the Hub tens of KB; a
# template of hundreds of MB would take minutes and gigabytes to compile.
MAX_TEMPLATE_BYTES = 1 << 20

# Variables the renderer sets itself; a request's template keywords may not replace them.
RENDERER_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


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


def _environment() -> BudgetedEnvironment:
    env = BudgetedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.finish_setup()
    return env


_INCLUDING_NODES = (jinja2.nodes.Include, jinja2.nodes.Import, jinja2.nodes.FromImport,
                    jinja2.nodes.Extends)  # fmt: skip


def _names_read(tree: jinja2.nodes.Template) -> frozenset[str]:
    """Every attribute or constant key the template reads from any value (`message.content`,
    `message['tool_calls']`): the fields of a message it can use."""
    names = {node.attr for node in tree.find_all(jinja2.nodes.Getattr)}
    for node in tree.find_all(jinja2.nodes.Getitem):
        if isinstance(node.arg, jinja2.nodes.Const) and isinstance(node.arg.value, str):
            names.add(node.arg.value)
    return frozenset(names)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped message as chat templates expect it.

    OpenAI clients send tool-call arguments as a JSON object text; templates iterate them as a
    mapping (transformers documents dicts), so the text is parsed. The caller's message is not
    changed.
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
                function["arguments"] = parse_arguments(function["arguments"])
                call["function"] = function
            converted.append(call)
        out["tool_calls"] = converted
    return out


def system_first(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with every system message merged into the first one, in order, joined
    by a blank line. Agents insert system messages mid-conversation, which Qwen's templates
    refuse; Ollama renders this model's conversations with one system prompt gathered from all
    of them, and so does Lily (the instructions keep their order, not their position)."""
    later = [i for i, m in enumerate(messages) if m.get("role") == "system" and i > 0]
    if not later:
        return messages
    leading = messages[0] if messages[0].get("role") == "system" else {"role": "system"}
    systems = [leading, *(messages[i] for i in later)]
    texts = [m["content"] for m in systems if isinstance(m.get("content"), str) and m["content"]]
    merged = {**leading, "content": "\n\n".join(texts)}
    rest = [m for m in messages if m.get("role") != "system"]
    return [merged, *rest]


def parse_arguments(text: str) -> dict[str, Any]:
    """Tool-call arguments as OpenAI sends them: a JSON object text (empty means no arguments).
    Raises ChatTemplateRefusedError for anything else."""
    try:
        value = json.loads(text) if text.strip() else {}
    except (ValueError, RecursionError) as e:  # also numbers past Python's digit limit
        raise ChatTemplateRefusedError(
            f"tool call arguments are not valid JSON: {text[:200]!r} ({e})"
        ) from None
    if not isinstance(value, dict):
        raise ChatTemplateRefusedError(
            f"tool call arguments must be a JSON object, not {type(value).__name__}: {text[:200]!r}"
        )
    return value


class ChatTemplate:
    """One compiled chat template.

    `render` takes OpenAI-shaped messages and tools and returns the prompt text; tokenize it with
    `Tokenizer.encode` (no BOS: the template writes every marker). `limits` bound each render.
    """

    def __init__(
        self,
        source: str,
        *,
        special_tokens: Mapping[str, str] | None = None,
        limits: TemplateLimits | None = None,
    ) -> None:
        if len(source) > MAX_TEMPLATE_BYTES:  # characters: at most as many as its bytes
            raise ChatTemplateError(
                f"the chat template is {len(source)} characters, more than the "
                f"{MAX_TEMPLATE_BYTES} bytes a chat template may take"
            )
        self.source = source
        self.limits = limits or TemplateLimits()
        # bos_token, eos_token, ... are template variables in transformers.
        self._special_tokens = dict(special_tokens or {})
        try:
            self._compile(source)
        except RecursionError:
            # jinja2's parser and compiler recurse once per nesting level.
            raise ChatTemplateError("the chat template is nested too deeply to compile") from None

    def _compile(self, source: str) -> None:
        env = _environment()
        try:
            tree = env.parse(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None
        if any(True for _ in tree.find_all(_INCLUDING_NODES)):
            raise ChatTemplateError(
                "the chat template includes, imports or extends another template; "
                "a chat template must be self-contained"
            )
        self.variables = frozenset(jinja2.meta.find_undeclared_variables(tree) - set(env.globals))
        self.message_fields = _names_read(tree)
        # A template that never compares anything with "developer" does not know the role.
        self.knows_developer_role = any(
            node.value == "developer" for node in tree.find_all(jinja2.nodes.Const)
        )
        try:
            self._template = env.from_string(instrument(tree))
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from None

    @property
    def reserved_variables(self) -> frozenset[str]:
        """Variables a request's template keywords may not set: the renderer sets them."""
        return RENDERER_VARIABLES | set(self._special_tokens)

    @property
    def keyword_variables(self) -> frozenset[str]:
        """The variables a request may set with `chat_template_kwargs`: those the template
        reads, except the ones the renderer sets (e.g. `enable_thinking`)."""
        return self.variables - self.reserved_variables

    @classmethod
    def from_dir(
        cls,
        model_dir: str | Path,
        *,
        special_tokens: Mapping[str, str] | None = None,
        limits: TemplateLimits | None = None,
    ) -> ChatTemplate:
        """The template of a checkpoint: `chat_template.jinja`, else `tokenizer_config.json`'s
        `chat_template` (a string, or a list of named templates of which "default" is used)."""
        model_dir = Path(model_dir)
        path = model_dir / "chat_template.jinja"
        if path.is_file():
            try:
                with open_regular(path) as f:
                    data = f.read(MAX_TEMPLATE_BYTES + 1)
            except CheckpointError as e:
                raise ChatTemplateError(str(e)) from None
            if len(data) > MAX_TEMPLATE_BYTES:
                raise ChatTemplateError(
                    f"{path} is larger than {MAX_TEMPLATE_BYTES} bytes, far more than a chat "
                    "template needs"
                )
            try:
                source = data.decode("utf-8")
            except UnicodeDecodeError:
                raise ChatTemplateError(f"{path} is not UTF-8 text") from None
            return cls(source, special_tokens=special_tokens, limits=limits)
        config_path = model_dir / "tokenizer_config.json"
        source: Any = None
        if config_path.is_file():
            try:
                config = read_json_file(config_path)
            except CheckpointError as e:
                raise ChatTemplateError(str(e)) from None
            source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):
            named = {entry.get("name"): entry.get("template") for entry in source}
            source = named.get("default")
        if not isinstance(source, str):
            raise ChatTemplateError(
                f"{model_dir} has no chat template (chat_template.jinja or "
                "tokenizer_config.json['chat_template'])"
            )
        return cls(source, special_tokens=special_tokens, limits=limits)

    def _template_message(self, message: Mapping[str, Any]) -> dict[str, Any]:
        out = template_message(message)
        if out.get("role") == "developer" and not self.knows_developer_role:
            # OpenAI's newer name for the system role, which older chat formats lack.
            out["role"] = "system"
        return out

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
        `chat_template_kwargs` (e.g. `preserve_thinking`), passed through as template variables;
        they may not set the variables the renderer sets (`reserved_variables`).
        """
        reserved = sorted(self.reserved_variables & set(template_kwargs))
        if reserved:
            raise ChatTemplateRefusedError(
                f"template keyword(s) {', '.join(reserved)} are set by the renderer itself"
            )
        variables: dict[str, Any] = dict(self._special_tokens)
        variables.update(template_kwargs)
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        variables["messages"] = system_first([self._template_message(m) for m in messages])
        variables["tools"] = list(tools) if tools else None
        variables["documents"] = None  # transformers always defines it
        variables["add_generation_prompt"] = add_generation_prompt
        with limited(self.limits) as budget:
            try:
                text = self._template.render(**variables)
            except ChatTemplateError:
                raise
            except MemoryError:
                raise ChatTemplateLimitError(
                    "rendering the chat template ran out of memory", limit="memory"
                ) from None
            except RecursionError:
                raise ChatTemplateRefusedError(
                    "the chat template recursed too deeply on this conversation"
                ) from None
            except jinja2.exceptions.TemplateError as e:
                raise ChatTemplateRefusedError(
                    f"chat template refused the conversation: {e}"
                ) from None
            except Exception as e:  # a type or value error inside the template
                raise ChatTemplateRefusedError(
                    f"chat template failed on this conversation: {type(e).__name__}: {e}"
                ) from None
            return budget.sized(text, count=False)
