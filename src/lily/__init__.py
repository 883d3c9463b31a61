"""Lily: Qwen3.6-35B-A3B on Apple silicon through hand-written Metal kernels.

`import lily` stays light; the engine (and the native module) load on first use of `load`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

# Light (no numpy, no native module), and callers catch its classes before anything is loaded.
from lily import errors
from lily.version import __version__

if TYPE_CHECKING:
    from lily.api import Lily, load

__all__ = ["Lily", "errors", "load", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("Lily", "load"):
        from lily import api

        return getattr(api, name)
    raise AttributeError(f"module 'lily' has no attribute {name!r}")
