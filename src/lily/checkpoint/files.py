"""Which files of a checkpoint directory Lily opens, and how.

A checkpoint is data from elsewhere (a download, a colleague's conversion), so nothing in it may
make Lily read outside it or wait forever:

- a file name taken from the checkpoint (a shard the index names) is a relative path inside the
  directory: never absolute, never through `..`;
- a symbolic link must resolve inside the directory, or be one of the Hugging Face cache's own
  links (`snapshots/<revision>/<file>` -> `../../blobs/<hash>`, into the same cache's blobs),
  unless links leading elsewhere are allowed (`allow_external_links=True`, or the environment
  variable `LILY_ALLOW_EXTERNAL_LINKS=1`), e.g. for shards kept on another disk;
- only regular files are opened, and the open never blocks: a FIFO or a device is refused.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from lily.errors import CheckpointError

EXTERNAL_LINKS_ENV = "LILY_ALLOW_EXTERNAL_LINKS"
# config.json, the index, tokenizer files: far above any real one (the index is ~100 kB).
MAX_JSON_BYTES = 64 << 20


def external_links_allowed(allow: bool | None = None) -> bool:
    """`allow` if given, else whether `LILY_ALLOW_EXTERNAL_LINKS` is set to a true value."""
    if allow is not None:
        return allow
    return os.environ.get(EXTERNAL_LINKS_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def checkpoint_file(
    directory: str | Path,
    name: object,
    allow_external_links: bool | None = None,
    what: str = "file",
) -> Path:
    """`directory / name`, after checking that `name` stays inside the directory and that the
    file, links followed, does too (see the module docstring). The file must exist; `what` it
    is names it in the error if not."""
    directory = Path(directory)
    if not isinstance(name, str) or not name or "\0" in name or "\\" in name:
        raise CheckpointError(f"{directory}: {name!r} is not a valid file name")
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise CheckpointError(
            f"{directory}: file name {name!r} points outside the checkpoint directory"
        )
    path = directory / relative
    try:
        real = path.resolve(strict=True)
        root = directory.resolve(strict=True)
    except FileNotFoundError:
        raise CheckpointError(f"missing {what} {path}") from None
    except (OSError, RuntimeError) as e:  # a link loop, a path too long
        raise CheckpointError(f"{path} cannot be resolved: {e}") from None
    if real.is_relative_to(root) or _is_hugging_face_blob(root, real):
        return path
    if not external_links_allowed(allow_external_links):
        raise CheckpointError(
            f"{path} is a link to {real}, outside the checkpoint directory; set "
            f"{EXTERNAL_LINKS_ENV}=1 to load files linked from elsewhere"
        )
    return path


def _is_hugging_face_blob(root: Path, real: Path) -> bool:
    """Whether `real` is a blob of the Hugging Face cache repo whose snapshot `root` is."""
    return root.parent.name == "snapshots" and real.parent == root.parent.parent / "blobs"


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for reading, refused (CheckpointError) unless it is a regular file. The
    open does not block, so a FIFO is refused rather than waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path} is not a regular file")
    return os.fdopen(fd, "rb")


def read_json_file(path: str | Path, max_bytes: int = MAX_JSON_BYTES) -> object:
    """The parsed JSON of a regular file of at most `max_bytes`, or CheckpointError."""
    with open_regular(path) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise CheckpointError(f"{path} is larger than {max_bytes} bytes")
    try:
        return json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path} is not UTF-8 text") from None
    except ValueError as e:  # JSONDecodeError, or an integer of too many digits
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise CheckpointError(f"{path} is not valid JSON: nested too deeply") from None
