"""Structured output: `response_format` and forced tool calls as a grammar the sampler follows.

A request's `response_format` (`text`, `json_object`, `json_schema`) and `tool_choice`
(`"none"`, `"auto"`, `"required"`, or a named function, with `parallel_tool_calls`) are checked
into an `OutputGrammar`: an llguidance grammar (Lark syntax, JSON Schemas inlined with `%json`)
for the answer. Per generation, `OutputGrammar.constraint` makes a `GrammarConstraint`, the
`TokenConstraint` the engine asks for a token mask before every draw:

- while the model thinks (the generation prompt opened `<think>`) the answer is free text, except
  that the end of turn is not allowed; the grammar starts after `</think>`;
- then only tokens that keep the answer a prefix of the grammar are allowed, and the stop tokens
  (`<|im_end|>`) only where the grammar accepts: a finished answer always parses; text the
  grammar forces (a required key, a tool-call tag) is written in its canonical tokens;
- near the end of `max_tokens` the answer is steered to its end (the closing stretch): where
  one of `CLOSING_TEXTS` (the end of a tool-call parameter, a quote, a closing bracket, ...)
  may come next, its tokens are the only ones allowed, and once the grammar accepts only the
  end of turn is. In the last `CLOSING_LOOKAHEAD` tokens each draw first plays the stretch out
  on a copy of the grammar state; it starts when what it needs (plus `CLOSING_SLACK`) no longer
  fits. A model that would go on (a random one, in a long string) so still finishes with an
  answer that parses, unless the schema needs more tokens than `max_tokens` leaves.

JSON is written compactly (`", "` and `": "` separators, no other whitespace): a grammar that
allows free whitespace lets a model pad forever. Forced tool calls follow the qwen3_coder format
the chat template renders (`lily.chat.tool_calls`): string parameters are raw text, other parameters
JSON, each checked against the tool's parameter schema.
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import llguidance
import numpy as np

from lily.chat.template_inputs import (
    SUBSCHEMA_KEYWORDS,
    SUBSCHEMA_LIST_KEYWORDS,
    SUBSCHEMA_MAP_KEYWORDS,
    refuse_remote_refs,
)
from lily.chat.tool_calls import (
    FUNCTION_END,
    FUNCTION_START,
    PARAMETER_END,
    PARAMETER_START,
    TOOL_CALL_END,
    TOOL_CALL_START,
    follow_local_refs,
)
from lily.engine.model_graph import MAX_DRAFT_TOKENS
from lily.errors import RequestError

if TYPE_CHECKING:
    from lily.chat.tokenizer import Tokenizer

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
THINK_END = "</think>"
# How llguidance writes JSON here: compact, with the separators json.dumps uses by default.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# What ends an answer soonest, tried in this order: the closing tags of the tool-call format
# (raw parameter text may hold anything else), then a quote (inside a JSON string it is the
# only way out; elsewhere it opens a string the next quote closes; after ":" the separator's
# space comes first), closing brackets, the separator towards a required member still missing,
# and last a digit, to start a number (after one, a bracket or the separator always fits).
CLOSING_TEXTS = (
    f"\n{PARAMETER_END}\n",
    f"{FUNCTION_END}\n{TOOL_CALL_END}",
    '"',
    ' "',
    "}",
    "]",
    JSON_OPTIONS["item_separator"],
    "0",
    " 0",
)
# Inside a string held to a format or a pattern no closing text may fit yet: the stretch then
# searches for single characters that lead to where one does, punctuation first (`:`, `@`,
# `.` are what formats wait for), keeping FILLER_BEAM states (at most FILLER_BRANCHES children
# of each) per step, for FILLER_DEPTH steps.
FILLER_CHARACTERS = (
    ":/@.-_+"
    + "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    + "!#$%&'()*,;<=>?[]^`{|}~ "
)
FILLER_BEAM = 48
FILLER_BRANCHES = 4  # children kept per state, so that the beam holds several directions
FILLER_DEPTH = 24
# How close to max_tokens the closing stretch is planned, and the spare tokens it starts with
# (the model's own choices where no closing text fits may take longer than the plan's).
CLOSING_LOOKAHEAD = 128
CLOSING_SLACK = 4
_PARAMETER_TAG = PARAMETER_START.encode()
# Raw string values end at these tags (lily.chat.tool_calls reads a value up to its `</parameter>`).
_TOOL_CALL_TAGS = (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END)
# The longest minLength/maxLength a raw tool-call value is held to: a counted repetition longer
# than a few thousand exhausts the grammar engine's budget when it loads against the vocabulary.
RAW_LENGTH_LIMIT = 1000
# String keywords a raw (unquoted) tool-call parameter value cannot be held to.
_RAW_STRING_CONSTRAINTS = ("pattern", "format", "contentEncoding", "contentMediaType")


# The formats JSON Schema (2020-12) defines. Any other `format` is an annotation the schema's
# author made for their own tools, which JSON Schema validators ignore: so does Lily, instead
# of refusing the schema. The defined ones are enforced, or refused where they cannot be.
DEFINED_FORMATS = frozenset(
    (
        "date-time", "date", "time", "duration", "email", "idn-email", "hostname",
        "idn-hostname", "ipv4", "ipv6", "uri", "uri-reference", "iri", "iri-reference", "uuid",
        "uri-template", "json-pointer", "relative-json-pointer", "regex",
    )
)  # fmt: skip


def without_unknown_formats(schema: Any) -> Any:
    """`schema` with every `format` JSON Schema does not define removed (at any depth, only
    where `format` is a keyword, not a property's name)."""
    if not isinstance(schema, Mapping):
        return schema
    out = {
        key: value
        for key, value in schema.items()
        if not (key == "format" and isinstance(value, str) and value not in DEFINED_FORMATS)
    }
    for key in SUBSCHEMA_KEYWORDS:
        if isinstance(out.get(key), Mapping):
            out[key] = without_unknown_formats(out[key])
    for key in SUBSCHEMA_LIST_KEYWORDS:
        if isinstance(out.get(key), list):
            out[key] = [without_unknown_formats(member) for member in out[key]]
    for key in SUBSCHEMA_MAP_KEYWORDS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: without_unknown_formats(sub) for name, sub in out[key].items()}
    return out


class UnsupportedSchemaError(RequestError):
    """A schema the grammar engine cannot enforce (400, naming the keyword when it can)."""

    def __init__(self, message: str, *, param: str) -> None:
        super().__init__(message, param=param, code="unsupported_schema")


@dataclass(frozen=True)
class OutputGrammar:
    """The grammar a request's answer must follow (checked, ready to start per generation)."""

    lark: str
    param: str = "response_format"  # the request field it comes from, for errors
    # Matchers loaded with a tokenizer, by (tokenizer, thinking): each generation starts from a
    # copy, so the grammar is compiled against the vocabulary once per request.
    _loaded: dict[tuple[int, bool], llguidance.LLMatcher] = field(
        default_factory=dict, compare=False, repr=False
    )

    def check(self, tokenizer: Tokenizer, *, thinking: bool) -> None:
        """Loads the grammar against the vocabulary now, so that a grammar the engine cannot
        run (over its internal budgets, or one no finite answer satisfies) is refused before
        the request starts: UnsupportedSchemaError, a 400, not a failure mid-generation. The
        answer's start is loaded too when the generation starts in the think block, whose free
        text would otherwise hide the answer's forced text."""
        self.matcher(tokenizer, thinking=False)
        if thinking:
            self.matcher(tokenizer, thinking=True)

    def matcher(self, tokenizer: Tokenizer, *, thinking: bool) -> llguidance.LLMatcher:
        """A fresh matcher at the start of the answer."""
        key = (id(tokenizer), thinking)
        if key not in self._loaded:
            matcher = llguidance.LLMatcher(
                grammar_tokenizer(tokenizer), _with_start(self.lark, thinking=thinking), log_level=0
            )
            if not matcher.is_error():
                matcher.compute_ff_tokens()  # text forced at the start: an endless one fails here
            if matcher.is_error():
                raise self.failure(matcher.get_error())
            self._loaded[key] = matcher
        return self._loaded[key].deep_copy()

    def failure(self, error: str) -> UnsupportedSchemaError:
        """The grammar engine's error as a 400 naming the field, with the first line of its
        message only (it can quote the whole grammar) and a digest to find it in a log."""
        digest = hashlib.sha256(self.lark.encode()).hexdigest()[:12]
        return UnsupportedSchemaError(
            f"the {self.param} cannot be enforced: {_first_line(error)[:300]} "
            f"(grammar {digest}, {len(self.lark)} bytes)",
            param=self.param,
        )

    def constraint(
        self, tokenizer: Tokenizer, vocab_size: int, *, thinking: bool, max_tokens: int
    ) -> GrammarConstraint:
        """A fresh constraint for one generation of at most `max_tokens` over `vocab_size`
        logits; with `thinking` the generation starts inside the think block."""
        return GrammarConstraint(
            self, tokenizer, vocab_size, thinking=thinking, max_tokens=max_tokens
        )


def output_grammar(
    response_format: Any,
    tool_choice: Any,
    parallel_tool_calls: Any,
    tools: Sequence[Mapping[str, Any]] | None,
    *,
    max_bytes: int | None = None,
) -> OutputGrammar | None:
    """The grammar that `response_format` and `tool_choice` ask for (`tools` already checked),
    or None when the answer is free. Raises RequestError naming the offending parameter.

    With `max_bytes`, a grammar whose text (JSON Schemas inlined) would be longer is refused
    (`UnsupportedSchemaError` naming the largest part of the field that crossed the bound)
    before the grammar engine compiles any of it: compiling grows faster than linearly with
    the grammar (a 100,000-value enum: 21 s)."""
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise RequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    budget = _GrammarBudget(max_bytes)
    parallel = parallel_tool_calls is not False
    calls = _forced_calls(tool_choice, tools, parallel)
    answer = _response_format(response_format, budget)
    may_call = bool(tools) and tool_choice != "none"
    if calls is not None:
        # A forced call is the whole answer; response_format shapes text answers only.
        body = calls
    elif answer is None:
        return None
    elif may_call:
        # tool_choice "auto": the model may still call a tool instead of answering.
        body = f"{answer} | {_calls_rule(parallel)}"
    else:
        body = answer
    rules = _tool_rules(tools, budget) if may_call and tools else ""
    grammar = OutputGrammar(f"answer: {body}\n{rules}", "tools" if may_call else "response_format")
    _check(grammar)
    return grammar


class _GrammarBudget:
    """The bytes of grammar text a request may still add (`output_grammar`'s `max_bytes`)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.used = 0

    def spend(self, text: str, parts: Sequence[tuple[str, Any]]) -> None:
        """Counts `text`, the rule made of `parts` ((param, value) pairs): refused when the
        grammar goes over the bound, naming the largest part."""
        if self.limit is None:
            return
        self.used += len(text.encode("utf-8", "surrogatepass"))
        if self.used <= self.limit:
            return
        param = max((_largest_part(p, v) for p, v in parts), key=lambda found: found[1])[0]
        raise UnsupportedSchemaError(
            f"the output grammar of this request would be over {self.limit} bytes, the most "
            f"this server compiles; {param} is its largest part (fewer enum values, "
            "alternatives or properties fit)",
            param=param,
        )


def _largest_part(param: str, value: Any) -> tuple[str, int]:
    """The path under `param` of the part of `value` that holds most of its JSON text (the
    child holding at least half of it, descended while there is one), and that text's size."""
    size = len(json.dumps(value))
    while isinstance(value, Mapping | list) and size > 0:
        children = value.items() if isinstance(value, Mapping) else enumerate(value)
        sized = [(key, child, len(json.dumps(child))) for key, child in children]
        if not sized:
            break
        key, child, child_size = max(sized, key=lambda item: item[2])
        if child_size * 2 < size:
            break
        param = f"{param}[{key}]" if isinstance(key, int) else f"{param}.{key}"
        value, size = child, child_size
    return param, size


def _response_format(value: Any, budget: _GrammarBudget) -> str | None:
    """The answer rule for `response_format` (None: free text)."""
    if value is None:
        return None
    if not isinstance(value, Mapping) or value.get("type") not in RESPONSE_FORMATS:
        raise RequestError(
            f"response_format must be an object whose type is one of {', '.join(RESPONSE_FORMATS)}",
            param="response_format",
        )
    kind = value["type"]
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    stray = sorted(set(value) - allowed)
    if stray:
        raise RequestError(
            f"response_format of type {kind!r} takes no {', '.join(map(repr, stray))}"
            + (
                " (a schema goes in json_schema.schema, with type 'json_schema')"
                if {"schema", "json_schema"} & set(stray)
                else ""
            ),
            param=f"response_format.{stray[0]}",
        )
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_rule({"type": "object"}, strict=True, param="response_format", budget=budget)
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise RequestError("json_schema needs a name (and a schema)", param=param)
    schema = spec.get("schema", {})
    if not isinstance(schema, Mapping):
        raise RequestError("json_schema.schema must be an object", param=f"{param}.schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise RequestError("json_schema.strict must be a boolean", param=f"{param}.strict")
    refuse_remote_refs(schema, f"{param}.schema", f"response format {spec['name']!r}")
    return _json_rule(schema, strict=bool(strict), param=f"{param}.schema", budget=budget)


def _json_rule(
    schema: Mapping[str, Any],
    *,
    strict: bool,
    param: str,
    budget: _GrammarBudget,
    parts: Sequence[tuple[str, Any]] | None = None,
) -> str:
    """A `%json` rule for `schema`. Strict: every keyword is enforced or the request is refused;
    otherwise keywords the engine does not implement are left unchecked. `parts`: where the
    schema's pieces come from in the request (default: all of it from `param`)."""
    options = {**JSON_OPTIONS, "lenient": not strict}
    schema = without_unknown_formats(schema)
    rule = f"%json {json.dumps({**schema, 'x-guidance': options})}"
    budget.spend(rule, parts or [(param, schema)])
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(f"start: {rule}\n")
    if is_error:
        raise UnsupportedSchemaError(
            f"the schema cannot be enforced: {_first_line(messages[0])}", param=param
        )
    return rule


def _forced_calls(
    tool_choice: Any, tools: Sequence[Mapping[str, Any]] | None, parallel: bool
) -> str | None:
    """The answer rule when `tool_choice` forces a call (None when it does not)."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    if tool_choice == "required":
        if not tools:
            raise RequestError('tool_choice "required" needs tools', param="tool_choice")
        return _calls_rule(parallel)
    if (
        isinstance(tool_choice, Mapping)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), Mapping)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        name = tool_choice["function"]["name"]
        names = [t["function"]["name"] for t in tools or []]
        if name not in names:
            raise RequestError(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        return _calls_rule(parallel, only=names.index(name))
    raise RequestError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _calls_rule(parallel: bool, only: int | None = None) -> str:
    call = f"call_{only}" if only is not None else "call"
    return f'{call} ("\\n" {call})*' if parallel else call


def _tool_rules(tools: Sequence[Mapping[str, Any]], budget: _GrammarBudget) -> str:
    """Lark rules `call` (any tool) and `call_<i>` (tool i), in the chat template's format:
    <tool_call>\\n<function=NAME>\\n(<parameter=KEY>\\nVALUE\\n</parameter>\\n)*</function>\\n</tool_call>
    """
    rules = [f"call: {' | '.join(f'call_{i}' for i in range(len(tools)))}"]
    for i, tool in enumerate(tools):
        function = tool["function"]
        param = f"tools[{i}].function.parameters"
        strict = function.get("strict") is True
        opening = f"{TOOL_CALL_START}\n{FUNCTION_START}{function['name']}>\n"
        parameters = function.get("parameters") or {}
        properties = parameters.get("properties") or {}
        required = set(parameters.get("required") or [])
        definitions = {
            key: parameters[key] for key in ("$defs", "definitions") if key in parameters
        }
        pieces = []
        for j, (key, schema) in enumerate(properties.items()):
            value = f"value_{i}_{j}"
            rule = _value_rule(
                follow_local_refs(schema, parameters) if isinstance(schema, Mapping) else schema,
                definitions,
                strict,
                f"{param}.properties.{key}",
                param,
                budget,
            )
            if isinstance(rule, _RawText):
                # A lazy lexeme: the value ends at the first `</parameter>` line.
                rules += [f"{value}[lazy]: RAW_{i}_{j}", f"RAW_{i}_{j}: {rule.lexeme}"]
            elif isinstance(rule, _Choices):
                # One lexeme: thousands of alternatives in a grammar row would exceed the
                # engine's items per row; in the lexer they are one regular expression.
                rules += [f"{value}: CHOICE_{i}_{j}", f"CHOICE_{i}_{j}: {rule.alternatives}"]
            else:
                rules.append(f"{value}: {rule}")
            tag = f"{PARAMETER_START}{key}>\n"
            piece = f"{_lark_string(tag)} {value}"
            pieces.append(piece if key in required else f"({piece})?")
        closing = f"{FUNCTION_END}\n{TOOL_CALL_END}"
        body = " ".join([_lark_string(opening), *pieces, _lark_string(closing)])
        rules.append(f"call_{i}: {body}")
    return "\n".join(rules) + "\n"


@dataclass(frozen=True)
class _RawText:
    lexeme: str


@dataclass(frozen=True)
class _Choices:
    alternatives: str


def _value_rule(
    schema: Any,
    definitions: Mapping[str, Any],
    strict: bool,
    param: str,
    parameters_param: str,
    budget: _GrammarBudget,
) -> str | _RawText | _Choices:
    """One parameter's value and the `</parameter>` line after it, as `ToolCallParser` reads
    it back: raw text for a string, JSON for anything else."""
    end = f"\n{PARAMETER_END}\n"
    if not isinstance(schema, Mapping):
        schema = {}
    schema = without_unknown_formats(schema)
    kinds = _json_types(schema)
    if kinds == {"string"}:
        choices = _listed_values(schema)
        if choices is not None:
            for choice in choices:
                tag = next((t for t in _TOOL_CALL_TAGS if t in str(choice)), None)
                if tag is not None:
                    raise UnsupportedSchemaError(
                        f"the value {choice!r} holds {tag!r}, which ends a parameter in the "
                        "model's tool-call format: it cannot be written in a tool call",
                        param=param,
                    )
            rule = " | ".join(_lark_string(f"{c}{end}") for c in choices)
            budget.spend(rule, [(param, schema)])
            return _Choices(rule)
        unsupported = [k for k in _RAW_STRING_CONSTRAINTS if k in schema]
        if unsupported and strict:
            raise UnsupportedSchemaError(
                f"a string parameter with {unsupported[0]!r} cannot be enforced in a tool call",
                param=param,
            )
        low, high = schema.get("minLength", 0), schema.get("maxLength")
        if low > RAW_LENGTH_LIMIT or (strict and high is not None and high > RAW_LENGTH_LIMIT):
            keyword = "minLength" if low > RAW_LENGTH_LIMIT else "maxLength"
            raise UnsupportedSchemaError(
                f"a string parameter's {keyword} above {RAW_LENGTH_LIMIT} cannot be enforced in a "
                "tool call",
                param=f"{param}.{keyword}",
            )
        if high is not None and high > RAW_LENGTH_LIMIT:
            high = None  # not strict: a keyword the engine cannot enforce is left unchecked
        return _raw_text_rule(low, high, end)
    if "string" in kinds:
        if strict:
            raise UnsupportedSchemaError(
                "a parameter that may be a string or another type cannot be enforced in a "
                "tool call (its value is raw text either way)",
                param=param,
            )
        return _raw_text_rule(0, None, end)
    parts = [(param, schema), *((f"{parameters_param}.{k}", v) for k, v in definitions.items())]
    rule = _json_rule(
        {**schema, **definitions}, strict=strict, param=param, budget=budget, parts=parts
    )
    return f"{rule} {_lark_string(end)}"


def _raw_text_rule(min_length: int, max_length: int | None, end: str) -> _RawText:
    """Text up to the first `end` (a lazy lexeme), which no other tool-call tag interrupts."""
    length = f"{{{min_length},{'' if max_length is None else max_length}}}"
    tags = "|".join(_regex_escape(t) for t in (PARAMETER_START, FUNCTION_END, TOOL_CALL_END))
    return _RawText(
        f"/(?s:.){length}{_regex_escape(end)}/"
        f" & ~/(?s:.*({tags}|{_regex_escape(end)}).*{_regex_escape(end)})/"
    )


def _json_types(schema: Mapping[str, Any]) -> set[str]:
    """The JSON types a value of `schema` may have, as `lily.chat.tool_calls` reads a parameter
    back:
    a schema that names no type (`{}`, a `$ref`, bare `properties`) is read as JSON, so its
    value is written as JSON ("other")."""
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return set(declared)
    values = _listed_values(schema)
    if values:
        return {"string" if isinstance(v, str) else "other" for v in values}
    members = [*schema.get("anyOf", []), *schema.get("oneOf", [])]
    if members:
        return set().union(*(_json_types(m) for m in members if isinstance(m, Mapping)))
    return {"other"}


def _single_character_tokens(tokenizer: Tokenizer) -> list[int]:
    """The ids of FILLER_CHARACTERS that are one token each, in that order."""
    found = []
    for character in FILLER_CHARACTERS:
        ids = tokenizer.encode_as_text(character)
        if len(ids) == 1:
            found.append(ids[0])
    return found


def _listed_values(schema: Mapping[str, Any]) -> list[Any] | None:
    """The values `schema` allows when it lists them: its `enum`, its `const`, or those of the
    `anyOf`/`oneOf` members when every member lists its own; None otherwise."""
    if isinstance(schema.get("enum"), list):
        return schema["enum"]
    if "const" in schema:
        return [schema["const"]]
    members = [*schema.get("anyOf", []), *schema.get("oneOf", [])]
    if not members or not all(isinstance(m, Mapping) for m in members):
        return None
    listed = [_listed_values(m) for m in members]
    if any(values is None for values in listed):
        return None
    return [v for values in listed for v in values]  # type: ignore[union-attr]


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _regex_escape(text: str) -> str:
    return "".join(f"\\{c}" if c in r"\.+*?()|[]{}^$/-" else c for c in text).replace("\n", "\\n")


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


def _check(grammar: OutputGrammar) -> None:
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        _with_start(grammar.lark, thinking=False)
    )
    if is_error:
        raise UnsupportedSchemaError(
            f"the output grammar is invalid: {_first_line(messages[0])}", param="tools"
        )


def _with_start(lark: str, *, thinking: bool) -> str:
    # After `</think>` the template puts a blank line before the answer.
    start = 'start: "\\n\\n"? answer' if thinking else "start: answer"
    return f"{start}\n{lark}"


_TOKENIZERS: weakref.WeakKeyDictionary[Tokenizer, llguidance.LLTokenizer] = (
    weakref.WeakKeyDictionary()
)


def grammar_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    """llguidance's index of the vocabulary (built once per tokenizer: ~1 s for 248k tokens)."""
    cached = _TOKENIZERS.get(tokenizer)
    if cached is None:
        cached = _TOKENIZERS[tokenizer] = llguidance.LLTokenizer(
            llguidance.TokenizerWrapper(_VocabularyView(tokenizer))
        )
    return cached


class _VocabularyView:
    """What llguidance reads of a tokenizer: every id's bytes, the control tokens, an encoder."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.eos_token_id = min(tokenizer.stop_token_ids)
        self.bos_token_id = None
        self.special_token_ids = sorted(tokenizer.special_token_ids)
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self._tokenizer.encode_as_text(text)


@dataclass(frozen=True)
class _JsonString:
    """Whether the answer's text is inside a JSON string, followed byte by byte: inside one, a
    `}` or `]` is just more text, and only a quote ends it. A tool call's parameter tag starts
    afresh (a raw string value between tags has quotes of no meaning)."""

    inside: bool = False
    escaped: bool = False
    tail: bytes = b""  # the last bytes, to find a tag split across tokens

    def after(self, data: bytes) -> _JsonString:
        recent = self.tail + data
        inside, escaped = self.inside, self.escaped
        tag = recent.rfind(_PARAMETER_TAG)
        if tag >= 0:
            inside, escaped = False, False
            data = recent[tag + len(_PARAMETER_TAG) :]
        for byte in data:
            if inside and escaped:
                escaped = False
            elif inside and byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # quote
                inside = not inside
        return _JsonString(inside, escaped, recent[-len(_PARAMETER_TAG) :])


@dataclass(frozen=True)
class _Consumed:
    """What a `GrammarConstraint` was just before it consumed a token: what `rollback` puts
    back (the matcher takes back its own tokens)."""

    plan: tuple[int, ...]
    string: _JsonString
    closing: bool
    reasoning_mask: np.ndarray | None
    matched: bool  # whether the matcher consumed the token


class GrammarConstraint:
    """A `TokenConstraint` (`lily.engine.constraint`): the answer follows an `OutputGrammar`.
    Its state besides the matcher's is a few small values, so `rollback` keeps them as they
    were before each of the last consumed tokens and rolls the matcher back by llguidance's
    own `rollback` (three times cheaper than a `deep_copy` of the matcher to consume the
    drafts on: benchmarks/bench_constraint_lookahead.py)."""

    def __init__(
        self,
        grammar: OutputGrammar,
        tokenizer: Tokenizer,
        vocab_size: int,
        *,
        thinking: bool,
        max_tokens: int,
    ) -> None:
        index = grammar_tokenizer(tokenizer)
        self._grammar = grammar
        self._matcher = grammar.matcher(tokenizer, thinking=thinking)
        words = (vocab_size + 31) // 32
        # llguidance writes the tokenizer's ids; the logits' padding past them stays banned.
        self._mask = np.zeros(words, dtype=np.uint32)
        self._grammar_view = self._mask[: (index.vocab_size + 31) // 32]
        self._stop_ids = sorted(tokenizer.stop_token_ids)
        self._think_end = tokenizer.token_to_id(THINK_END) if thinking else None
        self._reasoning_mask: np.ndarray | None = None
        if self._think_end is not None:
            allowed = np.zeros(words * 32, dtype=bool)
            allowed[: tokenizer.vocab_size] = True
            allowed[self._stop_ids] = False  # the answer must still come
            self._reasoning_mask = np.packbits(allowed, bitorder="little").view(np.uint32)
        self.tokens: list[int] = []
        self._max_tokens = max_tokens
        self._closing = False
        self._closing_ids = tuple(tuple(tokenizer.encode_as_text(t)) for t in CLOSING_TEXTS)
        # The closing texts that end something: outside a JSON string all but the digits (which
        # start a number), inside one only the quotes (the rest would be more of the string).
        texts = list(zip(self._closing_ids, CLOSING_TEXTS, strict=True))
        self._closers = {
            False: tuple(ids for ids, text in texts if not text.strip().isdigit()),
            True: tuple(ids for ids, text in texts if text.strip() == '"'),
        }
        self._token_bytes = tokenizer.token_bytes
        self._string = _JsonString()
        self._filler = _single_character_tokens(tokenizer)
        self._plan: list[int] = []  # the rest of the forced or closing text being written
        self._consumed: deque[_Consumed] = deque(maxlen=MAX_DRAFT_TOKENS)

    @property
    def in_reasoning(self) -> bool:
        return self._reasoning_mask is not None

    @property
    def accepting(self) -> bool:
        """Whether the answer so far is complete (the grammar allows the end of turn)."""
        return not self.in_reasoning and self._matcher.is_accepting()

    def allowed_tokens(self) -> np.ndarray | None:
        if self._reasoning_mask is not None:
            return self._reasoning_mask
        if not self._plan:
            # Text the grammar forces (a key, a tag) goes in its canonical tokens.
            self._plan = list(self._matcher.compute_ff_tokens())
        remaining = self._max_tokens - len(self.tokens)
        if not self._closing and remaining <= CLOSING_LOOKAHEAD:
            if self._matcher.is_accepting():
                # A complete answer is not extended in the last stretch: what could follow (a
                # further parallel tool call) might not finish within max_tokens.
                self._closing = True
            else:
                needed = self._closing_length(remaining)
                self._closing = needed is None or needed + CLOSING_SLACK >= remaining
        chosen = self._closing_tokens() if self._closing else self._plan[:1]
        if chosen:
            self._mask[:] = 0
            for token in chosen:
                self._mask[token // 32] |= np.uint32(1 << (token % 32))
            return self._mask
        self._matcher.unsafe_compute_mask_ptr(
            self._grammar_view.ctypes.data, self._grammar_view.nbytes
        )
        if self._matcher.is_accepting():
            # llguidance knows one end-of-turn token; every stop token ends the turn alike.
            for token in self._stop_ids:
                self._mask[token // 32] |= np.uint32(1 << (token % 32))
        return self._mask

    def _closing_length(self, limit: int) -> int | None:
        """How many tokens the closing stretch takes from here to a complete answer, played
        out on a copy of the grammar state (None: more than `limit`). Where no closing text
        fits, the copy takes the lowest allowed token, as a stand-in for the model's choice."""
        matcher = self._matcher.deep_copy()
        string = self._string
        plan = list(self._plan)
        scratch = np.zeros_like(self._grammar_view)
        for steps in range(limit + 1):
            if matcher.is_accepting():
                return steps
            if not plan:
                plan = list(matcher.compute_ff_tokens()) or self._next_closing(matcher, string)
            if plan:
                token = plan.pop(0)
            else:
                matcher.unsafe_compute_mask_ptr(scratch.ctypes.data, scratch.nbytes)
                bits = np.unpackbits(scratch.view(np.uint8), bitorder="little")
                token = int(np.argmax(bits))
            if not matcher.consume_token(token):
                return None
            string = string.after(self._token_bytes(token))
        return None

    def _closing_tokens(self) -> list[int]:
        """In the closing stretch: the stop tokens once the answer may end, else the next
        token of forced text or of a closing text that may follow (none: the grammar's own
        choice)."""
        if self._matcher.is_accepting():
            return self._stop_ids
        if not self._plan:
            self._plan = self._next_closing(self._matcher, self._string)
        return self._plan[:1]

    def _next_closing(self, matcher: llguidance.LLMatcher, string: _JsonString) -> list[int]:
        """What to write next towards the end from `matcher`'s state: a closing text that ends
        something, else characters that lead to where one fits, else a digit (to start a
        number); [] when none of them fits."""
        closers = self._closers[string.inside]
        for ids in closers:
            if matcher.validate_tokens(ids) == len(ids):
                return list(ids)
        toward = self._toward_closing(matcher, closers)
        if toward or string.inside:
            return toward
        for ids in self._closing_ids:
            if matcher.validate_tokens(ids) == len(ids):
                return list(ids)
        return []

    def _toward_closing(
        self, matcher: llguidance.LLMatcher, closers: Sequence[Sequence[int]]
    ) -> list[int]:
        """Single characters that lead from `matcher`'s state to one where a closing text fits
        (inside a string held to a format or a pattern, where a quote does not fit yet: an
        email's `@`, a URI's `:`, the digits a pattern still needs), found by a beam search
        that tries punctuation first; [] when none is found within its bounds."""
        beam: list[tuple[llguidance.LLMatcher, list[int]]] = [(matcher, [])]
        for _ in range(FILLER_DEPTH):
            children = []
            for state, path in beam:
                taken = 0
                for token in self._filler:
                    if len(children) == FILLER_BEAM or taken == FILLER_BRANCHES:
                        break
                    if state.validate_tokens([token]) != 1:
                        continue
                    taken += 1
                    child = state.deep_copy()
                    child.consume_token(token)
                    if any(child.validate_tokens(ids) == len(ids) for ids in closers):
                        return [*path, token]
                    children.append((child, [*path, token]))
            if not children:
                return []
            beam = children
        return []

    def consume(self, token: int) -> None:
        before = (tuple(self._plan), self._string, self._closing, self._reasoning_mask)
        matched = self._consume(token)
        self._consumed.append(_Consumed(*before, matched=matched))

    def _consume(self, token: int) -> bool:
        """Consumes `token`; returns whether the matcher did."""
        self.tokens.append(token)
        if self._plan:
            if self._plan[0] == token:
                self._plan.pop(0)
            else:
                self._plan.clear()
        if self._reasoning_mask is not None:
            if token == self._think_end:
                self._reasoning_mask = None
            return False
        if token in self._stop_ids and self._matcher.is_accepting():
            return False
        self._string = self._string.after(self._token_bytes(token))
        if not self._matcher.consume_token(token):
            if self._matcher.is_error():
                # The engine gave up on the grammar (an internal budget): the schema's fault.
                raise self._grammar.failure(self._matcher.get_error())
            raise RuntimeError(f"token {token} is not allowed by the output grammar")
        return True

    def rollback(self, tokens: int) -> None:
        if not 0 <= tokens <= len(self._consumed):
            raise ValueError(f"can take back 0 to {len(self._consumed)} tokens, got {tokens}")
        if tokens == 0:
            return
        undone = [self._consumed.pop() for _ in range(tokens)]
        del self.tokens[-tokens:]
        matched = sum(u.matched for u in undone)
        if matched and not self._matcher.rollback(matched):
            raise RuntimeError(f"the output grammar could not take back {matched} tokens")
        first = undone[-1]
        self._plan, self._string = list(first.plan), first.string
        self._closing, self._reasoning_mask = first.closing, first.reasoning_mask
