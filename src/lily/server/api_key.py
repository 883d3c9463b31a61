"""The server's API key: where it comes from, and how a request's `Authorization` header is
checked against it.

A key given on the command line is visible to every user of the machine (`ps`, shell history),
so it can also come from a file or from the `LILY_API_KEY` environment variable. Keys are UTF-8
text; they are compared as bytes, in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

API_KEY_ENV = "LILY_API_KEY"


class APIKeyError(ValueError):
    """An API key that cannot be used: unreadable file, empty, or not sendable in a header."""


def resolve_api_key(
    api_key: str | None = None,
    api_key_file: str | os.PathLike[str] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> str | None:
    """The key the server requires: `api_key`, else the content of `api_key_file`, else
    `$LILY_API_KEY` (unset or empty means no key). Giving both `api_key` and `api_key_file` is an
    error."""
    if api_key is not None and api_key_file is not None:
        raise APIKeyError("give the API key one way: api_key or api_key_file, not both")
    if api_key_file is not None:
        key = _read_key_file(Path(api_key_file))
    elif api_key is not None:
        key = api_key
    else:
        key = environ.get(API_KEY_ENV) or None
        if key is None:
            return None
    _check_usable(key)
    return key


def _read_key_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise APIKeyError(f"the API key file {path} is not UTF-8 text") from None
    except OSError as exc:
        raise APIKeyError(f"cannot read the API key file {path}: {exc.strerror}") from None
    lines = text.strip().splitlines()
    if len(lines) != 1:
        raise APIKeyError(f"the API key file {path} must hold the key on one line")
    return lines[0].strip()


def _check_usable(key: str) -> None:
    """Refuses keys no client could send: an HTTP header cannot carry control characters, and
    the header's surrounding whitespace is not part of the token."""
    if not key:
        raise APIKeyError("the API key is empty")
    if key != key.strip():
        raise APIKeyError("the API key starts or ends with whitespace")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in key):
        raise APIKeyError("the API key contains control characters")


def bearer_key_matches(authorization: bytes, key: str) -> bool:
    """Whether the raw `Authorization` header value is `Bearer <key>`, the key as UTF-8 bytes.

    Raw bytes, because servers decode header values as Latin-1: a UTF-8 key compared as that
    text would never match."""
    scheme, _, token = authorization.partition(b" ")
    matches = hmac.compare_digest(token.strip(b" \t"), key.encode("utf-8"))
    return scheme.lower() == b"bearer" and matches
