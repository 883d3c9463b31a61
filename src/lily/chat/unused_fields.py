"""Request fields OpenAI clients send that do not change what is generated: accepted when well
typed, and otherwise not used (Lily keeps no stored completions, tiers or end-user records)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from lily.errors import RequestError

METADATA_ENTRIES = 16


def _metadata(value: Any) -> bool:
    return (
        isinstance(value, Mapping)
        and len(value) <= METADATA_ENTRIES
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    )


# Field -> (what it must be, the check).
UNUSED_FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "user": ("a string", lambda v: isinstance(v, str)),
    "safety_identifier": ("a string", lambda v: isinstance(v, str)),
    "metadata": (
        f"an object of at most {METADATA_ENTRIES} string values",
        _metadata,
    ),
    "service_tier": ("a string", lambda v: isinstance(v, str)),
    "store": ("a boolean", lambda v: isinstance(v, bool)),
}


def check_unused_fields(params: Mapping[str, Any]) -> None:
    """Refuses an unused field of the wrong type (null is always fine)."""
    for name, (allowed, ok) in UNUSED_FIELDS.items():
        value = params.get(name)
        if value is not None and not ok(value):
            raise RequestError(f"{name} must be {allowed}", param=name)
