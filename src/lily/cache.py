"""Lily's cache directory, and the one way things are written into it: built aside, then renamed
into place, so a reader (or a second process building the same thing) never sees half of it."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """`$LILY_CACHE`, default `~/.cache/lily`."""
    return Path(os.environ.get("LILY_CACHE") or Path.home() / ".cache" / "lily")


def build_once(final: Path, build: Callable[[Path], None]) -> Path:
    """`final`, after calling `build(directory)` to create it if it does not exist yet. Builds
    of the same `final` must produce the same content: when two processes race, the first
    rename wins and the other's copy is discarded."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        build(work / "out")
        try:
            os.rename(work / "out", final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final
