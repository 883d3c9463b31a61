"""Lily's cache directory, and the one way things are written into it: built aside, then renamed
into place, so a reader (or a second process building the same thing) never sees half of it."""

from __future__ import annotations

import os
import re
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
    rename wins and the other's copy is discarded. A build that fails is removed; one whose
    process was killed is removed by the next build of the same `final`."""
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_builds(final)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}-{os.getpid()}-", dir=final.parent))
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


def _remove_abandoned_builds(final: Path) -> None:
    """Removes the work directories of builds of `final` whose process no longer runs (one
    killed mid-build, which could not clean up after itself). Processes are looked up on this
    machine, by the id in the directory's name."""
    # mkdtemp's random part is 8 characters of [a-z0-9_]: no other final's work matches.
    pattern = re.compile(re.escape(f".{final.name}-") + r"(\d+)-[a-z0-9_]{8}")
    for entry in final.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and not _process_runs(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _process_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True
