"""Prefix states on disk, so that the first request after a restart resumes a long prompt.

It is a cache: whatever is in the directory (damaged, planted, unreadable, a FIFO, a link, a
directory where a file should be, or no directory at all) costs at most the time to compute the
prefix again, never an error, a hang, unbounded memory or a wrong answer.

One file per saved prefix, named `<tokens>-<digest>.prefix`, where the digest hashes the model's
identity and the prefix's token ids: a lookup lists the directory (again only when it changed),
hashes the prompt once, taking the digest at each length the names list, and opens only a file
whose name matches. A file holds

    MAGIC | HMAC-SHA256 of everything after it | header length (u64) | JSON header | payload

where the header names the model identity, the full digest of the prefix, the token count, the
KV cache's format (an int8 cache's rows are never read into a bf16 one, nor the reverse: the
format is also part of the identity, so such a file is not even looked at) and each array's
dtype and shape, and the payload is the token ids followed by the KV rows [0, n)
and the recurrent state. The MAC's key is this installation's (`default_key`: a random key in
`$LILY_CACHE`, readable by its owner only), so that whoever can write the cache directory but
not read the key cannot make Lily use a file they wrote. A file is opened without following
links and without blocking, refused unless it is a regular file of exactly the size its model
and token count imply (checked before reading it), and used only if its MAC, its header (equal
to what this model's layout, `StateLayout`, gives for that prefix, field for field) and its
token ids all agree; anything else is deleted (or, when it cannot be, ignored from then on) and
the prefix is computed again. Files are written aside (`.lily-*.prefix.tmp`) and renamed into
place; the directory, recreated if it was deleted, is kept under `max_bytes` (temporary files
counted, those left by a killed writer removed after STALE_TEMPORARY_SECONDS) by deleting the
least recently used files (a hit refreshes a file's modification time).

The engine saves in the background (`save_in_background`): hashing and writing a long prefix
(tens to hundreds of MB on the real model) would otherwise hold up the end of every answer.
`flush()` waits for those writes; closing the engine flushes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import struct
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import numpy as np

from lily.checkpoint.cache import build_once, cache_root

if TYPE_CHECKING:
    from lily.checkpoint.loader import Checkpoint

logger = logging.getLogger("lily.engine.prefix_cache")

MAGIC = b"LILYPFX2"
SUFFIX = ".prefix"
_TAG = hashlib.sha256().digest_size
_LENGTH = struct.Struct("<Q")
_FIXED = len(MAGIC) + _TAG + _LENGTH.size
# Headers are a few hundred bytes; anything longer is not one of ours.
MAX_HEADER_BYTES = 1 << 16
_NAME = re.compile(r"([1-9][0-9]{0,8})-([0-9a-f]{40})" + re.escape(SUFFIX))
_TEMPORARY_PREFIX, _TEMPORARY_SUFFIX = ".lily-", SUFFIX + ".tmp"
_TEMPORARY = re.compile(re.escape(_TEMPORARY_PREFIX) + r"[a-z0-9_]+" + re.escape(_TEMPORARY_SUFFIX))
# A temporary file not written to for this long was left by a writer that died: removed by the
# next trim. (A live writer writes a file in seconds.)
STALE_TEMPORARY_SECONDS = 600
DEFAULT_DISK_BYTES = 16 << 30
DEFAULT_MIN_TOKENS = 1024
# Background writes queued at most: each holds its prefix's rows in host memory until written.
_MAX_PENDING_WRITES = 2
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC
KEY_BYTES = 32

Spec = tuple[str, tuple[int, ...]]  # an array's dtype (numpy's `dtype.str`) and shape


def model_identity(checkpoint: Checkpoint, engine_kind: str) -> str:
    """A digest of what a saved state depends on: the engine's state layout, the config, and
    the content of every shard (`checkpoint.shard_digest`: the aligned copy's digests, else
    each shard hashed once and remembered)."""
    from lily.checkpoint.loader import shard_digest

    identity = hashlib.sha256(engine_kind.encode())
    identity.update(json.dumps(checkpoint.config.raw, sort_keys=True).encode())
    for path in sorted(checkpoint.shards, key=lambda p: Path(p).name):
        identity.update(f"{Path(path).name}:{shard_digest(Path(path))}".encode())
    return identity.hexdigest()


@dataclass(frozen=True)
class StateLayout:
    """What an engine's saved state is made of: the KV cache's format ("bf16", "int8", or the
    reference engine's float dtype), each KV rows array's dtype and shape without its token
    axis (axis 1), and each recurrent-state array's dtype and shape."""

    kv_cache: str
    rows: tuple[Spec, ...]
    state: tuple[Spec, ...]

    @classmethod
    def of(
        cls, kv_cache: str, rows: Sequence[np.ndarray], state: Sequence[np.ndarray]
    ) -> StateLayout:
        """The layout of these arrays (rows of any number of tokens)."""
        return cls(
            kv_cache,
            tuple((a.dtype.str, (a.shape[0], *a.shape[2:])) for a in rows),
            tuple((a.dtype.str, tuple(a.shape)) for a in state),
        )

    def arrays(self, tokens: int) -> list[Spec]:
        """The arrays of a file holding `tokens` tokens: their ids, the rows, the state."""
        rows = [(dtype, (shape[0], tokens, *shape[1:])) for dtype, shape in self.rows]
        return [("<u4", (tokens,)), *rows, *self.state]

    def payload_bytes(self, tokens: int) -> int:
        return sum(_nbytes(spec) for spec in self.arrays(tokens))

    def fits(self, tokens: int, rows: Sequence[np.ndarray], state: Sequence[np.ndarray]) -> bool:
        found = [(a.dtype.str, tuple(a.shape)) for a in (*rows, *state)]
        return found == self.arrays(tokens)[1:]


def _nbytes(spec: Spec) -> int:
    return np.dtype(spec[0]).itemsize * int(np.prod(spec[1], dtype=np.int64))


def default_key() -> bytes:
    """The key of this installation's cache files: `$LILY_CACHE/prefix-cache-key/key`, 32
    random bytes made on first use, in a directory only its owner can enter. If it cannot be
    made or read (a read-only `$LILY_CACHE`), a key for this process alone, said in the log:
    files then serve only the process that wrote them."""
    directory = cache_root() / "prefix-cache-key"
    try:
        build_once(directory, _write_key)
        fd = os.open(directory / "key", _OPEN_FLAGS)
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("not a regular file")
            key = f.read(KEY_BYTES + 1)
        if len(key) != KEY_BYTES:
            raise OSError(f"not {KEY_BYTES} bytes")
        return key
    except OSError as error:
        logger.warning(
            "prefix cache: no key at %s (%s): files written now serve this process only",
            directory,
            error,
        )
        return secrets.token_bytes(KEY_BYTES)


def _write_key(out: Path) -> None:
    out.mkdir(mode=0o700)
    fd = os.open(out / "key", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(KEY_BYTES))


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
        layout: StateLayout | None = None,
        key: bytes | None = None,
    ) -> None:
        """Prefixes of at least `min_tokens` tokens are saved, within `max_bytes` in total.
        Nothing is read or written until the engine's `layout` is known (`PrefixCache` is told
        it by its engine). `key`: the files' MAC key (default: `default_key()`)."""
        if max_bytes < 0 or min_tokens < 1:
            raise ValueError("the disk cache needs max_bytes >= 0 and min_tokens >= 1")
        self.directory = Path(directory)
        self.identity = identity
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self.layout = layout
        self._key = default_key() if key is None else key
        # Names depend on the key too: a cache with another key (another `$LILY_CACHE` sharing
        # this directory) never opens this one's files, so it cannot find them unusable and
        # delete them. The directory's size bound is shared: each evicts the least recently
        # used files, whoever wrote them.
        self._name_salt = hmac.new(self._key, b"prefix file names", hashlib.sha256).digest()
        # What happened, for logs and tests: files read, and files found unusable (deleted).
        self.hits = 0
        self.rejected = 0
        self._writer: ThreadPoolExecutor | None = None
        self._pending: deque[tuple[Path, Future[None]]] = deque()
        # The names in the directory (token count -> digests) as of its version `_listed`.
        self._names: dict[int, set[str]] = {}
        self._listed: tuple[int, int, int] | None = None
        # Files found unusable that could not be deleted: name -> what they were (skipped
        # until they change).
        self._unusable: dict[str, tuple[int, int, int, int]] = {}
        self._warned: set[str] = set()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            self._warn("mkdir", "prefix cache: cannot create %s (%s): it is skipped until it "
                       "exists", self.directory, error)  # fmt: skip
        self._trim()

    def path_of(self, tokens: Sequence[int]) -> Path:
        return self.directory / _name(len(tokens), self._digest(tokens))

    def _digest(self, tokens: Sequence[int]) -> str:
        return self._digests(tokens, [len(tokens)])[len(tokens)]

    def _digests(self, tokens: Sequence[int], lengths: Sequence[int]) -> dict[int, str]:
        """The digest of each prefix of `tokens` at `lengths`, hashing `tokens` once."""
        ids = np.asarray(tokens, dtype=np.uint32)
        digest = hashlib.sha256(self.identity.encode() + self._name_salt)
        found, hashed = {}, 0
        for length in sorted(lengths):
            digest.update(ids[hashed:length].tobytes())
            hashed = length
            found[length] = digest.copy().hexdigest()
        return found

    # -- lookup ---------------------------------------------------------------------------------

    def _index(self) -> dict[int, set[str]]:
        """The directory's cache file names, listed again only when it has changed."""
        try:
            status = os.stat(self.directory)
            version = (status.st_dev, status.st_ino, status.st_mtime_ns)
            if version == self._listed:
                return self._names
            names: dict[int, set[str]] = {}
            with os.scandir(self.directory) as entries:
                for entry in entries:
                    match = _NAME.fullmatch(entry.name)
                    if match:
                        names.setdefault(int(match[1]), set()).add(match[2])
        except OSError:  # deleted, unreadable, not a directory: nothing to read
            self._names, self._listed = {}, None
            return self._names
        # A name added within the clock's resolution after the listing would not change the
        # version: a listing that recent is not kept.
        recent = time.time_ns() - status.st_mtime_ns < 2_000_000_000
        self._names, self._listed = names, None if recent else version
        return names

    def load_longest(self, prompt: Sequence[int], longer_than: int = 0) -> DiskEntry | None:
        """The longest saved prefix of `prompt` longer than `longer_than` tokens and shorter
        than the prompt (whose last token must still be fed), checked; None if there is none."""
        if self.layout is None:
            return None
        index = self._index()
        lengths = [n for n in index if longer_than < n < len(prompt)]
        if not lengths:
            return None
        digests = self._digests(prompt, lengths)
        for length in sorted(lengths, reverse=True):
            digest = digests[length]
            if digest[:40] not in index[length]:
                continue
            entry = self._read(self.directory / _name(length, digest), prompt[:length], digest)
            if entry is not None:
                self.hits += 1
                logger.info("prefix cache: %d tokens read from %s", length, _name(length, digest))
                return entry
        return None

    def _read(self, path: Path, tokens: Sequence[int], digest: str) -> DiskEntry | None:
        try:
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            self._listed = None
            return None
        except OSError as error:  # a symbolic link (ELOOP), an unreadable file
            self._reject(path, f"cannot be opened ({error.strerror})")
            return None
        try:
            status = os.fstat(fd)
            if self._unusable.get(path.name) == _version(status):
                return None
            if not stat.S_ISREG(status.st_mode):  # a FIFO, a directory, a device
                problem, entry = "is not a regular file", None
            else:
                with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
                    problem, entry = self._load(f, status, tokens, digest)
            if entry is not None:
                _refresh(fd)
                return entry
        finally:
            os.close(fd)
        self._reject(path, problem, status)
        return None

    def _load(
        self, f: BinaryIO, status: os.stat_result, tokens: Sequence[int], digest: str
    ) -> tuple[str, DiskEntry | None]:
        """The entry in the open file `f` if it is this model's, for exactly `tokens`, intact
        and written with this key; else why not."""
        assert self.layout is not None
        payload = self.layout.payload_bytes(len(tokens))
        if not _FIXED + payload <= status.st_size <= _FIXED + MAX_HEADER_BYTES + payload:
            return "does not have the size of this model's state of that prefix", None
        data = bytearray(status.st_size)
        view = memoryview(data)
        read = 0
        while read < len(data) and (count := f.readinto(view[read:])):
            read += count
        if read != len(data) or f.read(1):
            return "changed while it was read", None
        if data[: len(MAGIC)] != MAGIC:
            return "is not a prefix file of this version", None
        body = view[len(MAGIC) + _TAG :]
        tag = hmac.new(self._key, body, hashlib.sha256).digest()
        if not hmac.compare_digest(tag, data[len(MAGIC) : len(MAGIC) + _TAG]):
            return "is damaged or was not written with this installation's key", None
        (header_length,) = _LENGTH.unpack_from(body)
        if header_length != len(data) - _FIXED - payload:
            return "has a header of the wrong length", None
        try:
            header = json.loads(bytes(body[_LENGTH.size : _LENGTH.size + header_length]))
        except (ValueError, RecursionError):
            return "has a header that is not JSON", None
        if not isinstance(header, dict) or header.get("identity") != self.identity:
            return "is not this model's", None
        if header != self._header(tokens, digest):
            return "has a header that does not match this model's state of that prefix", None
        arrays = _unpack(body[_LENGTH.size + header_length :], self.layout.arrays(len(tokens)))
        if not np.array_equal(arrays[0], np.asarray(tokens, dtype=np.uint32)):
            return "holds other tokens", None
        rows, state = arrays[1 : 1 + len(self.layout.rows)], arrays[1 + len(self.layout.rows) :]
        # The rows view the file's bytes; the state is copied so that it does not keep them
        # alive once the rows are dropped (a sequence continued in the engine's cache).
        return "", DiskEntry(list(tokens), rows, [a.copy() for a in state])

    def _header(self, tokens: Sequence[int], digest: str) -> dict:
        assert self.layout is not None
        return {
            "identity": self.identity,
            "prefix": digest,
            "tokens": len(tokens),
            "kv_cache": self.layout.kv_cache,
            "rows": len(self.layout.rows),
            "arrays": [[dtype, list(shape)] for dtype, shape in self.layout.arrays(len(tokens))],
        }

    def _reject(self, path: Path, problem: str, status: os.stat_result | None = None) -> None:
        """Deletes an unusable file, or if it cannot be deleted, skips it until it changes."""
        self.rejected += 1
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as error:
            try:
                status = os.lstat(path) if status is None else status
                self._unusable[path.name] = _version(status)
            except OSError:
                pass
            self._warn(f"undeletable:{path.name}", "prefix cache: %s %s and cannot be deleted "
                       "(%s): ignored", path, problem, error.strerror)  # fmt: skip
            return
        self._listed = None
        logger.warning("prefix cache: %s %s: deleted", path, problem)

    # -- writing --------------------------------------------------------------------------------

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
        except Exception as error:
            self._warn(f"write:{type(error).__name__}", "prefix cache: could not write %s: %s",
                       path.name, error)  # fmt: skip

    def save(self, tokens: Sequence[int], rows: list[np.ndarray], state: list[np.ndarray]) -> None:
        """Writes the state after `tokens` (kept if already there), then trims the directory."""
        if self.layout is None or not self.layout.fits(len(tokens), rows, state):
            raise ValueError("the state does not have the layout the cache was told")
        digest = self._digest(tokens)
        path = self.directory / _name(len(tokens), digest)
        try:
            if stat.S_ISREG(os.lstat(path).st_mode):
                _refresh(path)
                return
        except FileNotFoundError:
            pass
        arrays = [np.asarray(tokens, dtype=np.uint32), *rows, *state]
        header = json.dumps(self._header(tokens, digest)).encode()
        tag = hmac.new(self._key, _LENGTH.pack(len(header)), hashlib.sha256)
        tag.update(header)
        for array in arrays:
            tag.update(np.ascontiguousarray(array).data)
        head = MAGIC + tag.digest() + _LENGTH.pack(len(header)) + header
        try:
            self._write(path, head, arrays)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            # The disk filled up before the cache reached `max_bytes`: the least recently used
            # files make room for this one, which is tried once more.
            size = len(head) + sum(np.asarray(a).nbytes for a in arrays)
            if not self._trim(free=size):
                raise
            self._write(path, head, arrays)
        self._listed = None
        self._trim()

    def _write(self, path: Path, head: bytes, arrays: list[np.ndarray]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)  # again, if deleted meanwhile
        descriptor, temporary = tempfile.mkstemp(
            prefix=_TEMPORARY_PREFIX, suffix=_TEMPORARY_SUFFIX, dir=self.directory
        )
        try:
            with os.fdopen(descriptor, "wb") as f:
                f.write(head)
                for array in arrays:
                    f.write(np.ascontiguousarray(array).data)
            os.replace(temporary, path)
        except BaseException:
            _remove(Path(temporary))
            raise

    def _trim(self, free: int = 0) -> bool:
        """Deletes the least recently used files until the directory fits `max_bytes`
        (temporary files counted; those of a writer that died deleted) and at least `free`
        bytes of them are gone; whether they are. Only names this cache writes are looked at;
        what cannot be deleted is skipped."""
        files, total, now = [], 0, time.time()
        try:
            with os.scandir(self.directory) as entries:
                listed = list(entries)
        except OSError:
            return False
        for entry in listed:
            temporary = _TEMPORARY.fullmatch(entry.name) is not None
            if not temporary and _NAME.fullmatch(entry.name) is None:
                continue
            try:
                status = entry.stat(follow_symlinks=False)
            except OSError:
                continue  # deleted by another process meanwhile
            path = Path(entry.path)
            if not stat.S_ISREG(status.st_mode):
                if not stat.S_ISDIR(status.st_mode):
                    _remove(path)  # a link or FIFO under a cache file's name: never read
                continue
            if temporary and now - status.st_mtime > STALE_TEMPORARY_SECONDS and _remove(path):
                continue
            total += status.st_size
            if not temporary:
                files.append((status.st_mtime_ns, status.st_size, path))
        freed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= self.max_bytes and freed >= free:
                break
            if _remove(path):
                total -= size
                freed += size
            else:
                self._warn(f"trim:{path.name}", "prefix cache: cannot delete %s", path)
        self._listed = None
        return freed >= free

    def _warn(self, what: str, message: str, *args: object) -> None:
        """Logs a warning the first time `what` happens, then only at debug level."""
        level = logging.DEBUG if what in self._warned else logging.WARNING
        self._warned.add(what)
        logger.log(level, message, *args)


def _name(tokens: int, digest: str) -> str:
    return f"{tokens}-{digest[:40]}{SUFFIX}"


def _version(status: os.stat_result) -> tuple[int, int, int, int]:
    return (status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns)


def _remove(path: Path) -> bool:
    """Deletes `path` (not a directory); whether it is gone."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def _refresh(file: Path | int) -> None:
    """Marks a file (a path or an open descriptor) as just used: the LRU order is the files'
    modification times. (Not `Path.touch`, which would create an empty file if a trim deleted
    it meanwhile.) A read-only directory just keeps its order."""
    with contextlib.suppress(OSError):
        os.utime(file)


def _unpack(payload: memoryview, specs: list[Spec]) -> list[np.ndarray]:
    """The arrays `specs` describe, in order, viewing `payload` (whose size the caller has
    checked against them)."""
    arrays, offset = [], 0
    for dtype_name, shape in specs:
        dtype = np.dtype(dtype_name)
        count = int(np.prod(shape, dtype=np.int64))
        array = np.frombuffer(payload, dtype=dtype, count=count, offset=offset)
        arrays.append(array.reshape(shape))
        offset += count * dtype.itemsize
    return arrays
