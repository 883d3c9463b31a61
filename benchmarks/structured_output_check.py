"""Constrained generations of the demo model: every answer must parse and validate.

The demo model has random weights, so whatever structure its answers have comes from the grammar
alone. This runs `--count` seeded generations (50 by default) of each of: a JSON schema with
nested objects, arrays, enums, required fields, numbers and strings; `json_object`; a forced
tool call (`tool_choice="required"`). It prints one line per kind (answers that validated, the
tokens generated, the time) and exits 1 if any answer failed. `--quick` is the reduced version
the test suite runs.

    python benchmarks/structured_output_check.py              # 50 of each, on the sim
    python benchmarks/structured_output_check.py --quick      # 3 of each
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import jsonschema

import lily

ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "maxLength": 10},
        "status": {"enum": ["pending", "shipped", 'quoted "x"']},
        "customer": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 8}, "vip": {"type": "boolean"}},
            "required": ["name"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "price": {"type": "number"},
                },
                "required": ["qty", "price"],
                "additionalProperties": False,
            },
            "minItems": 1,
            "maxItems": 2,
        },
    },
    "required": ["id", "status", "customer", "items"],
    "additionalProperties": False,
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "days"],
}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER_PARAMETERS}}]


def check_schema(message: Any) -> None:
    jsonschema.validate(json.loads(message.content), ORDER)


def check_object(message: Any) -> None:
    if not isinstance(json.loads(message.content), dict):
        raise ValueError(f"not a JSON object: {message.content!r}")


def check_tool_call(message: Any) -> None:
    if not message.tool_calls:
        raise ValueError(f"no tool call: {message.content!r}")
    for call in message.tool_calls:
        if call.function.name != "weather":
            raise ValueError(f"a call of {call.function.name!r}")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


KINDS: dict[str, tuple[dict[str, Any], Callable[[Any], None]]] = {
    "json_schema": (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "order", "schema": ORDER, "strict": True},
            }
        },
        check_schema,
    ),
    "json_object": ({"response_format": {"type": "json_object"}}, check_object),
    "tool_call": ({"tools": TOOLS, "tool_choice": "required"}, check_tool_call),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50, help="generations of each kind")
    parser.add_argument("--quick", action="store_true", help="3 generations of each kind")
    parser.add_argument("--device", default="sim", help="sim or reference")
    parser.add_argument("--max-tokens", type=int, default=160)
    args = parser.parse_args()
    count = 3 if args.quick else args.count
    failures = 0
    with lily.load("demo", device=args.device) as llm:
        for kind, (request, check) in KINDS.items():
            valid = tokens = 0
            started = time.perf_counter()
            for seed in range(count):
                completion = llm.chat.completions.create(
                    messages=[{"role": "user", "content": f"Answer number {seed}."}],
                    max_tokens=args.max_tokens,
                    temperature=1.0,
                    seed=seed,
                    reasoning_effort="none",
                    **request,
                )
                tokens += completion.usage.completion_tokens
                try:
                    check(completion.choices[0].message)
                    valid += 1
                except (ValueError, jsonschema.ValidationError) as error:
                    failures += 1
                    print(f"{kind} seed {seed}: {str(error).splitlines()[0]}", file=sys.stderr)
            elapsed = time.perf_counter() - started
            print(f"{kind}: {valid}/{count} valid, {tokens} tokens, {elapsed:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
