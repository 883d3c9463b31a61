"""The request fields that adjust the logits before sampling: OpenAI's `logit_bias`,
`presence_penalty` and `frequency_penalty`, and `repetition_penalty` (an extra field, with the
meaning vLLM and mlx-lm give it). Their ranges are `SamplingParams`' to check; this module
checks the JSON shapes and turns them into `SamplingParams` fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lily.errors import RequestError

ADJUSTMENT_FIELDS = ("logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty")
PENALTY_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_id(key: object) -> int:
    """A logit_bias key: a token id, as a JSON object key (a string of digits) or an int."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    raise RequestError(
        f"logit_bias keys must be token ids (strings of digits), got {key!r}", param="logit_bias"
    )


def adjustment_fields(params: Mapping[str, Any]) -> dict[str, Any]:
    """The SamplingParams keyword arguments the request's adjustment fields give (a field set
    to null takes its default)."""
    fields: dict[str, Any] = {}
    bias = params.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, Mapping):
            raise RequestError("logit_bias must be an object", param="logit_bias")
        for value in bias.values():
            if not _is_number(value):
                raise RequestError("logit_bias values must be numbers", param="logit_bias")
        pairs = sorted((_token_id(k), float(v)) for k, v in bias.items())
        fields["logit_bias"] = tuple(pairs)
    for name in PENALTY_FIELDS:
        value = params.get(name)
        if value is None:
            continue
        if not _is_number(value):
            raise RequestError(f"{name} must be a number", param=name)
        fields[name] = float(value)
    return fields
