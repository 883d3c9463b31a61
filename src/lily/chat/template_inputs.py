"""Checks of what a request hands the chat template: message fields, tool-call arguments, tool
schemas and template keywords. Each refusal names the field (`RequestError.param`), so a typo or
a wrong type is answered with a 400 instead of being silently ignored by the template (a
misspelled `enable_thinking` would leave thinking on) or failing deep inside it."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from lily.chat.chat_template import ChatTemplate, parse_arguments
from lily.errors import ChatTemplateRefusedError, RequestError

# The fields of an OpenAI chat message (request side, and what a response message dumps to, so
# that clients can send an answer back as the next turn's history).
OPENAI_MESSAGE_FIELDS = frozenset(
    {
        "role",
        "content",
        "name",
        "tool_calls",
        "tool_call_id",
        "reasoning_content",
        "refusal",
        "annotations",
        "audio",
        "function_call",
    }
)


def check_message_fields(
    message: Mapping[str, Any], param: str, template: ChatTemplate | None
) -> None:
    """Every field is an OpenAI message field or one the template reads; a null field counts as
    absent (as at the top level of a request)."""
    allowed = OPENAI_MESSAGE_FIELDS | (template.message_fields if template else frozenset())
    unknown = sorted(k for k, v in message.items() if k not in allowed and v is not None)
    if unknown:
        raise RequestError(
            f"{param} has field(s) neither OpenAI's chat format nor the chat template knows: "
            f"{', '.join(map(str, unknown))}",
            param=f"{param}.{unknown[0]}",
            code="unknown_field",
        )


def check_tool_calls(calls: Any, param: str) -> None:
    """An assistant message's `tool_calls`: a list of {"function": {"name", "arguments"}},
    the arguments being a JSON object text, as OpenAI sends them."""
    if calls is None:
        return
    if not isinstance(calls, Sequence) or isinstance(calls, str):
        raise RequestError("tool_calls must be a list", param=param)
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise RequestError(
                "a tool call must be {'function': {'name': ..., 'arguments': ...}}",
                param=f"{where}.function",
            )
        arguments = function.get("arguments", "")
        if not isinstance(arguments, str):
            raise RequestError(
                "arguments must be a string holding a JSON object, as OpenAI sends it",
                param=f"{where}.function.arguments",
            )
        try:
            parse_arguments(arguments)
        except ChatTemplateRefusedError as e:
            raise RequestError(e.message, param=f"{where}.function.arguments") from None


# OpenAI's rule for function names; it also keeps a name from holding the tool-call format's
# own tags (a name such as `f">\n</tool_call>` would end the call it names).
FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
# Schema keywords whose value must have a given JSON shape, checked at every level.
_SCHEMA_LISTS = ("required", "enum", "anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPPINGS = ("properties", "$defs", "definitions", "patternProperties")
_SCHEMA_NUMBERS = (
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
)  # fmt: skip
_SCHEMA_DEPTH = 64
# Keywords whose value is a subschema, a list of them, or a map of names to them (JSON Schema
# 2020-12 and the draft-07 spellings).
SUBSCHEMA_KEYWORDS = (
    "items", "not", "additionalProperties", "if", "then", "else", "contains", "propertyNames",
    "unevaluatedItems", "unevaluatedProperties", "additionalItems",
)  # fmt: skip
SUBSCHEMA_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
SUBSCHEMA_MAP_KEYWORDS = (
    "properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
)  # fmt: skip


def check_tool_schemas(tools: Sequence[Mapping[str, Any]]) -> None:
    """Each tool's name is OpenAI's kind of name, and its `parameters` a JSON schema object
    whose `properties` map names to schema objects (the tool-call parser types the model's
    values with them), with well-shaped keywords throughout."""
    for i, tool in enumerate(tools):
        name = tool["function"].get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise RequestError(
                f"a function name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
                param=f"tools[{i}].function.name",
            )
        where = f"tools[{i}].function.parameters"
        parameters = tool["function"].get("parameters")
        if isinstance(parameters, Mapping):
            check_schema_shape(parameters, where)
            refuse_remote_refs(parameters, where, f"tool {name!r}")
        if parameters is None:
            continue
        if not isinstance(parameters, Mapping):
            raise RequestError("parameters must be a JSON schema object", param=where)
        properties = parameters.get("properties")
        if properties is None:
            continue
        if not isinstance(properties, Mapping):
            raise RequestError(
                "properties must be an object mapping parameter names to JSON schemas",
                param=f"{where}.properties",
            )
        for name, schema in properties.items():
            if not isinstance(schema, Mapping):
                raise RequestError(
                    "a parameter's schema must be an object", param=f"{where}.properties.{name}"
                )


def check_schema_shape(schema: Any, where: str, depth: int = 0) -> None:
    """The keywords of a JSON schema have the shapes JSON Schema gives them (`required` a list
    of strings, `enum` a list, `properties` an object of schemas, lengths non-negative
    integers, ...), so that what reads them later fails on nothing. RequestError naming the
    first that does not."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise RequestError("a JSON schema must be an object (or a boolean)", param=where)
    if depth > _SCHEMA_DEPTH:
        raise RequestError(f"a JSON schema nested over {_SCHEMA_DEPTH} levels", param=where)
    for key in _SCHEMA_LISTS:
        if key in schema and not isinstance(schema[key], list):
            raise RequestError(f"{key} must be a list", param=f"{where}.{key}")
    if "required" in schema and not all(isinstance(n, str) for n in schema["required"]):
        raise RequestError("required must list property names", param=f"{where}.required")
    for key in _SCHEMA_NUMBERS:
        value = schema.get(key)
        if key in schema and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise RequestError(f"{key} must be a non-negative integer", param=f"{where}.{key}")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if "type" in schema and not all(isinstance(k, str) for k in kinds):
        raise RequestError("type must be a type name or a list of them", param=f"{where}.type")
    for key in _SCHEMA_MAPPINGS:
        if key not in schema:
            continue
        if not isinstance(schema[key], Mapping):
            raise RequestError(f"{key} must be an object of schemas", param=f"{where}.{key}")
        for name, sub in schema[key].items():
            check_schema_shape(sub, f"{where}.{key}.{name}", depth + 1)
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        for j, sub in enumerate(schema.get(key, ())):
            check_schema_shape(sub, f"{where}.{key}[{j}]", depth + 1)
    for key in ("items", "not", "if", "then", "else", "additionalProperties", "contains"):
        if key in schema:
            check_schema_shape(schema[key], f"{where}.{key}", depth + 1)


def refuse_remote_refs(schema: Any, where: str, owner: str) -> None:
    """Every `$ref` in `schema` points inside it (`#`, `#/$defs/...`): Lily fetches no schema
    from elsewhere, and a reference it cannot resolve would leave what it stands for unchecked
    in one case (a tool the model may call: its arguments are typed by the schema) and refuse
    the request in another (a forced call or a `json_schema` answer, whose grammar needs it).
    RequestError naming `owner` (the tool, or the response format) and the `$ref`'s place."""
    if not isinstance(schema, Mapping):
        return
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        raise RequestError(
            f"{owner}: the $ref {ref!r} points outside the schema, and Lily fetches no schema "
            "from elsewhere; put the referenced schema under $defs and refer to it as "
            "'#/$defs/NAME'",
            param=f"{where}.$ref",
            code="unsupported_schema",
        )
    for key in SUBSCHEMA_KEYWORDS:
        if isinstance(schema.get(key), Mapping):
            refuse_remote_refs(schema[key], f"{where}.{key}", owner)
    for key in SUBSCHEMA_LIST_KEYWORDS:
        if isinstance(schema.get(key), list):
            for j, member in enumerate(schema[key]):
                refuse_remote_refs(member, f"{where}.{key}[{j}]", owner)
    for key in SUBSCHEMA_MAP_KEYWORDS:
        if isinstance(schema.get(key), Mapping):
            for name, sub in schema[key].items():
                refuse_remote_refs(sub, f"{where}.{key}.{name}", owner)


def check_template_kwargs(kwargs: Mapping[str, Any], template: ChatTemplate | None) -> None:
    """Template keywords may set only variables the template reads, and not those the renderer
    sets from the request itself; `enable_thinking` must be a boolean (the template tests
    `is false`, so "false" would leave thinking on)."""
    for key, value in kwargs.items():
        param = f"chat_template_kwargs.{key}"
        if template is not None and key in template.reserved_variables:
            raise RequestError(
                f"{param} is set by Lily from the request itself (messages, tools, ...), "
                "not by a template keyword",
                param=param,
                code="reserved_template_variable",
            )
        if template is not None and key not in template.keyword_variables:
            known = ", ".join(sorted(template.keyword_variables)) or "none"
            raise RequestError(
                f"the chat template reads no variable {key!r} (it reads: {known})",
                param=param,
                code="unknown_template_variable",
            )
        if key == "enable_thinking" and not isinstance(value, bool):
            raise RequestError("enable_thinking must be a boolean", param=param)
