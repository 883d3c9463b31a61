"""Faults in the on-disk prefix cache (lily.engine.prefix_disk, `cache_dir`): whatever is in the
directory, or not, costs at most a recompute: never an error, a hang, memory or a wrong answer.

The chat tests answer a short conversation on the demo model from a copy of a directory holding
its saved prefixes, after breaking something, and compare with an engine that reuses nothing.
The forged files are what someone who can write the directory could plant: files whose tag is
an unkeyed SHA-256 (without the installation's key), and, to check everything a file says
against the model as well, files sealed with the key."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import shutil
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lily
from lily.api import Lily
from lily.checkpoint.loader import load_checkpoint, resolve_model
from lily.engine import prefix_disk
from lily.engine.prefix_disk import DiskPrefixCache, model_identity

MIN_TOKENS = 16
PARAMS: dict[str, Any] = {
    "max_tokens": 2,
    "temperature": 0.8,
    "seed": 11,
    "chat_template_kwargs": {"enable_thinking": False},
}


def _messages(first_word: str = "word0") -> list[dict[str, str]]:
    words = " ".join([first_word, *(f"word{i}" for i in range(1, 12))])
    return [{"role": "system", "content": words}, {"role": "user", "content": "Summarize."}]


A, B = _messages("word0"), _messages("word1")  # the same length, other tokens


def _load(cache_dir: Path | None = None, **options: Any) -> Lily:
    if cache_dir is not None:
        options.update(cache_dir=cache_dir, cache_disk_min_tokens=MIN_TOKENS)
    return lily.load("demo", device="sim", max_seq=256, **options)


def _conversation(llm: Lily, messages: list[dict[str, str]]) -> list[int]:
    """The tokens of `messages` without the generation prompt: the longest prefix saved."""
    text = llm.chat_template.render(messages, add_generation_prompt=False, enable_thinking=False)
    return llm.tokenizer.encode(text)


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    """The uncached answers to A and B, and their conversations' tokens."""
    with _load(cache_memory=0) as llm:
        found = {
            name: llm.chat.completions.create(messages=messages, **PARAMS).choices[0].message
            for name, messages in (("A", A), ("B", B))
        }
        found["A tokens"], found["B tokens"] = _conversation(llm, A), _conversation(llm, B)
    assert len(found["A tokens"]) == len(found["B tokens"])
    assert found["A tokens"] != found["B tokens"]
    return found


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory, expected: dict[str, Any]) -> Path:
    """A cache directory holding A's prefixes, as a first run leaves it."""
    directory = tmp_path_factory.mktemp("pristine")
    with _load(directory) as llm:
        reply = llm.chat.completions.create(messages=A, **PARAMS)
    assert reply.choices[0].message == expected["A"]
    assert _longest(directory)[0] == len(expected["A tokens"])
    return directory


@pytest.fixture
def cache(tmp_path: Path, pristine: Path) -> Path:
    directory = tmp_path / "cache"
    shutil.copytree(pristine, directory)
    return directory


def _longest(directory: Path) -> tuple[int, Path]:
    return max((int(p.name.split("-")[0]), p) for p in directory.glob("*.prefix"))


def _ask(llm: Lily, messages: list[dict[str, str]]) -> tuple[Any, int]:
    reply = llm.chat.completions.create(messages=messages, **PARAMS)
    return reply.choices[0].message, reply.usage.prompt_tokens_details.cached_tokens


# -- forging files --------------------------------------------------------------------------------


def _keyed(body: bytes) -> bytes:
    """The tag Lily's own writer puts on `body` (with this installation's key)."""
    if not hasattr(prefix_disk, "default_key"):
        return hashlib.sha256(body).digest()  # a Lily without keys trusts a plain checksum
    return hmac.new(prefix_disk.default_key(), body, hashlib.sha256).digest()


def _unkeyed(body: bytes) -> bytes:
    return hashlib.sha256(body).digest()


Change = Callable[[dict, list[np.ndarray]], tuple[bytes | dict, list[np.ndarray]]]


def _forge(source: Path, target: Path, change: Change, seal: Callable[[bytes], bytes]) -> None:
    """Writes at `target` the file `source` with its header and arrays changed, sealed anew."""
    data = source.read_bytes()
    magic, body = data[:8], data[8 + 32 :]
    (length,) = struct.unpack_from("<Q", body)
    header = json.loads(body[8 : 8 + length])
    arrays, offset = [], 8 + length
    for dtype, shape in header["arrays"]:
        count = int(np.prod(shape))
        arrays.append(np.frombuffer(body, dtype, count, offset).reshape(shape))
        offset += count * np.dtype(dtype).itemsize
    header, arrays = change(header, arrays)
    if isinstance(header, dict):
        header["arrays"] = [[a.dtype.str, list(a.shape)] for a in arrays]
        header = json.dumps(header).encode()
    body = struct.pack("<Q", len(header)) + header + b"".join(a.tobytes() for a in arrays)
    target.write_bytes(magic + seal(body) + body)


def _deep_header(header: dict, arrays: list[np.ndarray]) -> tuple[bytes, list[np.ndarray]]:
    return b"[" * 100_000 + b"]" * 100_000, arrays


def _bad_rows(header: dict, arrays: list[np.ndarray]) -> tuple[dict, list[np.ndarray]]:
    return {**header, "rows": "2"}, arrays


def _rows_of_another_shape(header: dict, arrays: list[np.ndarray]) -> tuple[dict, list]:
    rows = [a.reshape(a.shape[0] * a.shape[2], a.shape[1], 1) for a in arrays[1:5]]
    return header, [arrays[0], *rows, *arrays[5:]]


def _one_number_states(header: dict, arrays: list[np.ndarray]) -> tuple[dict, list]:
    return header, [*arrays[:5], *(a.reshape(-1)[:1] for a in arrays[5:])]


def _float64_rows(header: dict, arrays: list[np.ndarray]) -> tuple[dict, list]:
    return header, [arrays[0], *(a.astype(np.float64) for a in arrays[1:5]), *arrays[5:]]


FORGERIES = [_deep_header, _bad_rows, _rows_of_another_shape, _one_number_states, _float64_rows]


@pytest.mark.parametrize("change", FORGERIES, ids=lambda f: f.__name__.strip("_"))
def test_a_sealed_file_that_does_not_fit_the_model_is_deleted_not_used(cache, expected, change):
    """Bad fields, deep headers, other shapes or dtypes: checked against the model, deleted."""
    demo = load_checkpoint(resolve_model("demo"))
    assert len(demo.config.full_attention_layers) == 2  # 4 rows arrays: the changes assume it
    length, path = _longest(cache)
    _forge(path, path, change, _keyed)
    with _load(cache) as llm:
        message, cached = _ask(llm, A)
        assert llm.engine.prefix_cache.disk.rejected == 1
    assert message == expected["A"]
    assert cached < length
    assert path.read_bytes()[:8] == b"LILYPFX2"  # written again, as Lily writes it


def test_a_file_planted_under_another_prompts_name_does_not_answer_it(cache, expected):
    """Poisoning: A's state, relabelled as B's prefix with a fresh checksum, is not used."""
    length, path = _longest(cache)
    b_tokens = expected["B tokens"]
    with _load(cache) as llm:
        disk = llm.engine.prefix_cache.disk

        def relabel(header: dict, arrays: list[np.ndarray]) -> tuple[dict, list[np.ndarray]]:
            if "prefix" in header:  # whatever names the prefix, as Lily computes it
                ids = np.asarray(b_tokens, np.uint32).tobytes()
                header["prefix"] = hashlib.sha256(disk.identity.encode() + ids).hexdigest()
            return header, [np.asarray(b_tokens, np.uint32), *arrays[1:]]

        _forge(path, disk.path_of(b_tokens), relabel, _unkeyed)
        message, cached = _ask(llm, B)
        assert disk.rejected == 1
    assert cached < length
    assert message == expected["B"]


def test_a_deleted_directory_costs_a_recompute_and_is_made_again(cache, expected):
    with _load(cache) as llm:
        shutil.rmtree(cache)
        message, cached = _ask(llm, A)
    assert (message, cached) == (expected["A"], 0)
    assert _longest(cache)[0] == len(expected["A tokens"])


def _refused_under(monkeypatch: pytest.MonkeyPatch, directory: Path, *names: str) -> None:
    """Makes the `os` functions `names` fail on `directory`'s files as on a read-only disk
    (open descriptors too), as they fail for a user who owns none of them."""

    def refusing(original: Callable[..., Any]) -> Callable[..., Any]:
        def call(target: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(target, int) or str(directory) in os.fsdecode(target):
                raise PermissionError(30, "Read-only file system", str(target))
            return original(target, *args, **kwargs)

        return call

    for name in names:
        monkeypatch.setattr(os, name, refusing(getattr(os, name)))


def test_a_read_only_directory_serves_its_files(cache, expected, monkeypatch):
    length, _ = _longest(cache)
    with _load(cache) as llm:
        _refused_under(monkeypatch, cache, "utime", "unlink")
        message, cached = _ask(llm, A)
    assert (message, cached) == (expected["A"], length)


def test_a_damaged_file_that_cannot_be_deleted_is_ignored(cache, expected, monkeypatch):
    length, path = _longest(cache)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    with _load(cache) as llm:
        _refused_under(monkeypatch, cache, "utime", "unlink")
        message, cached = _ask(llm, A)
        assert llm.engine.prefix_cache.disk.rejected == 1
    assert message == expected["A"]
    assert cached < length
    assert path.read_bytes() == bytes(data)


# -- the directory, file by file (no model) -------------------------------------------------------

ROWS = [np.ones((2, 0, 4), np.uint16)]  # the unit tests' engine: 2 heads of 4 values, 8 floats
STATE = [np.zeros(8, np.float32)]


def _disk(directory: Path, **options: Any) -> DiskPrefixCache:
    disk = DiskPrefixCache(directory, "m", min_tokens=1, **options)
    if hasattr(prefix_disk, "StateLayout"):
        disk.layout = prefix_disk.StateLayout.of("bf16", ROWS, STATE)  # as the engine tells it
    return disk


def _save(disk: DiskPrefixCache, tokens: list[int]) -> Path:
    disk.save(tokens, [np.ones((2, len(tokens), 4), np.uint16)], STATE)
    return disk.path_of(tokens)


def _in_thread(call: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    """(whether `call` returned within `timeout` seconds, its result)."""
    result: list[Any] = []
    worker = threading.Thread(target=lambda: result.append(call()), daemon=True)
    worker.start()
    worker.join(timeout)
    return not worker.is_alive(), result[0] if result else None


def test_a_fifo_under_a_cache_files_name_does_not_block(tmp_path):
    disk = _disk(tmp_path)
    path = _save(disk, list(range(20)))
    path.unlink()
    os.mkfifo(path)
    returned, entry = _in_thread(lambda: disk.load_longest(list(range(21))), timeout=20)
    if not returned:
        with open(path, "wb"):  # lets the blocked reader go on
            pass
    assert returned, "the lookup waited for a writer on the FIFO"
    assert entry is None and not os.path.lexists(path)


@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_large_file_is_refused_without_reading_it(tmp_path, planted):
    """A link to a large file, or a large file, where a small entry should be."""
    disk = _disk(tmp_path / "cache")
    path = _save(disk, list(range(20)))
    large = tmp_path / "large"
    with open(large, "wb") as f:
        f.truncate(256 << 20)  # sparse: no disk used
    path.unlink()
    if planted == "link":
        path.symlink_to(large)
    else:
        os.rename(large, path)
    tracemalloc.start()
    try:
        entry = disk.load_longest(list(range(21)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert entry is None and not os.path.lexists(path)
    assert peak < 8 << 20
    if planted == "link":
        assert large.stat().st_size == 256 << 20  # the link went, not what it pointed at


def _leave_a_temporary_file(disk: DiskPrefixCache, tokens: list[int]) -> Path:
    """Saves `tokens` as a writer killed before its rename would: its temporary file stays."""
    before = set(disk.directory.iterdir())

    def killed(*args: Any) -> None:
        raise OSError("killed")

    replace, unlink = os.replace, os.unlink
    os.replace, os.unlink = killed, lambda *args, **kwargs: None
    try:
        with pytest.raises(OSError, match="killed"):
            _save(disk, tokens)
    finally:
        os.replace, os.unlink = replace, unlink
    (left,) = set(disk.directory.iterdir()) - before
    return left


def _files_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.iterdir() if p.is_file())


def test_temporary_files_count_and_those_of_a_dead_writer_are_deleted(tmp_path):
    disk = _disk(tmp_path, max_bytes=2_500)  # an entry of 20 tokens is about 700 bytes
    stale = _leave_a_temporary_file(disk, [1] * 20)
    os.utime(stale, (1, 1))  # written to long ago: its writer is gone
    fresh = _leave_a_temporary_file(disk, [2] * 20)  # a writer still at work
    for n in range(3, 7):
        _save(disk, [n] * 20)
    assert not stale.exists() and fresh.exists()
    assert _files_bytes(tmp_path) <= 2_500


def test_a_directory_named_like_a_cache_file_neither_breaks_trims_nor_lookups(tmp_path):
    disk = _disk(tmp_path, max_bytes=2_500)
    tokens = list(range(20))
    planted = disk.path_of(tokens)
    planted.mkdir()
    (planted / "inside").write_bytes(b"x")  # not removable
    os.utime(planted, (1, 1))  # the least recently used
    for n in range(3, 9):
        _save(disk, [n] * 20)
    assert _files_bytes(tmp_path) <= 2_500
    assert disk.load_longest([*tokens, 5]) is None
    assert planted.is_dir()


def test_ten_thousand_planted_names_do_not_slow_a_lookup(tmp_path):
    disk = _disk(tmp_path)
    for n in range(1, 10_001):
        (tmp_path / f"{n}-{secrets.token_hex(20)}.prefix").write_bytes(b"")
    saved = _save(disk, list(range(5000)))
    start = time.perf_counter()
    entry = disk.load_longest(list(range(10_001)))
    elapsed = time.perf_counter() - start
    assert entry is not None and entry.tokens == list(range(5000)) and saved.exists()
    assert elapsed < 1.0  # a lookup hashing each listed prefix separately took seconds


# -- the identity of the weights ------------------------------------------------------------------


def test_a_checkpoint_differing_between_the_sampled_bytes_has_another_identity(
    tmp_path, monkeypatch
):
    """Two checkpoints with the same config, differing only in weights 1.5 MB into a shard."""
    original = resolve_model("demo")
    monkeypatch.setenv("LILY_CACHE", str(tmp_path / "cache"))  # where digests are remembered
    copy = tmp_path / "edited"
    shutil.copytree(original, copy)
    (shard,) = [p for p in copy.glob("*.safetensors") if p.stat().st_size > 3 << 20]
    with open(shard, "r+b") as f:
        f.seek(3 << 19)
        byte = f.read(1)
        f.seek(3 << 19)
        f.write(bytes([byte[0] ^ 0x01]))
    identities = {model_identity(load_checkpoint(path), "device-bf16") for path in (original, copy)}
    assert len(identities) == 2


def test_an_aligned_copys_shard_is_identified_by_its_store_entry_without_reading_it(
    tmp_path, monkeypatch
):
    from lily.checkpoint import loader as checkpoint

    monkeypatch.setenv("LILY_CACHE", str(tmp_path / "cache"))
    digest = "ab" * 32
    stored = tmp_path / "cache" / "aligned" / "shards" / digest / checkpoint.ALIGNED_SHARD
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"weights")
    served = tmp_path / "served.safetensors"
    os.link(stored, served)

    def hashing(path: Path) -> str:
        raise AssertionError(f"{path} was hashed")

    monkeypatch.setattr(checkpoint, "_content_digest", hashing)
    assert checkpoint.shard_digest(served) == digest
