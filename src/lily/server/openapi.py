"""The HTTP API's description: the JSON schema of a chat-completions request, which the server
checks request bodies with, and the OpenAPI document that publishes it with the routes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lily.chat.choices import MAX_CHOICES
from lily.engine.sampling import MAX_SEED, MAX_TOP_K, PENALTY_LIMIT
from lily.errors import RequestError
from lily.version import __version__

_INT64 = (-(2**63), 2**63 - 1)


# --- The request schema: checks request bodies and is published in the OpenAPI document ------

_STRING: dict[str, Any] = {"type": "string"}
# Parts other than text (images, audio) are refused by the facade: 400, naming the part.
_CONTENT_PART = {
    "type": "object",
    "required": ["type"],
    "properties": {"type": _STRING, "text": _STRING},
}
_TOOL_CALL = {
    "type": "object",
    "required": ["function"],
    "properties": {
        "id": _STRING,
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {"name": _STRING, "arguments": _STRING},
        },
    },
}
_MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"type": ["string", "array", "null"], "items": _CONTENT_PART},
        "reasoning_content": {"type": ["string", "null"]},
        "name": _STRING,
        "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL},
        "tool_call_id": _STRING,
    },
}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": _STRING,
                "description": _STRING,
                "parameters": {
                    "type": "object",
                    "properties": {"properties": {"type": "object"}},
                },
                "strict": {"type": ["boolean", "null"]},
            },
        },
    },
}


def _nullable(kind: str, **bounds: Any) -> dict[str, Any]:
    return {"type": [kind, "null"], **bounds}


CHAT_REQUEST_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "description": "Fields set to null take their default. Other fields are answered with "
    "400 unsupported_parameter, naming them.",
    # Enforced by the facade (naming the fields as unsupported) rather than by `validate`.
    "additionalProperties": False,
    "properties": {
        "messages": {"type": "array", "minItems": 1, "items": _MESSAGE},
        "model": _nullable("string"),
        "max_tokens": _nullable("integer", minimum=1),
        "max_completion_tokens": _nullable("integer", minimum=1),
        "stream": _nullable("boolean"),
        "stream_options": {
            "type": ["object", "null"],
            "properties": {"include_usage": {"type": "boolean"}},
            "additionalProperties": False,
        },
        "stop": {"type": ["string", "array", "null"], "items": _STRING},
        "temperature": _nullable("number", minimum=0, maximum=2),
        "top_p": _nullable("number", exclusiveMinimum=0, maximum=1),
        "top_k": _nullable("integer", minimum=0, maximum=MAX_TOP_K),
        "min_p": _nullable("number", minimum=0, maximum=1),
        "seed": _nullable("integer", minimum=0, maximum=MAX_SEED),
        "logprobs": _nullable("boolean"),
        "top_logprobs": _nullable("integer", minimum=0, maximum=20),
        "tools": {"type": ["array", "null"], "items": _TOOL},
        "tool_choice": {
            "type": ["string", "object", "null"],
            "properties": {
                "type": {"type": "string", "enum": ["function"]},
                "function": {"type": "object", "properties": {"name": _STRING}},
            },
        },
        "parallel_tool_calls": _nullable("boolean"),
        "response_format": {
            "type": ["object", "null"],
            "required": ["type"],
            "properties": {
                "type": {"type": "string", "enum": ["text", "json_object", "json_schema"]},
                "json_schema": {
                    "type": "object",
                    "required": ["name"],
                    "properties": {
                        "name": _STRING,
                        "schema": {"type": "object"},
                        "strict": _nullable("boolean"),
                    },
                },
            },
            "description": "enforced while generating (docs/structured-output.md)",
        },
        "prompt_cache_key": _nullable("string"),
        "prediction": {
            "type": ["object", "null"],
            "required": ["type", "content"],
            "properties": {
                "type": {"type": "string", "enum": ["content"]},
                "content": {
                    "type": ["string", "array"],
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"type": "string", "enum": ["text"]},
                            "text": _STRING,
                        },
                        "additionalProperties": False,
                    },
                },
            },
            "additionalProperties": False,
            "description": "OpenAI's Predicted Outputs: text the answer is expected to repeat; "
            "drafted from and verified, so the answer is the same with or without it "
            "(docs/server.md)",
        },
        "chat_template_kwargs": _nullable("object"),
        "reasoning_effort": {
            "type": ["string", "null"],
            "enum": ["none", "minimal", "low", "medium", "high", "xhigh", None],
            "description": '"none" turns thinking off; the others leave it on',
        },
        "reasoning_budget": _nullable(
            "integer",
            minimum=0,
            description="the most tokens the model thinks before Lily closes the think block "
            "itself and the answer follows",
        ),
        "n": _nullable(
            "integer",
            minimum=1,
            maximum=MAX_CHOICES,
            description="choices, run one after the other from one feeding of the prompt; "
            "choice i samples with seed + i",
        ),
        "logit_bias": _nullable(
            "object",
            description="token id (a string of digits) -> bias in [-100, 100], added to the "
            "logit before sampling; -100 bans the token",
        ),
        "presence_penalty": _nullable("number", minimum=-PENALTY_LIMIT, maximum=PENALTY_LIMIT),
        "frequency_penalty": _nullable("number", minimum=-PENALTY_LIMIT, maximum=PENALTY_LIMIT),
        "repetition_penalty": _nullable(
            "number",
            exclusiveMinimum=0,
            description="vLLM's and mlx-lm's: the logits of tokens in the prompt or the "
            "completion so far are divided by it when positive, multiplied when negative",
        ),
        "user": _nullable("string", description="accepted, not used"),
        "safety_identifier": _nullable("string", description="accepted, not used"),
        "metadata": _nullable("object", description="accepted, not used"),
        "service_tier": _nullable("string", description="accepted, not used"),
        "store": _nullable("boolean", description="accepted, not used: nothing is stored"),
    },
}

_JSON_TYPES: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
    "null": lambda v: v is None,
}


class SchemaError(RequestError):
    """Well-formed JSON whose field has the wrong type or range: a 400 `invalid_request_error`
    naming the field, as OpenAI answers it (clients and peers' test suites expect 400, not the
    422 of FastAPI-style servers)."""


def _schema_error(where: str, message: str) -> SchemaError:
    return SchemaError(f"{where}: {message}", param=where, code="invalid_type")


def validate(value: Any, schema: dict[str, Any], where: str) -> None:
    """Checks `value` against the JSON Schema subset used above (type, enum, minimum, maximum,
    exclusiveMinimum, minItems, items, properties, required); raises a 400 naming the first
    offending field."""
    kinds = schema.get("type")
    if kinds is not None:
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if not any(_JSON_TYPES[kind](value) for kind in kinds):
            expected = " or ".join(kinds)
            raise _schema_error(where, f"expected {expected}, got {json_type_name(value)}")
    if "enum" in schema and value not in schema["enum"]:
        raise _schema_error(where, f"must be one of {', '.join(map(str, schema['enum']))}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        low = schema.get("minimum", _INT64[0] if isinstance(value, int) else -math.inf)
        high = schema.get("maximum", _INT64[1] if isinstance(value, int) else math.inf)
        if not low <= value <= high:
            raise _schema_error(where, f"must be between {low} and {high}, got {value}")
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            raise _schema_error(where, f"must be above {schema['exclusiveMinimum']}, got {value}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            raise _schema_error(where, f"needs at least {schema['minItems']} item(s)")
        if "items" in schema:
            for i, item in enumerate(value):
                validate(item, schema["items"], f"{where}[{i}]")
    if isinstance(value, dict):
        for name in schema.get("required", ()):
            if name not in value:
                raise _schema_error(f"{where}.{name}", "is required")
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                validate(value[name], sub, f"{where}.{name}")


def json_type_name(value: Any) -> str:
    for name in ("null", "boolean", "integer", "number", "string", "array", "object"):
        if _JSON_TYPES[name](value):
            return name
    return type(value).__name__


# --- OpenAPI ----------------------------------------------------------------------------------


def _error_response(description: str) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }


# The body of `GET /ready`, both when ready and when not (then with `reason` and `message`).
_READINESS = {
    "type": "object",
    "required": ["status", "waiting", "queue_limit"],
    "properties": {
        "status": {"type": "string", "enum": ["ready", "unavailable"]},
        "reason": {"type": "string", "enum": ["starting", "shutting_down", "queue_full"]},
        "message": _STRING,
        "waiting": {"type": "integer", "minimum": 0},
        "queue_limit": {"type": "integer", "minimum": 1},
    },
}

# One server-sent event of a stream.
_SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "a chat.completion.chunk as JSON; the last event is [DONE]",
        }
    },
}

CHAT_REQUEST_EXAMPLES = {
    "simple": {
        "summary": "One question, a short answer",
        "value": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    },
    "streamed": {
        "summary": "Streamed, seeded sampling, usage in the last event, no thinking",
        "value": {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
            ],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.7,
            "seed": 42,
            "chat_template_kwargs": {"enable_thinking": False},
        },
    },
    "json": {
        "summary": "An answer that is a JSON object valid for a schema",
        "value": {
            "messages": [{"role": "user", "content": "Name a colour, as JSON."}],
            "max_tokens": 16,
            "reasoning_effort": "none",
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "colour",
                    "strict": True,
                    "schema": {
                        "type": "object",
                        "properties": {"colour": {"type": "string"}},
                        "required": ["colour"],
                        "additionalProperties": False,
                    },
                },
            },
        },
    },
}


def openapi_document() -> dict[str, Any]:
    """The OpenAPI 3.1 description of the routes; the request schema is the one the server
    validates with."""
    errors = {
        "400": _error_response(
            "Malformed JSON, a field of the wrong type or out of range, a request over the "
            "server's bounds, or one Lily will not run"
        ),
        "401": _error_response("Missing or wrong API key (only with --api-key)"),
        "404": _error_response("Unknown model"),
        "408": _error_response("Headers or body not received within the server's timeouts"),
        "413": _error_response("Body over the size limit"),
        "415": _error_response("Content-Type is not application/json"),
        "503": _error_response("Queue full; retry after Retry-After seconds"),
    }
    json_object = {"type": "object"}
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Lily",
            "version": __version__,
            "description": "The OpenAI chat-completions API served by Lily on one local model.",
        },
        "paths": {
            "/v1/chat/completions": {
                "post": {
                    "operationId": "createChatCompletion",
                    "summary": "Generate a chat completion (JSON, or SSE when stream is true)",
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": CHAT_REQUEST_SCHEMA,
                                "examples": CHAT_REQUEST_EXAMPLES,
                            }
                        },
                    },
                    "responses": {
                        "200": {
                            "description": "A chat.completion object, or with stream=true a "
                            "text/event-stream of chat.completion.chunk objects ending with "
                            "'data: [DONE]'",
                            "content": {
                                "application/json": {"schema": json_object},
                                "text/event-stream": {"schema": _SSE_EVENT},
                            },
                        },
                        **errors,
                    },
                }
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "summary": "The model this server runs",
                    "responses": {
                        "200": {
                            "description": "A list object",
                            "content": {"application/json": {"schema": json_object}},
                        },
                        "401": errors["401"],
                    },
                }
            },
            "/v1/models/{model}": {
                "get": {
                    "operationId": "retrieveModel",
                    "summary": "One model by id",
                    "parameters": [
                        {"name": "model", "in": "path", "required": True, "schema": _STRING}
                    ],
                    "responses": {
                        "200": {
                            "description": "A model object",
                            "content": {"application/json": {"schema": json_object}},
                        },
                        "401": errors["401"],
                        "404": errors["404"],
                    },
                }
            },
            "/health": {
                "get": {
                    "operationId": "health",
                    "summary": "Liveness and queue state (never needs the API key)",
                    "responses": {
                        "200": {
                            "description": "Server status",
                            "content": {"application/json": {"schema": json_object}},
                        }
                    },
                }
            },
            "/ready": {
                "get": {
                    "operationId": "ready",
                    "summary": "Readiness: whether a request sent now would be taken (never "
                    "needs the API key)",
                    "responses": {
                        "200": {
                            "description": "Ready: a request would be queued for the engine",
                            "content": {"application/json": {"schema": _READINESS}},
                        },
                        "503": {
                            "description": "Not ready: starting, shutting down, or the queue "
                            "is full (`reason`); retry after Retry-After seconds",
                            "content": {"application/json": {"schema": _READINESS}},
                        },
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Load and work counters in Prometheus's text format "
                    "(OpenMetrics when the Accept header asks for it); open unless the server "
                    "runs with --no-open-metrics",
                    "responses": {
                        "200": {
                            "description": "The series listed in docs/server.md",
                            "content": {
                                "text/plain": {"schema": _STRING},
                                "application/openmetrics-text": {"schema": _STRING},
                            },
                        },
                        "401": errors["401"],
                    },
                }
            },
        },
        "components": {
            "schemas": {
                "Error": {
                    "type": "object",
                    "required": ["error"],
                    "properties": {
                        "error": {
                            "type": "object",
                            "required": ["message", "type", "param", "code"],
                            "properties": {
                                "message": _STRING,
                                "type": _STRING,
                                "param": {"type": ["string", "null"]},
                                "code": {"type": ["string", "null"]},
                            },
                        }
                    },
                }
            },
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
    }
