"""Prefix states on disk, so that the first request after a restart resumes a long prompt.

One file per saved prefix, named `<tokens>-<digest>.prefix`, where the digest hashes the model's
identity and the prefix's token ids: a lookup hashes the prompt's prefixes at the lengths the
directory's names list, longest first, and opens only a file whose name matches. A file holds

    MAGIC | sha256 of everything after it | header length (u64) | JSON header | payload

where the header names the model identity, the token count and each array's dtype and shape,
and the payload is the token ids followed by the KV rows [0, n) and the recurrent state. A file
is used only if its checksum, identity and token ids all agree; anything else (a truncated or
tampered file, another model's) is deleted and the prefix is computed again. Files are written
aside and renamed into place, and the directory is kept under `max_bytes` by deleting the least
recently used files (a hit refreshes a file's modification time).

The engine saves in the background (`save_in_background`): hashing and writing a long prefix
(tens to hundreds of MB on the real model) would otherwise hold up the end of every answer.
`flush()` waits for those writes; closing the engine flushes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from lily.checkpoint import Checkpoint

logger = logging.getLogger("lily.prefix_cache")

MAGIC = b"LILYPFX1"
SUFFIX = ".prefix"
_DIGEST = hashlib.sha256().digest_size
_LENGTH = struct.Struct("<Q")
# Bytes hashed at each of three places of every shard for the model identity: enough to tell
# checkpoints apart without reading gigabytes at load time.
_IDENTITY_SAMPLE = 1 << 20
DEFAULT_DISK_BYTES = 16 << 30
DEFAULT_MIN_TOKENS = 1024
# Background writes queued at most: each holds its prefix's rows in host memory until written.
_MAX_PENDING_WRITES = 2


def model_identity(checkpoint: Checkpoint, engine_kind: str) -> str:
    """A digest of what a saved state depends on: the config, the weights (each shard's name,
    size, and bytes at its start, middle and end), and the engine's state layout."""
    identity = hashlib.sha256(engine_kind.encode())
    identity.update(json.dumps(checkpoint.config.raw, sort_keys=True).encode())
    for path in sorted(checkpoint.shards, key=lambda p: Path(p).name):
        data = checkpoint.shards[path].buffer
        identity.update(f"{Path(path).name}:{data.size}".encode())
        for start in (0, data.size // 2, max(data.size - _IDENTITY_SAMPLE, 0)):
            identity.update(data[start : start + _IDENTITY_SAMPLE].tobytes())
    return identity.hexdigest()


@dataclass(frozen=True)
class DiskEntry:
    tokens: list[int]
    rows: list[np.ndarray]  # KV rows [0, len(tokens)), one array per cache
    state: list[np.ndarray]  # the recurrent state after `tokens`


class DiskPrefixCache:
    def __init__(
        self,
        directory: str | Path,
        identity: str,
        max_bytes: int = DEFAULT_DISK_BYTES,
        min_tokens: int = DEFAULT_MIN_TOKENS,
    ) -> None:
        """Prefixes of at least `min_tokens` tokens are saved, within `max_bytes` in total."""
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError("the disk cache needs max_bytes >= 0 and min_tokens >= 1")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.identity = identity
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        # What happened, for logs and tests: files read, and files found unusable (deleted).
        self.hits = 0
        self.rejected = 0
        self._writer: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Path, Future[None]]] = deque()

    def path_of(self, tokens: Sequence[int]) -> Path:
        digest = hashlib.sha256(self.identity.encode())
        digest.update(np.asarray(tokens, dtype=np.uint32).tobytes())
        return self.directory / f"{len(tokens)}-{digest.hexdigest()[:40]}{SUFFIX}"

    def _lengths(self) -> list[int]:
        lengths = set()
        for entry in self.directory.iterdir():
            head, _, rest = entry.name.partition("-")
            if rest.endswith(SUFFIX) and head.isdigit():
                lengths.add(int(head))
        return sorted(lengths, reverse=True)

    def load_longest(self, prompt: Sequence[int], longer_than: int = 0) -> DiskEntry | None:
        """The longest saved prefix of `prompt` longer than `longer_than` tokens and shorter
        than the prompt (whose last token must still be fed), checked; None if there is none."""
        for length in self._lengths():
            if not longer_than < length < len(prompt):
                continue
            path = self.path_of(prompt[:length])
            entry = self._read(path, prompt[:length])
            if entry is not None:
                self.hits += 1
                logger.info("prefix cache: %d tokens read from %s", length, path.name)
                return entry
        return None

    def _read(self, path: Path, tokens: Sequence[int]) -> DiskEntry | None:
        try:
            data = bytearray(path.read_bytes())
        except FileNotFoundError:
            return None
        entry = self._parse(data, tokens)
        if entry is None:
            self.rejected += 1
            logger.warning("prefix cache: %s is damaged or not this model's: deleted", path)
            path.unlink(missing_ok=True)
        else:
            _refresh(path)
        return entry

    def _parse(self, data: bytearray, tokens: Sequence[int]) -> DiskEntry | None:
        """The entry in `data` if it is intact, this model's, and for exactly `tokens`."""
        fixed = len(MAGIC) + _DIGEST + _LENGTH.size
        if len(data) < fixed or data[: len(MAGIC)] != MAGIC:
            return None
        body = memoryview(data)[len(MAGIC) + _DIGEST :]
        if hashlib.sha256(body).digest() != data[len(MAGIC) : len(MAGIC) + _DIGEST]:
            return None
        (header_length,) = _LENGTH.unpack_from(body)
        try:
            header = json.loads(bytes(body[_LENGTH.size : _LENGTH.size + header_length]))
            if header["identity"] != self.identity or header["tokens"] != len(tokens):
                return None
            arrays = _unpack(body[_LENGTH.size + header_length :], header["arrays"])
        except (ValueError, KeyError, TypeError):
            return None
        if not arrays or arrays[0].tolist() != list(tokens):
            return None
        rows, state = arrays[1 : 1 + header["rows"]], arrays[1 + header["rows"] :]
        # The rows view the file's bytes; the state is copied so that it does not keep them
        # alive once the rows are dropped (a sequence continued in the engine's cache).
        return DiskEntry(list(tokens), rows, [a.copy() for a in state])

    def save_in_background(
        self, tokens: Sequence[int], rows: list[np.ndarray], state: list[np.ndarray]
    ) -> None:
        """`save` on a writer thread; the arrays must not change until `flush` returns. A write
        that fails is logged, not raised: the prefix is just computed again next time."""
        path = self.path_of(tokens)
        if any(queued == path for queued, _ in self._pending):
            return
        while len(self._pending) >= _MAX_PENDING_WRITES:
            self._wait_oldest()
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="lily-prefix-disk")
        tokens = list(tokens)
        self._pending.append((path, self._writer.submit(self.save, tokens, rows, state)))

    def flush(self) -> None:
        """Waits until every background save is on disk (or has failed and been logged)."""
        while self._pending:
            self._wait_oldest()

    def _wait_oldest(self) -> None:
        path, write = self._pending.popleft()
        try:
            write.result()
        except OSError as error:
            logger.warning("prefix cache: could not write %s: %s", path.name, error)

    def save(self, tokens: Sequence[int], rows: list[np.ndarray], state: list[np.ndarray]) -> None:
        """Writes the state after `tokens` (kept if already there), then trims the directory."""
        path = self.path_of(tokens)
        if path.exists():
            _refresh(path)
            return
        arrays = [np.asarray(tokens, dtype=np.uint32), *rows, *state]
        header = json.dumps(
            {
                "identity": self.identity,
                "tokens": len(tokens),
                "rows": len(rows),
                "arrays": [[a.dtype.str, list(a.shape)] for a in arrays],
            }
        ).encode()
        digest = hashlib.sha256(_LENGTH.pack(len(header)))
        digest.update(header)
        for array in arrays:
            digest.update(np.ascontiguousarray(array).data)
        descriptor, temporary = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(descriptor, "wb") as f:
                f.write(MAGIC + digest.digest() + _LENGTH.pack(len(header)) + header)
                for array in arrays:
                    f.write(np.ascontiguousarray(array).data)
            os.replace(temporary, path)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        self._trim()

    def _trim(self) -> None:
        """Deletes the least recently used files until the directory fits `max_bytes`."""
        files = []
        for entry in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue  # deleted by another process meanwhile
            files.append((stat.st_mtime_ns, stat.st_size, entry))
        total = sum(size for _, size, _ in files)
        for _, size, entry in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes:
                break
            entry.unlink(missing_ok=True)
            total -= size


def _refresh(path: Path) -> None:
    """Marks a file as just used: the LRU order is the files' modification times. (Not
    `Path.touch`, which would create an empty file if a trim deleted it meanwhile.)"""
    with contextlib.suppress(FileNotFoundError):
        os.utime(path)


def _unpack(payload: memoryview, specs: list) -> list[np.ndarray]:
    """The arrays `specs` ([dtype, shape] each) describe, in order, viewing `payload`; raises
    ValueError when the sizes do not add up to the payload's."""
    arrays, offset = [], 0
    for dtype_name, shape in specs:
        dtype = np.dtype(dtype_name)
        if dtype.hasobject:
            raise ValueError("object arrays are never written")
        count = int(np.prod(shape, dtype=np.int64))
        nbytes = count * dtype.itemsize
        if offset + nbytes > len(payload):
            raise ValueError("the payload is shorter than its header says")
        array = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
        arrays.append(array.reshape(shape))
        offset += nbytes
    if offset != len(payload):
        raise ValueError("the payload is longer than its header says")
    return arrays
